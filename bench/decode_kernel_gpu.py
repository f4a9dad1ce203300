"""The in-place decode kernel (`jaxrl.models.decode_kernel`) on a GPU: its errors against the XLA
decode attention and its speed against it, at a Llama 3 8B layer's heads.

    python -m bench.decode_kernel_gpu            # on a machine with an NVIDIA GPU
    python -m bench.decode_kernel_gpu --cpu      # the same checks at tiny shapes, interpret mode

1. Errors (max |a - b| / max |b|) of `decode_attention` against
   `jax.nn.dot_product_attention(..., implementation="xla")` with a per-row prefix mask, fp32
   (highest matmul precision) and bf16, rows of different lengths, a cache with more rows than
   queries, a left-padded row, and one layer of a stacked cache.
2. Milliseconds (median of `--steps` calls) of one layer's decode attention: the kernel reading
   the cache in place, and the XLA form as the engine ran it before (the prefix `[:span]` sliced
   out, attended, the new key written); and the kernel's HBM bandwidth over the live keys and
   values it reads (each row's length x K x D x 2 x itemsize).
3. The engine on a tiny GQA model, greedy, the kernel form ("auto" on a GPU) against the XLA form:
   tokens equal, log-probs within 1e-3 (bf16 compute).

Results: printed, and (on a GPU) bench/results/decode_kernel_gpu.{md,json}.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time


def _median_ms(fn, q, k, v, *rest, steps: int) -> float:
    """Median milliseconds of `fn(q, k, v, *rest) -> (out, k, v)`, the cache donated and fed
    back (as the engine's decode loop carries it)."""
    import jax
    import numpy as np

    _, k, v = jax.block_until_ready(fn(q, k, v, *rest))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        _, k, v = jax.block_until_ready(fn(q, k, v, *rest))
        times.append(time.perf_counter() - start)
    return float(np.median(times) * 1e3)


def _inputs(rng, b, rows, c, kv, g, d, dtype, lengths):
    import jax.numpy as jnp
    import numpy as np

    q = jnp.asarray(rng.normal(size=(b, 1, kv * g, d)), dtype)
    k = jnp.asarray(rng.normal(size=(rows, c, kv, d)), dtype)
    v = jnp.asarray(rng.normal(size=(rows, c, kv, d)), dtype)
    visible = np.arange(c)[None, :] < np.asarray(lengths)[:, None]
    return q, k, v, jnp.asarray(visible)


def _xla(q, k, v, visible):
    import jax

    b = q.shape[0]
    return jax.nn.dot_product_attention(
        q, k[:b], v[:b], mask=visible[:, None, None, :], implementation="xla"
    )


def errors(cpu: bool) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxrl.models import decode_kernel

    rng = np.random.default_rng(0)
    shapes = [(3, 4, 64, 2, 2, 16)] if cpu else [(8, 12, 2048, 8, 4, 128), (5, 5, 512, 2, 8, 64)]
    rows_out = []
    for b, rows, c, kv, g, d in shapes:
        lengths = rng.integers(1, c + 1, size=b)
        for dtype in (jnp.float32, jnp.bfloat16):
            q, k, v, visible = _inputs(rng, b, rows, c, kv, g, d, dtype, lengths)
            padded = np.asarray(visible).copy()
            padded[0, : min(5, int(lengths[0]) - 1)] = False  # left padding in row 0
            padded = jnp.asarray(padded)
            with jax.default_matmul_precision("highest"):
                ref = _xla(q, k, v, padded).astype(jnp.float32)
                out = decode_kernel.decode_attention(q, k, v, padded).astype(jnp.float32)
                stacked = decode_kernel.decode_attention(
                    q, jnp.stack([v, k]), jnp.stack([k, v]), padded, layer=jnp.int32(1)
                ).astype(jnp.float32)
            scale = float(jnp.abs(ref).max())
            rows_out.append(
                dict(
                    shape=f"B {b} (cache {rows}) C {c} K {kv} G {g} D {d}",
                    dtype=jnp.dtype(dtype).name,
                    error=float(jnp.abs(out - ref).max()) / scale,
                    stacked_error=float(jnp.abs(stacked - ref).max()) / scale,
                )
            )
            print(rows_out[-1], flush=True)
    return rows_out


def speed(cpu: bool, steps: int) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxrl.models import decode_kernel

    rng = np.random.default_rng(1)
    # An 8B layer on one GPU: 32 K/V heads of 8, 32 query heads; rows at the mean span.
    b, c, kv, g, d = (4, 64, 2, 2, 16) if cpu else (32, 2048, 8, 4, 128)
    out = []
    for span in (c // 2, 3 * c // 4):
        lengths = np.full(b, span)
        q, k, v, visible = _inputs(rng, b, b, c, kv, g, d, jnp.bfloat16, lengths)
        new = jnp.asarray(rng.normal(size=(b, 1, kv, d)), jnp.bfloat16)
        index = jnp.asarray(lengths - 1, jnp.int32)

        @functools.partial(jax.jit, donate_argnums=(1, 2))
        def in_place(q, k, v, visible, new, index):
            k = decode_kernel.write_rows(k, new, index)
            v = decode_kernel.write_rows(v, new, index)
            return decode_kernel.decode_attention(q, k, v, visible), k, v

        @functools.partial(jax.jit, donate_argnums=(1, 2), static_argnames=("span",))
        def xla_prefix(q, k, v, visible, new, index, span):
            rows = jnp.arange(q.shape[0])
            kp = k[:, :span].at[rows, index].set(new[:, 0])
            vp = v[:, :span].at[rows, index].set(new[:, 0])
            o = _xla(q, kp, vp, visible[:, :span])
            return o, k.at[:, :span].set(kp), v.at[:, :span].set(vp)

        kernel_ms = _median_ms(in_place, q, k, v, visible, new, index, steps=steps)
        q, k, v, visible = _inputs(rng, b, b, c, kv, g, d, jnp.bfloat16, lengths)
        xla_ms = _median_ms(
            functools.partial(xla_prefix, span=span), q, k, v, visible, new, index, steps=steps
        )
        live = b * span * kv * d * 2 * 2  # keys and values read, bf16
        out.append(
            dict(
                shape=f"B {b} C {c} span {span} K {kv} G {g} D {d} bf16",
                kernel_ms=kernel_ms,
                xla_prefix_ms=xla_ms,
                kernel_gbs=live / kernel_ms / 1e6,
            )
        )
        print(out[-1], flush=True)
    return out


def engine(cpu: bool) -> dict:
    import jax
    import numpy as np
    from flax import nnx

    from jaxrl.generation.engine import Engine, Request
    from jaxrl.generation.sampling import SamplingConfig
    from jaxrl.models.config import ModelConfig
    from jaxrl.models.transformer import Transformer, decode_attention_form

    config = ModelConfig(
        "llama", 256, 128, 256, 2, 8, 2, 64, max_position_embeddings=512,
        dtype="float32" if cpu else "bfloat16",
    )  # fmt: skip
    model = Transformer(config, rngs=nnx.Rngs(0), init_std=0.3)
    results = {}
    for form in ("pallas_gpu" if cpu else "auto", "xla"):
        e, params = Engine.for_model(model, num_slots=8, steps_per_call=8)
        for i, n in enumerate((40, 17, 29)):
            e.submit(Request(i, [1, 5 + i, 7, 9][: 2 + i], 2, SamplingConfig(n, greedy=True)))
        with decode_attention_form(form):
            results[form] = {grp.request_id: grp for grp in e.run(params, jax.random.key(0))}
    a, b = results.values()
    same = all(np.array_equal(a[i].tokens_gn, b[i].tokens_gn) for i in a)
    gap = max(float(np.abs(a[i].logprobs_gn - b[i].logprobs_gn).max()) for i in a)
    row = dict(engine_tokens_equal=same, engine_logprob_gap=gap)
    print(row, flush=True)
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="tiny shapes, interpret mode")
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args(argv)
    if args.cpu:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    if not args.cpu and jax.default_backend() != "gpu":
        sys.exit(f"bench.decode_kernel_gpu needs a GPU (JAX runs on {jax.default_backend()}); "
                 "--cpu checks it at tiny shapes in interpret mode")  # fmt: skip
    from bench.common import write_results

    rows = errors(args.cpu) + speed(args.cpu, args.steps if not args.cpu else 2)
    rows.append(engine(args.cpu))
    device = jax.devices()[0].device_kind
    columns = [
        ("shape", "shape"), ("dtype", "dtype"), ("error", "error vs XLA"),
        ("stacked_error", "stacked cache error"), ("kernel_ms", "kernel ms"),
        ("xla_prefix_ms", "XLA prefix ms"), ("kernel_gbs", "kernel GB/s (live K/V)"),
        ("engine_tokens_equal", "engine tokens equal"), ("engine_logprob_gap", "log-prob gap"),
    ]  # fmt: skip
    if args.cpu:  # a check of the script itself: nothing written
        return
    note = f"`python -m bench.decode_kernel_gpu` on {device}"
    print(write_results("decode_kernel_gpu", rows, columns, note))


if __name__ == "__main__":
    main(sys.argv[1:])

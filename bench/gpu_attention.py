"""The Pallas Triton flash attention (`jaxrl.models.gpu_attention`) on a GPU: its errors against
a dense fp32 reference and its speed against the XLA attention, forward and forward + backward.

    python bench/gpu_attention.py            # on a machine with an NVIDIA GPU
    python bench/gpu_attention.py --cpu      # the same checks at tiny shapes, interpret mode

1. Errors (max |a - b| / max |b| over the whole tensor) of the output and dq, dk, dv against a
   dense reference in fp32 with the highest matmul precision, on a padded batch (left and right
   padding) and a shared-prompt row, fp32 and bf16 inputs, GQA, several block sizes.
2. Milliseconds (median of `--steps` calls) and TFLOP/s (causal: half the dense FLOPs, 4 B H T^2 D
   forward, 2.5 times that backward) of the kernel and of the XLA path
   (`jax.nn.dot_product_attention(..., mask, implementation="xla")`, what GPU plans use) at a
   Llama 3 8B layer's heads, bf16, and of block-size variants.

Loads the module by path (no `jaxrl` import), so it runs with any JAX that has Pallas Triton.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load_module():
    spec = importlib.util.spec_from_file_location(
        "gpu_attention", ROOT / "jaxrl" / "models" / "gpu_attention.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cpu", action="store_true", help="tiny shapes in interpret mode")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)
    if args.cpu:
        os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    import jax.numpy as jnp
    import numpy as np

    ga = _load_module()
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}", flush=True)

    def segment_mask(segment, prefix):
        t = segment.shape[-1]
        visible = (segment[:, :, None] == segment[:, None, :]) | (
            prefix[:, :, None] == segment[:, None, :]
        )
        return jnp.tril(jnp.ones((t, t), bool))[None] & visible & (segment[:, None, :] > 0)

    reference = ga.dense_reference

    def value_and_grads(attention):
        @jax.jit
        def run(q, k, v, segment, prefix, w):
            def loss(q, k, v):
                out = attention(q, k, v, segment, prefix)
                return (out.astype(jnp.float32) * w).sum(), out

            (_, out), grads = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(q, k, v)
            return out, grads

        return run

    def layouts(b, t):
        valid = np.zeros((b, t), np.int32)
        for r in range(b):
            n = t - (r * t) // (2 * b) - 3
            if r % 2:
                valid[r, :n] = 1  # right padding
            else:
                valid[r, t - n :] = 1  # left padding
        segment, prefix = np.zeros((b, t), np.int32), np.zeros((b, t), np.int32)
        cuts = [0, t // 8, t // 8 + t // 4, t // 2 + t // 16, t - t // 8, t - 5]
        for i, (a, z) in enumerate(zip(cuts[:-1], cuts[1:], strict=True)):
            segment[:, a:z], prefix[:, a:z] = i + 1, 1  # a prompt and 4 completions
        return {"padded": (valid, valid), "shared_prompt": (segment, prefix)}

    def rel(a, b):
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        return float(jnp.abs(a - b).max() / jnp.abs(b).max())

    interpret = args.cpu
    shapes = (
        [(2, 64, 4, 2, 32, dict(block_q=32, block_k=16, block_q_bwd=16, block_k_bwd=32))]
        if args.cpu
        else [
            (2, 1024, 8, 4, 128, {}),
            (2, 1024, 8, 2, 64, dict(block_q=64, block_k=64, block_q_bwd=32, block_k_bwd=64)),
            (2, 1000, 4, 2, 16, {}),
            (1, 300, 4, 4, 80, dict(block_q=64, block_k=32, block_q_bwd=32, block_k_bwd=32)),
        ]
    )
    rng = np.random.default_rng(0)
    print("errors: max |a - b| / max |b| against the dense fp32 reference", flush=True)
    for b, t, h, kv, d, blocks in shapes:
        q, w = (rng.normal(size=(b, t, h, d)).astype(np.float32) for _ in range(2))
        k, v = (rng.normal(size=(b, t, kv, d)).astype(np.float32) for _ in range(2))
        want_run = value_and_grads(reference)
        for dtype in (jnp.float32, jnp.bfloat16):
            got_run = value_and_grads(
                lambda *a, blocks=blocks: ga.flash_attention(*a, interpret=interpret, **blocks)
            )
            qd, kd, vd = (jnp.asarray(x, dtype) for x in (q, k, v))
            for name, (segment, prefix) in layouts(b, t).items():
                segment, prefix = jnp.asarray(segment), jnp.asarray(prefix)
                out, grads = got_run(qd, kd, vd, segment, prefix, w)
                out_ref, grads_ref = want_run(qd, kd, vd, segment, prefix, w)
                finite = all(bool(jnp.isfinite(x).all()) for x in (out, *grads))
                errors = [rel(out, out_ref)] + [
                    rel(a, b) for a, b in zip(grads, grads_ref, strict=True)
                ]
                print(
                    f"  B={b} T={t} H={h} K={kv} D={d} {jnp.dtype(dtype).name:8s} {name:13s} "
                    f"{blocks or 'default blocks'}: out {errors[0]:.2e} dq {errors[1]:.2e} "
                    f"dk {errors[2]:.2e} dv {errors[3]:.2e} finite {finite}",
                    flush=True,
                )

    b, t, h, kv, d = (1, 64, 4, 2, 32) if args.cpu else (2, 4096, 32, 8, 128)
    print(f"speed: B={b} T={t} H={h} K={kv} D={d} bf16 (TFLOP/s: causal FLOPs)", flush=True)
    q = jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.normal(size=(b, t, kv, d)), jnp.bfloat16) for _ in range(2))
    rows = {name: tuple(map(jnp.asarray, ids)) for name, ids in layouts(b, t).items()}
    flops = 4 * b * h * t * t * d / 2

    def xla(q, k, v, segment, prefix):
        mask = segment_mask(segment, prefix)[:, None]
        return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")

    def timed(fn, *xs):
        fn = jax.jit(fn)
        jax.block_until_ready(fn(*xs))
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            jax.block_until_ready(fn(*xs))
            times.append(time.perf_counter() - start)
        return float(np.median(times))

    def both(attention):
        def fwd(q, k, v, s, p):
            return attention(q, k, v, s, p)

        def grad(q, k, v, s, p):
            def loss(q, k, v):
                return attention(q, k, v, s, p).astype(jnp.float32).sum()

            return jax.grad(loss, (0, 1, 2))(q, k, v)

        return fwd, grad

    configs = [
        ("flash default", {}),
        ("flash q64 k64", dict(block_q=64, block_k=64)),
        ("flash q128 k128", dict(block_q=128, block_k=128)),
        ("flash bwd q32 k64", dict(block_q_bwd=32, block_k_bwd=64)),
        ("flash bwd q64 k128", dict(block_q_bwd=64, block_k_bwd=128)),
        ("flash bwd q32 k128", dict(block_q_bwd=32, block_k_bwd=128)),
    ]
    attentions = [("xla", xla)] + [
        (name, lambda *a, kw=kw: ga.flash_attention(*a, interpret=interpret, **kw))
        for name, kw in configs
    ]
    for name, attention in attentions:
        fwd, grad = both(attention)
        for layout, (segment, prefix) in rows.items():
            if name == "xla" and layout != "padded":
                continue  # the XLA path's time does not depend on the mask
            try:
                t_fwd = timed(fwd, q, k, v, segment, prefix)
                t_all = timed(grad, q, k, v, segment, prefix)
            except Exception as err:  # noqa: BLE001 - a config that fails is reported
                print(f"  {name:20s} FAILED: {type(err).__name__}: {str(err)[:300]}", flush=True)
                break
            print(
                f"  {name:20s} {layout:13s} forward {t_fwd * 1e3:7.2f} ms "
                f"({flops / t_fwd / 1e12:4.0f} TFLOP/s)  forward+backward {t_all * 1e3:7.2f} ms "
                f"({3.5 * flops / t_all / 1e12:4.0f} TFLOP/s)",
                flush=True,
            )


if __name__ == "__main__":
    main()

"""8-bit generator weights on this CPU: SmolLM2-135M decode tokens/s with the engine's weights
in fp32 and int8 (`GeneratorConfig.weights`, `jaxrl.generation.quantize`), side by side in one
process on one core, the formats alternating round by round; and the matmul rates behind them.

    python -m launch.fetch smollm2-135m-instruct            # the HF folder
    taskset -c 1 python -m bench.quantized_gen --model ~/.cache/jaxrl/smollm2-135m-instruct
    taskset -c 1 python -m bench.quantized_gen --matmul     # the kernels alone
    python -m bench.quantized_gen --smoke                   # a tiny random model, seconds

Each row count R runs R chat-templated arithmetic prompts (`bench.peers.workload`), one sample
each, `--new_tokens` at temperature 1 with EOS ignored (every row decodes its whole budget, so
each format does the same work), on an engine of R slots; a warm-up round per format (compiles),
then `--rounds` timed rounds, the formats alternating (the order reversed every round). The table
gives the median and the best tokens/s, and the ratio to fp32 at the same row count three ways
(medians, the median of each round's ratio to the fp32 round beside it, bests), with the 1-minute
load average before each round (the machine is shared). `--matmul`: one decode step's
projection shapes (30 layers of SmolLM2's MLP up projection, [R, 576] @ [576, 1536]) as fp32,
int8 weights converted to fp32 in the matmul, int8 weights converted to bf16, and int8 x int8 ->
int32 with per-row activation scales.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

FORMATS = ("native", "int8_weights", "int8_dynamic")


def matmul_rates(rows: int, repeats: int = 5) -> list[dict]:
    """GFLOP/s of a 30-layer chain of [rows, 576] @ [576, 1536] in each operand form."""
    import jax
    import jax.numpy as jnp

    from jaxrl.generation.quantize import quantize_kernel

    e, f, layers = 576, 1536, 30
    key = jax.random.key(0)
    x = jax.random.normal(key, (rows, e), jnp.float32)
    w = jax.random.normal(key, (layers, e, f), jnp.float32) * 0.02
    forms = {
        "fp32": w,
        "int8 weights -> fp32": quantize_kernel(w, 1, True, "int8_weights"),
        "int8 x int8 -> int32": quantize_kernel(w, 1, True, "int8_dynamic"),
    }

    def chain(x, kernel, bf16=False):
        def body(h, layer):
            if bf16:  # int8 weights converted to bf16, the activations rounded to bf16
                y = jax.lax.dot_general(
                    h.astype(jnp.bfloat16), layer.values.astype(jnp.bfloat16),
                    (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32,
                ) * layer.scales  # fmt: skip
            elif hasattr(layer, "quantized_matmul"):
                y = layer.quantized_matmul(h[:, None], 1)[:, 0]
            else:
                y = h @ layer
            return jnp.tanh(y[:, :e]), None

        return jax.lax.scan(body, x, kernel)[0]

    runs = {name: (jax.jit(chain), (x, k)) for name, k in forms.items()}
    runs["int8 weights -> bf16"] = (
        jax.jit(lambda x, k: chain(x, k, True)),
        (x, forms["int8 weights -> fp32"]),
    )
    times: dict[str, list[float]] = {name: [] for name in runs}
    for fn, args in runs.values():
        fn(*args).block_until_ready()
    for _ in range(repeats):
        for name, (fn, args) in runs.items():
            start = time.perf_counter()
            fn(*args).block_until_ready()
            times[name].append(time.perf_counter() - start)
    flops = 2 * rows * e * f * layers
    return [
        {"form": name, "rows": rows, "ms": 1e3 * statistics.median(t),
         "gflops": flops / statistics.median(t) / 1e9, "load_1min": os.getloadavg()[0]}
        for name, t in times.items()
    ]  # fmt: skip


def decode_rates(model_dir: str, rows_list, new_tokens: int, rounds: int, formats, smoke: bool):
    import jax
    import numpy as np
    from flax import nnx

    from bench.peers import workload
    from jaxrl.generation.engine import Engine
    from jaxrl.generation.engine_requests import Request
    from jaxrl.generation.quantize import weight_bytes
    from jaxrl.generation.sampling import SamplingConfig
    from jaxrl.models import hf
    from jaxrl.models.config import ModelConfig
    from jaxrl.models.transformer import Transformer

    if smoke:
        config = ModelConfig("llama", 256, 64, 128, 2, 4, 2, 16, max_position_embeddings=256)
        model = Transformer(config, rngs=nnx.Rngs(0))
        prompts = [[1, *range(5 + i % 7, 17 + i % 7)] for i in range(max(rows_list))]
    else:
        model = hf.load_model(model_dir)
        tokenizer = hf.load_tokenizer(model_dir)
        messages, _ = workload.smol_messages(0, max(rows_list))
        prompts = [tokenizer.apply_chat_template(m, add_generation_prompt=True) for m in messages]
        prompts = [list(x["input_ids"] if hasattr(x, "keys") else x) for x in prompts]
    sampling = SamplingConfig(max_new_tokens=new_tokens, temperature=1.0)
    out = []
    for rows in rows_list:
        engines = {}
        for fmt in formats:
            engine, params = Engine.for_model(model, num_slots=rows, eos_ids=(), weights=fmt)
            engines[fmt] = engine
        times: dict[str, list[float]] = {fmt: [] for fmt in formats}
        loads: dict[str, list[float]] = {fmt: [] for fmt in formats}
        tokens = {}
        for r in range(rounds + 1):
            order = formats if r % 2 == 0 else formats[::-1]
            for fmt in order:
                requests = [
                    Request(r * rows + i, p, 1, sampling) for i, p in enumerate(prompts[:rows])
                ]
                before = os.getloadavg()[0]
                start = time.perf_counter()
                groups = engines[fmt].generate(params, requests, jax.random.key(r))
                seconds = time.perf_counter() - start
                tokens[fmt] = int(sum(np.asarray(g.mask_gn).sum() for g in groups))
                if r:  # round 0: the warm-up (compiles)
                    times[fmt].append(seconds)
                    loads[fmt].append(before)
                print(f"[quantized_gen] rows {rows} round {r} {fmt}: {tokens[fmt] / seconds:.1f} "
                      f"tokens/s ({seconds:.1f} s, load {before:.1f})", flush=True)  # fmt: skip
        base = tokens["native"] / statistics.median(times["native"]) if "native" in times else None
        for fmt in formats:
            rate = tokens[fmt] / statistics.median(times[fmt])
            copy = engines[fmt].programs.engine_params(params)
            # Each round's ratio to the fp32 round beside it (the load moves between rounds).
            paired = [b / t for t, b in zip(times[fmt], times.get("native", []), strict=False)]
            out.append({
                "rows": rows, "weights": fmt, "tokens_per_s": rate,
                "best_tokens_per_s": tokens[fmt] / min(times[fmt]),
                "vs_fp32": rate / base if base else None,
                "vs_fp32_paired": statistics.median(paired) if paired else None,
                "vs_fp32_best": (min(times["native"]) / min(times[fmt])) if base else None,
                "tokens": tokens[fmt],
                "s_per_round": statistics.median(times[fmt]), "weight_mb": weight_bytes(copy) / 1e6,
                "load_1min": [round(x, 1) for x in loads[fmt]],
            })  # fmt: skip
            print(out[-1], flush=True)
        del engines
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=os.path.expanduser("~/.cache/jaxrl/smollm2-135m-instruct")
    )
    parser.add_argument("--rows", default="32,64")
    parser.add_argument("--new_tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--matmul", action="store_true", help="the kernels' rates only")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    from bench.common import machine, write_results
    from bench.peers.rl_step import load

    rows_list = [int(r) for r in args.rows.split(",")]
    command = "python -m bench.quantized_gen" + "".join(f" {a}" for a in (argv or sys.argv[1:]))
    command = os.environ.get("JAXRL_BENCH_COMMAND") or command  # `python -m bench`
    affinity = sorted(os.sched_getaffinity(0))
    note = f"`{command}`; {machine()}, cores {affinity}; {load()} before"
    if args.matmul:
        rows = [r for n in rows_list for r in matmul_rates(n)]
        columns = [("rows", "rows"), ("form", "operands"), ("ms", "ms / 30 matmuls"),
                   ("gflops", "GFLOP/s"), ("load_1min", "load (1 min)")]  # fmt: skip
        print(write_results("quantized_matmul", rows, columns, f"{note}, {load()} after"))
        return
    if args.smoke:
        rows_list, args.new_tokens, args.rounds = [4], 8, 1
    formats = tuple(f for f in args.formats.split(",") if f)
    rows = decode_rates(args.model, rows_list, args.new_tokens, args.rounds, formats, args.smoke)
    columns = [
        ("rows", "rows"), ("weights", "GeneratorConfig.weights"), ("tokens_per_s", "tokens/s"),
        ("best_tokens_per_s", "best tokens/s"), ("vs_fp32", "vs fp32 (medians)"),
        ("vs_fp32_paired", "vs fp32 (median of paired rounds)"),
        ("vs_fp32_best", "vs fp32 (bests)"),
        ("s_per_round", "s / round"), ("tokens", "tokens / round"),
        ("weight_mb", "engine weights MB"), ("load_1min", "load (1 min) per timed round"),
    ]  # fmt: skip
    name = "quantized_gen" + ("_smoke" if args.smoke else "")
    print(write_results(name, rows, columns, f"{note}, {load()} after"))


if __name__ == "__main__":
    main(sys.argv[1:])

"""Generation throughput: the static sampler and the continuous-batching engine against
`transformers` `generate` (PyTorch), same weights and workload.

Workload (every system): fp32, batch 32, prompts of 16 random tokens with the attention mask set,
64 new tokens, plain sampling (temperature 1, no top-k / top-p), EOS disabled so all produce
exactly batch x 64 tokens. The engine gets the 32 prompts as 32 requests of one sample each, with
32 slots and a cache of 16 + 64 positions. One warm-up call each, then the median of 3 timed
calls, interleaved; JAX's compile time (first call minus a steady call) is reported separately.
PyTorch runs with `torch.set_num_threads(2)`.

    python -m bench.gen            # rlbench-tiny and the ~100M Llama
    python -m bench.gen --smoke    # a few seconds, for CI

`--long_tail` runs the long-tail workload instead (`bench/gen_long_tail.py`: the continuous-
batching engine against this sampler and transformers on log-normal completion lengths).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import jax
import numpy as np
from flax import nnx

from bench.common import command, machine, write_results
from jaxrl.generation.engine import Engine, Request
from jaxrl.generation.sampler import Sampler
from jaxrl.generation.sampling import SamplingConfig
from jaxrl.models import hf
from jaxrl.models.presets import llama_100m, rlbench_tiny
from jaxrl.models.transformer import Transformer


def _jax_runner(model, prompts, new_tokens):
    """A callable that runs one timed generate; the first call compiles."""
    sampler, params = Sampler.for_model(
        model, prompt_buckets=(prompts.shape[1],), batch_buckets=(prompts.shape[0],)
    )
    sampling = SamplingConfig(new_tokens, ignore_eos=True)
    rows = prompts.tolist()

    def run(seed):
        start = time.perf_counter()
        out = sampler.generate(params, rows, sampling, jax.random.key(seed))
        assert out.mask_bn.all()
        return time.perf_counter() - start

    return run


def _engine_runner(model, prompts, new_tokens):
    """The engine on the same batch: one request per prompt, as many slots as prompts."""
    batch, prompt_len = prompts.shape
    engine, params = Engine.for_model(
        model, num_slots=batch, max_total_len=prompt_len + new_tokens, prompt_buckets=(prompt_len,)
    )
    sampling = SamplingConfig(new_tokens, ignore_eos=True)
    calls = iter(range(1 << 30))

    def run(seed):
        first = next(calls) * batch  # request ids are unique per engine run
        requests = [Request(first + i, p, 1, sampling) for i, p in enumerate(prompts.tolist())]
        start = time.perf_counter()
        out = engine.generate(params, requests, jax.random.key(seed))
        assert sum(int(g.mask_gn.sum()) for g in out) == batch * new_tokens
        return time.perf_counter() - start

    return run


def _torch_runner(hf_dir, prompts, new_tokens):
    import torch
    import transformers

    torch.set_num_threads(2)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    ids = torch.tensor(prompts)
    mask = torch.ones_like(ids)

    def run(seed):
        torch.manual_seed(seed)
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=mask,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=0,
            )
        assert out.shape == (ids.shape[0], ids.shape[1] + new_tokens), out.shape
        return time.perf_counter() - start

    return run


def measure(name, config, batch, prompt_len, new_tokens, repeats, with_torch=True) -> dict:
    """Warm-up of both sides, then `repeats` timed calls of each, interleaved (JAX, torch, JAX,
    ...) so that load from anything else on the machine hits both alike; medians."""
    model = Transformer(config, rngs=nnx.Rngs(0))
    prompts = np.random.default_rng(0).integers(3, config.vocab_size, size=(batch, prompt_len))
    tokens = batch * new_tokens
    runners = {
        "jax": _jax_runner(model, prompts, new_tokens),
        "engine": _engine_runner(model, prompts, new_tokens),
    }
    first = {k: run(0) for k, run in runners.items()}
    times = {k: [] for k in (*runners, "torch")}
    with tempfile.TemporaryDirectory() as tmp:
        if with_torch:
            hf.save_hf(model, tmp)
            runners["torch"] = _torch_runner(tmp, prompts, new_tokens)
            runners["torch"](0)
        for i in range(repeats):
            for k, run in runners.items():
                times[k].append(run(i + 1))
    median = {k: statistics.median(v) for k, v in times.items() if v}
    row = {
        "model": name,
        "params_m": round(config.num_params() / 1e6, 1),
        "batch": batch,
        "prompt": prompt_len,
        "new_tokens": new_tokens,
        "jax_tok_s": round(tokens / median["jax"], 1),
        "engine_tok_s": round(tokens / median["engine"], 1),
        "engine_vs_static": round(median["jax"] / median["engine"], 2),
        "jax_compile_s": round(max(first["jax"] - median["jax"], 0.0), 2),
        "engine_compile_s": round(max(first["engine"] - median["engine"], 0.0), 2),
    }
    if "torch" in median:
        row["torch_tok_s"] = round(tokens / median["torch"], 1)
        row["speedup"] = round(median["torch"] / median["jax"], 2)
        row["engine_speedup"] = round(median["torch"] / median["engine"], 2)
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, a few seconds")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no_torch", action="store_true", help="JAX side only")
    parser.add_argument("--long_tail", action="store_true", help="the long-tail workload")
    parser.add_argument(
        "--warm", action=argparse.BooleanOptionalAction, default=True,
        help="long tail: time a second run on the compiled programs (steady state)",
    )  # fmt: skip
    parser.add_argument("--prompts", type=int, default=256, help="long-tail prompts (x G=8)")
    parser.add_argument(
        "--prompts_100m", type=int, default=None, help="long-tail prompts for llama-100m"
    )
    parser.add_argument("--slots", type=int, default=64, help="engine slots = static batch rows")
    parser.add_argument("--steps_per_call", type=int, default=8, help="engine decode steps/call")
    parser.add_argument(
        "--systems", default="engine,static,transformers",
        help="long tail: comma-separated systems to run (engine, static, transformers)",
    )  # fmt: skip
    parser.add_argument(
        "--systems_100m", default=None, help="long tail: llama-100m systems (default: --systems)"
    )
    args = parser.parse_args(argv)
    if args.long_tail:
        from bench import gen_long_tail

        def systems(flag):
            chosen = tuple(s for s in flag.split(",") if s)
            unknown = set(chosen) - set(gen_long_tail.SYSTEMS)
            if unknown or not chosen:
                parser.error(f"--systems: {flag!r}; choose from {gen_long_tail.SYSTEMS}")
            return tuple(s for s in chosen if s != "transformers" or not args.no_torch)

        tiny_systems = systems(args.systems)
        smoke = [("rlbench-tiny", rlbench_tiny(num_layers=1), 4, 16, tiny_systems)]
        full = [
            ("rlbench-tiny", rlbench_tiny(), args.prompts, args.slots, tiny_systems),
            (
                "llama-100m",
                llama_100m(),
                args.prompts_100m or args.prompts,
                args.slots,
                systems(args.systems_100m or args.systems),
            ),
        ]
        gen_long_tail.main(args, smoke, full)
        return
    if args.smoke:
        cases = [("rlbench-tiny", rlbench_tiny(num_layers=1), 4, 8, 8)]
        repeats = 1
    else:
        cases = [
            ("rlbench-tiny", rlbench_tiny(), 32, 16, 64),
            ("llama-100m", llama_100m(), 32, 16, 64),
        ]
        repeats = args.repeats
    rows = []
    for name, config, batch, prompt_len, new_tokens in cases:
        row = measure(name, config, batch, prompt_len, new_tokens, repeats, not args.no_torch)
        print(json.dumps(row), flush=True)
        rows.append(row)
    columns = [
        ("model", "model"),
        ("params_m", "params (M)"),
        ("jax_tok_s", "static sampler tok/s"),
        ("engine_tok_s", "engine tok/s"),
        ("torch_tok_s", "transformers tok/s"),
        ("engine_vs_static", "engine / static"),
        ("speedup", "static / transformers"),
        ("engine_speedup", "engine / transformers"),
        ("jax_compile_s", "static compile (s)"),
        ("engine_compile_s", "engine compile (s)"),
    ]
    name = "gen_smoke" if args.smoke else "gen"
    print(write_results(name, rows, columns, f"`{command()}` on {machine()}"))


if __name__ == "__main__":
    main()

"""Long-tail generation workload: the continuous-batching engine against the static `Sampler` and
`transformers.generate`, same weights, same work.

Workload: `--prompts` prompts of 16 random tokens, G=8 samples each; each request's completion
length drawn from a log-normal (median 32, sigma 1, capped at 512 and at the context), EOS ignored
so that every system produces exactly those tokens. fp32, sampling at temperature 1.

* engine: `Engine(num_slots=--slots)`, every request submitted up front.
* static sampler: batches of `slots / G` prompts x G rows (the same number of rows as the engine's
  slots), each batch run to its longest request (`max_new_tokens` rounded up to a power of two to
  bound the compiles), every prompt prefilled G times.
* transformers: `generate` on the same static batches (PyTorch, 2 threads), to the batch's
  longest request.

Reported per system: kept tokens / s, utilisation (kept tokens / row-steps decoded), prefill
tokens computed, programs compiled. With `--warm` (the default outside `--smoke`) each JAX
system runs the workload twice on the same compiled programs and tok/s is the second run's
wall time (steady state: no tracing, no compiles); the first (cold) run's tok/s, wall time minus
XLA's backend compile time (tracing and lowering stay in it), and compile seconds are reported
beside it. `transformers` has nothing to compile and runs once.

    python -m bench.gen --long_tail                  # rlbench-tiny and the ~100M Llama
    python -m bench.gen --long_tail --smoke          # seconds, for CI
"""

from __future__ import annotations

import dataclasses
import json
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
from jaxrl.models.transformer import Transformer

GROUP = 8
PROMPT_LEN = 16

_compile_s = [0.0]


def _on_event(event: str, duration: float, **_) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _compile_s[0] += duration


jax.monitoring.register_event_duration_secs_listener(_on_event)


def workload(num_prompts: int, vocab: int, cap: int, seed: int = 0):
    """(prompts [n, 16], budgets [n]): log-normal lengths, median 32, sigma 1, in [1, cap]."""
    rng = np.random.default_rng(seed)
    prompts = rng.integers(3, vocab, size=(num_prompts, PROMPT_LEN))
    budgets = np.clip(np.round(rng.lognormal(np.log(32.0), 1.0, num_prompts)), 1, cap)
    return prompts, budgets.astype(int)


def _timed(fn):
    compile0, start = _compile_s[0], time.perf_counter()
    out = fn()
    wall = time.perf_counter() - start
    compile_s = _compile_s[0] - compile0
    return out, wall, compile_s


def _runs(go, warm: bool) -> dict:
    """Runs `go` (-> a result dict) once, or (`warm`) twice: the second run's figures, with the
    first's as `cold_*`."""
    out, wall, compile_s = _timed(go)
    result = out | dict(wall_s=wall, compile_s=compile_s, cold_wall_s=wall)
    if warm:
        out, wall, again = _timed(go)
        assert again == 0.0, f"the warm run compiled for {again:.1f} s"
        result = out | dict(wall_s=wall, compile_s=0.0, cold_wall_s=result["cold_wall_s"],
                            cold_compile_s=compile_s)  # fmt: skip
    return result


def run_engine(model, prompts, budgets, slots, steps_per_call, warm=False) -> dict:
    sampling = SamplingConfig(int(budgets.max()), ignore_eos=True)
    # The cache holds the longest prompt + completion of the workload (as `launch.rl` sizes it),
    # not the model's whole context.
    engine, params = Engine.for_model(
        model,
        num_slots=slots,
        steps_per_call=steps_per_call,
        max_total_len=PROMPT_LEN + int(budgets.max()),
    )
    requests = [
        Request(i, p.tolist(), GROUP, sampling, int(b))
        for i, (p, b) in enumerate(zip(prompts, budgets, strict=True))
    ]

    def go():
        before = dataclasses.replace(engine.stats)
        results = engine.generate(params, requests, jax.random.key(0))
        kept = sum(int(g.mask_gn.sum()) for g in results)
        assert kept == GROUP * budgets.sum(), (kept, GROUP * budgets.sum())
        s = engine.stats
        return dict(kept=kept, utilisation=(s.kept_tokens - before.kept_tokens)
                    / max(s.slot_steps - before.slot_steps, 1),
                    prefill_tokens=s.prefill_tokens - before.prefill_tokens,
                    compiles=s.num_traces)  # fmt: skip

    return _runs(go, warm)


def _static_batches(prompts, budgets, slots):
    per = max(slots // GROUP, 1)
    for start in range(0, len(prompts), per):
        yield prompts[start : start + per], budgets[start : start + per]


def run_static(model, prompts, budgets, slots, warm=False) -> dict:
    rows = (slots // GROUP) * GROUP
    sampler, params = Sampler.for_model(model, prompt_buckets=(PROMPT_LEN,), batch_buckets=(rows,))

    def go():
        kept = steps = prefill = 0
        for batch_prompts, batch_budgets in _static_batches(prompts, budgets, slots):
            new = 1 << int(np.ceil(np.log2(batch_budgets.max())))
            new = min(new, sampler.max_total_len - PROMPT_LEN)
            group_rows = np.repeat(batch_prompts, GROUP, axis=0).tolist()
            out = sampler.generate(
                params, group_rows, SamplingConfig(new, ignore_eos=True), jax.random.key(steps)
            )
            assert out.mask_bn.all()
            kept += GROUP * int(batch_budgets.sum())  # tokens past a request's budget are waste
            steps += rows * new
            prefill += rows * PROMPT_LEN
        return dict(kept=kept, utilisation=kept / steps, prefill_tokens=prefill,
                    compiles=sampler.num_traces)  # fmt: skip

    return _runs(go, warm)


def run_torch(hf_dir, prompts, budgets, slots) -> dict:
    import torch
    import transformers

    torch.set_num_threads(2)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    rows = (slots // GROUP) * GROUP

    def go():
        kept = steps = prefill = 0
        for batch_prompts, batch_budgets in _static_batches(prompts, budgets, slots):
            ids = torch.tensor(np.repeat(batch_prompts, GROUP, axis=0))
            new = int(batch_budgets.max())
            with torch.no_grad():
                out = model.generate(
                    ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                    top_k=0, top_p=1.0, max_new_tokens=new, min_new_tokens=new, pad_token_id=0,
                )  # fmt: skip
            assert out.shape[1] == PROMPT_LEN + new
            kept += GROUP * int(batch_budgets.sum())
            steps += ids.shape[0] * new
            prefill += ids.numel()
        return kept, steps, prefill

    torch.manual_seed(0)
    (kept, steps, prefill), wall, _ = _timed(go)
    assert rows >= GROUP
    return dict(kept=kept, wall_s=wall, cold_wall_s=wall, compile_s=0.0, utilisation=kept / steps,
                prefill_tokens=prefill, compiles=0)  # fmt: skip


SYSTEMS = ("engine", "static", "transformers")


def measure(
    name, config, num_prompts, slots, steps_per_call, systems=SYSTEMS, warm=False
) -> list[dict]:
    model = Transformer(config, rngs=nnx.Rngs(0))
    cap = min(512, config.max_position_embeddings - PROMPT_LEN)
    prompts, budgets = workload(num_prompts, config.vocab_size, cap)
    runners = {
        "engine": lambda: run_engine(model, prompts, budgets, slots, steps_per_call, warm),
        "static sampler": lambda: run_static(model, prompts, budgets, slots, warm),
        "transformers": lambda: run_torch(tmp, prompts, budgets, slots),
    }
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        if "transformers" in systems:
            hf.save_hf(model, tmp)
        for system, fn in runners.items():
            if system.split()[0] not in systems:
                continue
            r = fn()
            steady = max(r["wall_s"] - r["compile_s"], 1e-9)
            row = {
                "model": name,
                "system": system,
                "prompts": num_prompts,
                "slots": slots,
                "tok_s": round(r["kept"] / steady, 1),
                "cold_tok_s": round(
                    r["kept"]
                    / max(r["cold_wall_s"] - r.get("cold_compile_s", r["compile_s"]), 1e-9),
                    1,
                ),
                "utilisation": round(r["utilisation"], 3),
                "prefill_tokens": r["prefill_tokens"],
                "compiles": r["compiles"],
                "compile_s": round(r.get("cold_compile_s", r["compile_s"]), 2),
                "wall_s": round(r["wall_s"], 1),
                "kept_tokens": r["kept"],
                "median_len": float(np.median(budgets)),
                "max_len": int(budgets.max()),
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
    if rows and rows[0]["system"] == "engine":
        for row in rows:
            row["engine_speedup"] = round(rows[0]["tok_s"] / row["tok_s"], 2)
    return rows


def main(args, smoke_cases, full_cases) -> None:
    cases = smoke_cases if args.smoke else full_cases
    rows = []
    for name, config, prompts, slots, systems in cases:
        warm = args.warm and not args.smoke
        rows += measure(name, config, prompts, slots, args.steps_per_call, systems, warm)
    columns = [
        ("model", "model"),
        ("system", "system"),
        ("prompts", "prompts x 8"),
        ("tok_s", "tok/s"),
        ("cold_tok_s", "cold tok/s"),
        ("wall_s", "timed run s"),
        ("engine_speedup", "engine speed-up"),
        ("utilisation", "utilisation"),
        ("prefill_tokens", "prefill tokens"),
        ("compiles", "compiled programs"),
        ("compile_s", "compile (s)"),
    ]
    name = "gen_long_tail_smoke" if args.smoke else "gen_long_tail"
    print(write_results(name, rows, columns, f"`{command()}` on {machine()}"))

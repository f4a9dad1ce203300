"""Routing replay on a mixture-of-experts policy whose generator and trainer route differently:
the behaviour / trainer mismatch with and without `LossConfig.routing_replay`.

The perturbation: the generator's copy of the weights in bfloat16 (`GeneratorConfig.dtype`),
the trainer in float32, async with lag 0 (each batch sampled by the version it trains, on the
generator's own devices), so the only gap between the behaviour log-probs and the trainer's is
the generator's numerics, which also flip some routers' top-k near ties. Both runs start from
one SFT checkpoint of `configs/rl/arith_tiny_moe.gin` with the same seeds:

    python -m bench.routing_replay --sft_dir RUN/sft --workdir W [--steps 80]
    python -m bench.routing_replay --workdir W --summarize_only     # the table from W's runs

Per run, over its train steps: `routing/mismatch_fraction` (recorded (token, layer) choices the
trainer's routers make differently), `behaviour_kl` (KL(mu || pi) per token), AIPO's
`truncated_fraction` (tokens whose ratio hit rho), `abs_log_ratio_max`, `ratio_max`, and the
held-out greedy accuracy at the start and the end. Writes bench/results/routing_replay.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from bench.common import machine, run_rl, write_results  # noqa: E402

CONFIG = "configs/rl/arith_tiny_moe.gin"
RUNS = {"replay": "True", "no_replay": "False"}
COLUMNS = [
    ("run", "run"),
    ("steps", "steps"),
    ("mismatch_mean", "routing mismatch (mean)"),
    ("kl_mean", "behaviour KL (mean)"),
    ("kl_median", "behaviour KL (median)"),
    ("kl_max", "behaviour KL (max)"),
    ("truncated_mean", "AIPO truncated (mean)"),
    ("log_ratio_max", "max abs log-ratio"),
    ("ratio_max", "max ratio"),
    ("acc_start", "greedy acc. start"),
    ("acc_end", "greedy acc. end"),
]


def params(sft_dir: str, steps: int, replay: str) -> list[str]:
    return [
        "rl_main.sft = None",
        f"PolicySpec.init_from = '{sft_dir}'",
        f"RLConfig.total_steps = {steps}",
        f"RLConfig.eval_every_steps = {max(steps // 2, 1)}",
        "RLConfig.lag = 0",
        "RLConfig.max_staleness = 0",
        "rl_main.generator_config = @GeneratorConfig()",
        "GeneratorConfig.dtype = 'bfloat16'",
        f"LossConfig.routing_replay = {replay}",
    ]


def summarize(name: str, workdir: str) -> dict:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    steps = [r for r in records if "behaviour_kl" in r]
    evals = [r["eval/accuracy"] for r in records if "eval/accuracy" in r]
    kl = [r["behaviour_kl"] for r in steps]
    return {
        "run": name,
        "steps": len(steps),
        "mismatch_mean": statistics.mean(r["routing/mismatch_fraction"] for r in steps),
        "kl_mean": statistics.mean(kl),
        "kl_median": statistics.median(kl),
        "kl_max": max(kl),
        "truncated_mean": statistics.mean(r["truncated_fraction"] for r in steps),
        "log_ratio_max": max(r["abs_log_ratio_max"] for r in steps),
        "ratio_max": max(r["ratio_max"] for r in steps),
        "acc_start": evals[0],
        "acc_end": evals[-1],
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--sft_dir", help="an SFT checkpoint of configs/rl/arith_tiny_moe.gin")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--summarize_only", action="store_true")
    args = parser.parse_args(argv)
    if not args.summarize_only:
        if not args.sft_dir:
            parser.error("--sft_dir is required unless --summarize_only")
        for name, replay in RUNS.items():
            workdir = os.path.join(args.workdir, name)
            run_rl(CONFIG, workdir, params(args.sft_dir, args.steps, replay))
    rows = [summarize(name, os.path.join(args.workdir, name)) for name in RUNS]
    note = (
        f"python -m bench.routing_replay --sft_dir SFT --workdir W --steps {rows[0]['steps']} "
        f"(bf16 generator, fp32 trainer, async lag 0); {machine()}"
    )
    print(write_results("routing_replay", rows, COLUMNS, note))


if __name__ == "__main__":
    main()

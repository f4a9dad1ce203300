"""Soak run of the async default: does anything grow over hundreds of steps?

Runs `configs/rl/arith_tiny.gin` (async, fixed lag 2, trainer and generator on disjoint halves of
8 simulated CPU devices) for `--steps` RL steps from random weights (no SFT stage: the loop is
what is soaked), evaluating and saving every quarter of the run, and reads from its metrics.jsonl:
host RSS after warm-up (median over the tenth of the run after the first evaluation and save)
and at the end (median over the last tenth), the growth in %, the largest queue depth against the
queue's bound, the samples dropped and the staleness. Writes bench/results/soak.{json,md}.

    python -m bench.soak                 # 1200 steps, ~5 minutes on 2 CPU cores
    python -m bench.soak --steps 8       # the loop at its size for 8 steps
    python -m bench.soak --smoke         # 8 steps of a small batch: the plumbing (a test runs it)
"""

from __future__ import annotations

from bench import cpu_devices

cpu_devices.simulate(8)

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

import numpy as np  # noqa: E402

from bench.common import gin_values, run_rl  # noqa: E402
from jaxrl.infra.metrics import read_metrics  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, "configs", "rl", "arith_tiny.gin")


# --smoke: 4 prompts x 4 samples, no oversampling, 16 evaluation problems (the config's 16 x 8
# samples from 8x oversampling and its full evaluation are what the soak measures, not needed to
# check that the numbers are read back).
SMOKE_PARAMS = [
    "RLConfig.num_prompts = 4",
    "RLConfig.samples_per_prompt = 4",
    "RLConfig.oversample = 1",
    "RLConfig.eval_size = 16",
]


def soak(workdir: str, steps: int, extra: list[str] = ()) -> dict:
    every = max(steps // 4, 1)
    params = [
        "rl_main.sft = None",
        f"RLConfig.total_steps = {steps}",
        f"RLConfig.eval_every_steps = {every}",
        f"RLConfig.save_every_steps = {every}",
        *extra,
    ]
    seconds = run_rl(CONFIG, workdir, params)
    records = [r for r in read_metrics(os.path.join(workdir, "metrics.jsonl")) if r["step"] > 0]
    rss = np.array([r["host/rss_mb"] for r in records])
    window = max(len(records) // 10, 1)
    # Warm-up ends with the first evaluation and checkpoint (step `every`): by then every
    # program is compiled and every code path has run once. RSS swings by tens of MB within a
    # few steps (evaluations, saves, the allocator), so windows are compared by their medians.
    after_warmup = rss[every : every + window]
    end = rss[-window:]
    eighth = max(len(records) // 8, 1)
    queue_size = int(gin_values(CONFIG, [], "RLConfig.queue_size")["RLConfig.queue_size"])
    return {
        "steps": records[-1]["step"],
        "seconds": round(seconds, 1),
        "warmup_steps": every,
        "rss_after_warmup_mb": round(float(np.median(after_warmup)), 1),
        "rss_end_mb": round(float(np.median(end)), 1),
        "rss_growth_pct": round(100 * (np.median(end) / np.median(after_warmup) - 1), 2),
        "rss_max_mb": round(float(rss.max()), 1),
        "rss_median_by_eighth": [
            round(float(np.median(rss[k : k + eighth])), 1) for k in range(0, len(rss), eighth)
        ],
        "queue_depth_max": max(r["async/queue_depth"] for r in records),
        "queue_size": queue_size,
        "dropped_samples": records[-1]["async/dropped_samples"],
        "staleness_mean": round(records[-1]["async/staleness_mean"], 4),
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--workdir", default="")
    parser.add_argument(
        "--smoke", action="store_true", help="8 steps of a small batch (writes soak_smoke)"
    )
    args = parser.parse_args(argv)
    steps, extra = (8, SMOKE_PARAMS) if args.smoke else (args.steps, [])
    with tempfile.TemporaryDirectory(prefix="soak_") as tmp:
        row = soak(args.workdir or os.path.join(tmp, "run"), steps, extra)
    row["command"] = "python -m bench.soak" + "".join(f" {a}" for a in (argv or []))
    row["command"] = os.environ.get("JAXRL_BENCH_COMMAND") or row["command"]  # `python -m bench`
    print(json.dumps(row))
    from bench.common import write_results

    columns = [
        ("steps", "steps"), ("warmup_steps", "warm-up steps"),
        ("rss_after_warmup_mb", "RSS after warm-up (MB, median)"),
        ("rss_end_mb", "RSS at the end (MB, median)"), ("rss_growth_pct", "growth %"),
        ("rss_max_mb", "RSS max (MB)"), ("rss_median_by_eighth", "RSS median by eighth (MB)"),
        ("queue_depth_max", "max queue depth"),
        ("queue_size", "queue bound"), ("dropped_samples", "dropped samples"),
        ("staleness_mean", "mean staleness"), ("seconds", "wall s"),
    ]  # fmt: skip
    name = "soak" if steps >= 300 else "soak_smoke"
    print(write_results(name, [row], columns, f"`{row['command']}`"))
    return row


if __name__ == "__main__":
    main(sys.argv[1:])

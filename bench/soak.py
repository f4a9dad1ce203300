"""Soak run of the async default: does anything grow over hundreds of steps?

Runs `configs/rl/arith_tiny.gin` (async, fixed lag 2, trainer and generator on disjoint halves of
8 simulated CPU devices) for `--steps` RL steps from random weights (no SFT stage: the loop is
what is soaked), with evaluations and checkpoints on, and reads from its metrics.jsonl: host RSS
after warm-up and at the end (growth in %), the largest queue depth against the queue's bound,
the samples dropped and the staleness. Writes bench/results/soak.{json,md}.

    python -m bench.soak                 # 400 steps, ~2 minutes on 2 CPU cores
    python -m bench.soak --steps 8       # seconds: the plumbing
"""

from __future__ import annotations

from bench import cpu_devices

cpu_devices.simulate(8)

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

from bench.common import gin_values, run_rl  # noqa: E402
from jaxrl.infra.metrics import read_metrics  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, "configs", "rl", "arith_tiny.gin")


def soak(workdir: str, steps: int) -> dict:
    every = max(steps // 4, 1)
    params = [
        "rl_main.sft = None",
        f"RLConfig.total_steps = {steps}",
        f"RLConfig.eval_every_steps = {every}",
        f"RLConfig.save_every_steps = {every}",
    ]
    seconds = run_rl(CONFIG, workdir, params)
    records = [r for r in read_metrics(os.path.join(workdir, "metrics.jsonl")) if r["step"] > 0]
    warm = records[min(len(records) - 1, max(steps // 8, 1))]  # after compilation and first saves
    last = records[-1]
    queue_size = int(gin_values(CONFIG, [], "RLConfig.queue_size")["RLConfig.queue_size"])
    return {
        "steps": last["step"],
        "seconds": round(seconds, 1),
        "rss_warm_mb": round(warm["host/rss_mb"], 1),
        "warm_step": warm["step"],
        "rss_end_mb": round(last["host/rss_mb"], 1),
        "rss_growth_pct": round(100 * (last["host/rss_mb"] / warm["host/rss_mb"] - 1), 2),
        "rss_max_mb": round(max(r["host/rss_mb"] for r in records), 1),
        "queue_depth_max": max(r["async/queue_depth"] for r in records),
        "queue_size": queue_size,
        "dropped_samples": last["async/dropped_samples"],
        "staleness_mean": round(last["async/staleness_mean"], 4),
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--workdir", default="")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="soak_") as tmp:
        row = soak(args.workdir or os.path.join(tmp, "run"), args.steps)
    row["command"] = "python -m bench.soak" + "".join(f" {a}" for a in (argv or []))
    print(json.dumps(row))
    from bench.common import write_results

    columns = [
        ("steps", "steps"), ("rss_warm_mb", "RSS after warm-up (MB)"), ("warm_step", "at step"),
        ("rss_end_mb", "RSS at the end (MB)"), ("rss_growth_pct", "growth %"),
        ("rss_max_mb", "RSS max (MB)"), ("queue_depth_max", "max queue depth"),
        ("queue_size", "queue bound"), ("dropped_samples", "dropped samples"),
        ("staleness_mean", "mean staleness"), ("seconds", "wall s"),
    ]  # fmt: skip
    name = "soak" if args.steps >= 300 else "soak_smoke"
    print(write_results(name, [row], columns, f"`{row['command']}`"))
    return row


if __name__ == "__main__":
    main(sys.argv[1:])

"""Does async RL learn as sync does? Equal trainer steps from one SFT warm start, on arithmetic.

All runs use `configs/rl/arith_tiny.gin` (so the learning setup is identical; only the schedule
differs) and start from the same SFT checkpoint (trained by the first run, `init_from` after):

1. sync: colocated, on-policy (`RLConfig.mode = 'sync'`, no generator mesh).
2. async default: fixed lag 2 (the config as is).
3. async, lag 4, AIPO (rho = 4): the importance correction on.
4. async, lag 4, no correction: policy gradient with importance weight 1, i.e. AIPO's gradient
   -min(pi/mu, rho) A grad log pi with the weight replaced by 1 (`PlainPGLoss`, registered here
   as loss "pg_no_is"; PPO-clip would not do: its ratio weight and clip are a correction too).

Reports greedy / T=1 held-out accuracy at the start and the end (last evaluation, and the mean of
the last 3), the mean consumed staleness, samples dropped and the generator/trainer overlap as a
fraction of wall time (all read from each run's metrics.jsonl), and the verdict of the issue's
criteria: async within 5 points of sync, staleness >= 1, overlap >= 50%.

    python -m bench.rl_async_learning              # 4 runs x the config's 2000 steps (~1 h)
    python -m bench.rl_async_learning --rl_steps 500
    python -m bench.rl_async_learning --smoke      # seconds, checks the plumbing
"""

from __future__ import annotations

from bench import cpu_devices

cpu_devices.simulate(8)

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

from bench.common import LEARNING_SMOKE, run_rl  # noqa: E402
from jaxrl.infra.metrics import read_metrics  # noqa: E402
from jaxrl.rl.losses import LOSSES, PolicyLoss  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, "configs", "rl", "arith_tiny.gin")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlainPGLoss(PolicyLoss):
    """Policy gradient that ignores the behaviour policy: l_t = -A * log pi(y_t), i.e. AIPO with
    the importance weight min(pi/mu, rho) replaced by 1."""

    def policy_term(self, logprobs_bt, log_ratio_bt, advantages_bt):
        return -advantages_bt * logprobs_bt, {}


# LossConfig passes clip_eps to every non-AIPO loss; this one has no hyper-parameter of its own.
LOSSES.setdefault("pg_no_is", lambda clip_eps=None, **kw: PlainPGLoss(**kw))

LAG_4 = ["RLConfig.lag = 4", "RLConfig.max_staleness = 4", "RLConfig.queue_size = 5"]
RUNS = {
    "sync": ["RLConfig.mode = 'sync'", "rl_main.generator_mesh = None"],
    "async lag 2 (default)": [],
    "async lag 4, AIPO": LAG_4,
    # arith_tiny.gin binds AIPO's rho, which PlainPGLoss does not take (a config error otherwise).
    "async lag 4, no correction": LAG_4 + ["LossConfig.name = 'pg_no_is'", "LossConfig.rho = None"],
}


def summarise(name: str, metrics_path: str, seconds: float) -> dict:
    records = read_metrics(metrics_path)
    evals = [r for r in records if "eval/accuracy" in r]
    last = records[-1]
    row = {"run": name, "steps": last["step"], "seconds": round(seconds, 1)}
    for key, short in (("eval/accuracy", "greedy"), ("eval/accuracy_t1", "t1")):
        row[f"{short}_start"] = evals[0].get(key, float("nan"))
        row[f"{short}_end"] = evals[-1].get(key, float("nan"))
        row[f"{short}_last3"] = statistics.mean(r.get(key, float("nan")) for r in evals[-3:])
    row["staleness_mean"] = last.get("async/staleness_mean", 0.0)
    row["dropped_samples"] = last.get("async/dropped_samples", 0.0)
    row["overlap"] = last.get("async/overlap_fraction", 0.0)
    row["s_per_step"] = statistics.median(r["time/step_s"] for r in records if r["step"] > 1)
    return row


def _run_dir(workdir: str, name: str) -> str:
    return os.path.join(workdir, name.replace(" ", "_").replace(",", ""))


def plot_curves(workdir: str, path: str) -> str:
    """Held-out greedy and T=1 accuracy against trainer steps, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for name in RUNS:
        evals = [
            r
            for r in read_metrics(os.path.join(_run_dir(workdir, name), "metrics.jsonl"))
            if "eval/accuracy" in r
        ]
        for ax, key in zip(axes, ("eval/accuracy", "eval/accuracy_t1"), strict=True):
            ax.plot([r["step"] for r in evals], [r[key] for r in evals], marker="o", label=name)
    for ax, title in zip(axes, ("greedy", "temperature 1"), strict=True):
        ax.set_title(f"held-out accuracy, {title}")
        ax.set_xlabel("trainer step")
        ax.grid(alpha=0.3)
    axes[0].legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--workdir", default="")
    parser.add_argument("--rl_steps", type=int, default=0, help="override RLConfig.total_steps")
    args = parser.parse_args(argv)
    workdir = args.workdir or tempfile.mkdtemp(prefix="rl_async_learning_")
    overrides = []
    if args.smoke:
        overrides = list(LEARNING_SMOKE)
    if args.rl_steps:
        overrides += [
            f"RLConfig.total_steps = {args.rl_steps}",
            f"RLConfig.eval_every_steps = {max(args.rl_steps // 8, 1)}",
        ]
    rows, warm_start = [], []
    for name, params in RUNS.items():
        run_dir = _run_dir(workdir, name)
        seconds = run_rl(CONFIG, run_dir, overrides + params + warm_start)
        if not warm_start:  # the first run trained the SFT stage: the others start from it
            sft_dir = os.path.join(run_dir, "sft")
            warm_start = ["rl_main.sft = None", f"PolicySpec.init_from = '{sft_dir}'"]
        rows.append(summarise(name, os.path.join(run_dir, "metrics.jsonl"), seconds))
        print(json.dumps(rows[-1]), flush=True)
    sync, default = rows[0], rows[1]
    verdict = {
        "async_within_5_points_of_sync": abs(default["greedy_end"] - sync["greedy_end"]) <= 0.05,
        "async_within_5_points_of_sync_last3": (
            abs(default["greedy_last3"] - sync["greedy_last3"]) <= 0.05
        ),
        "staleness_ge_1": default["staleness_mean"] >= 1.0,
        "overlap_ge_half": default["overlap"] >= 0.5,
    }
    print(json.dumps({"verdict": verdict}))
    from bench.common import RESULTS_DIR, write_results

    columns = [
        ("run", "run"), ("steps", "steps"), ("greedy_start", "greedy start"),
        ("greedy_end", "greedy end"), ("greedy_last3", "greedy (last 3 evals)"),
        ("t1_end", "T=1 end"), ("staleness_mean", "mean staleness"),
        ("dropped_samples", "dropped"), ("overlap", "overlap"), ("s_per_step", "s/step"),
        ("seconds", "wall s"),
    ]  # fmt: skip
    command = "python -m bench.rl_async_learning" + "".join(f" {a}" for a in (argv or []))
    name = "rl_async_learning_smoke" if args.smoke else "rl_async_learning"
    print(write_results(name, rows, columns, f"`{command}`; verdict {verdict}"))
    if not args.smoke:
        print(f"plot: {plot_curves(workdir, os.path.join(RESULTS_DIR, name + '.png'))}")
    print(f"runs: {workdir}")
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])

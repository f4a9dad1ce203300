"""Does async RL learn as sync does? Equal trainer steps from one SFT warm start, on arithmetic.

All runs use `configs/rl/arith_tiny.gin` (so the learning setup is identical; only the schedule
differs) and start from the same SFT checkpoint (trained by the first run, `init_from` after):

1. sync: colocated, on-policy (`RLConfig.mode = 'sync'`, no generator mesh).
2. async default: fixed lag 2 (the config as is).
3. async, lag 4, AIPO (rho = 4): the importance correction on.
4. async, lag 4, no correction: policy gradient with importance weight 1, i.e. AIPO's gradient
   -min(pi/mu, rho) A grad log pi with the weight replaced by 1 (`PlainPGLoss`, the loss
   "pg_no_is" of bench/learning/pg_no_is.py; PPO-clip would not do: its ratio weight and clip
   are a correction too).

Reports greedy / T=1 held-out accuracy at the start and the end (last evaluation, and the mean of
the last 3), the mean consumed staleness, samples dropped and the generator/trainer overlap as a
fraction of wall time (all read from each run's metrics.jsonl), and the verdict of the issue's
criteria: async within 5 points of sync, staleness >= 1, overlap >= 50%.

    python -m bench learning rl-async              # 4 runs x the config's 2000 steps (~1 h)
    python -m bench learning rl-async --rl_steps 500
    python -m bench learning rl-async --smoke      # seconds, checks the plumbing
"""

from __future__ import annotations

from bench import cpu_devices

cpu_devices.simulate(8)

import json  # noqa: E402
import os  # noqa: E402

from bench.learning import pg_no_is, runner  # noqa: E402

CONFIG = runner.config_path("arith_tiny.gin")
RESULTS = "rl_async_learning"
LAG_4 = ["RLConfig.lag = 4", "RLConfig.max_staleness = 4", "RLConfig.queue_size = 5"]
RUNS = {
    "sync": ("sync", ["RLConfig.mode = 'sync'", "rl_main.generator_mesh = None"]),
    "async_lag_2": ("async lag 2 (default)", []),
    "async_lag_4": ("async lag 4, AIPO", LAG_4),
    "async_lag_4_no_is": ("async lag 4, no correction", LAG_4 + pg_no_is.OVERRIDES),
}
COLUMNS = [
    ("run", "run"), ("steps", "steps"), ("greedy_start", "greedy start"),
    ("greedy_end", "greedy end"), ("greedy_last3", "greedy (last 3 evals)"),
    ("t1_end", "T=1 end"), ("staleness_mean", "mean staleness"),
    ("dropped_samples", "dropped"), ("overlap", "overlap"), ("s_per_step", "s/step"),
    ("seconds", "wall s"),
]  # fmt: skip
PANELS = [("eval/accuracy", "held-out accuracy, greedy"),
          ("eval/accuracy_t1", "held-out accuracy, temperature 1")]  # fmt: skip


def add_options(parser) -> None:
    parser.add_argument("--rl_steps", type=int, default=0, help="override RLConfig.total_steps")


def summarise(label: str, metrics_path: str, seconds: float) -> dict:
    records = runner.read(metrics_path)
    last = records[-1]
    row = {"run": label, "steps": last["step"], "seconds": round(seconds, 1)}
    for key, value in runner.curve_row(runner.evals(records)).items():
        if not key.endswith("_gain_pts"):
            row[key] = value
    row["staleness_mean"] = last.get("async/staleness_mean", 0.0)
    row["dropped_samples"] = last.get("async/dropped_samples", 0.0)
    row["overlap"] = last.get("async/overlap_fraction", 0.0)
    row["s_per_step"] = runner.seconds_per_step(records)
    return row


def run_dir(workdir: str, label: str) -> str:
    """The run's directory: its label, e.g. W/async_lag_4_AIPO (the names of earlier runs)."""
    return os.path.join(workdir, label.replace(" ", "_").replace(",", ""))


def run(args) -> list[dict]:
    from bench.common import LEARNING_SMOKE, RESULTS_DIR, command, write_results

    overrides = list(LEARNING_SMOKE) if args.smoke else []
    if args.rl_steps:
        overrides += [
            f"RLConfig.total_steps = {args.rl_steps}",
            f"RLConfig.eval_every_steps = {max(args.rl_steps // 8, 1)}",
        ]
    rows, warm_start = {}, []
    for name, (label, params) in RUNS.items():
        directory = run_dir(args.workdir, label)
        seconds = runner.run_in_process(CONFIG, directory, overrides + params + warm_start)
        if not warm_start:  # the first run trained the SFT stage: the others start from it
            sft_dir = os.path.join(directory, "sft")
            warm_start = ["rl_main.sft = None", f"PolicySpec.init_from = '{sft_dir}'"]
        rows[name] = summarise(label, os.path.join(directory, "metrics.jsonl"), seconds)
        print(json.dumps(rows[name]), flush=True)
    sync, default = rows["sync"], rows["async_lag_2"]
    verdict = {
        "async_within_5_points_of_sync": abs(default["greedy_end"] - sync["greedy_end"]) <= 0.05,
        "async_within_5_points_of_sync_last3": (
            abs(default["greedy_last3"] - sync["greedy_last3"]) <= 0.05
        ),
        "staleness_ge_1": default["staleness_mean"] >= 1.0,
        "overlap_ge_half": default["overlap"] >= 0.5,
    }
    print(json.dumps({"verdict": verdict}))
    name = RESULTS + ("_smoke" if args.smoke else "")
    print(write_results(name, list(rows.values()), COLUMNS, f"`{command()}`; verdict {verdict}"))
    if not args.smoke:
        runs = {label: run_dir(args.workdir, label) for label, _ in RUNS.values()}
        png = os.path.join(RESULTS_DIR, name + ".png")
        print(f"plot: {runner.plot_curves(runs, png, PANELS)}")
    print(f"runs: {args.workdir}")
    return list(rows.values())

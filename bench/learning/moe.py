"""Does a mixture-of-experts policy learn by RL? Sync and async, from one SFT warm start.

Both runs train the tiny MoE policy (`arith_tiny_moe` preset: 8 experts, top-2) on 1-2 digit
arithmetic, from the same SFT checkpoint (trained by the first run, or `--init_from` a finished
SFT stage), for the same number of trainer steps:

1. async: `configs/rl/arith_tiny_moe.gin` as is (fixed lag 2, AIPO, 128 prompts sampled and
   the 16 most informative trained per step, lr 3e-4).
2. sync: `configs/rl/arith_tiny_moe_sync.gin` (the same batch and sampling, colocated and
   on-policy).

Reports held-out greedy accuracy at every evaluation (the curve), its start, end, the mean of
the last 3 evaluations and the gain over the start in points, temperature-1 accuracy at the end,
the mean router auxiliary loss and the seconds per RL step, read from each run's metrics.jsonl;
and the verdict of the acceptance bar the dense configs meet (+15 points greedy, last 3).

    python -m bench learning moe                       # SFT, then 2 runs x 2000 steps (hours)
    python -m bench learning moe --rl_steps 1200 --eval_every 100 \\
        --init_from W/async/sft                        # from a finished SFT stage
    python -m bench learning moe --runs async --param "OptimizerConfig.learning_rate = 1e-4"
    python -m bench learning moe --smoke               # seconds, checks the plumbing
"""

from __future__ import annotations

from bench import cpu_devices

cpu_devices.simulate(8)

import json  # noqa: E402
import os  # noqa: E402

from bench.learning import runner  # noqa: E402

CONFIG = runner.config_path("arith_tiny_moe.gin")
SYNC_CONFIG = runner.config_path("arith_tiny_moe_sync.gin")
RESULTS = "moe_learning"
RUNS = {
    "async": ("async (arith_tiny_moe.gin)", CONFIG),
    "sync": ("sync (arith_tiny_moe_sync.gin)", SYNC_CONFIG),
}
BAR_PTS = 15.0
COLUMNS = [
    ("run", "run"), ("steps", "RL steps"), ("greedy_start", "greedy start"),
    ("greedy_end", "greedy end"), ("greedy_last3", "greedy (last 3)"),
    ("greedy_gain_pts", "gain (pts)"), ("t1_end", "T=1 end"), ("aux", "router aux loss"),
    ("s_per_step", "s/step"), ("curve", "greedy every evaluation"),
]  # fmt: skip
PANELS = [("eval/accuracy", "held-out accuracy, greedy"),
          ("eval/accuracy_t1", "held-out accuracy, temperature 1")]  # fmt: skip


def add_options(parser) -> None:
    parser.add_argument("--rl_steps", type=int, default=0, help="override RLConfig.total_steps")
    parser.add_argument("--eval_every", type=int, default=0, help="override eval_every_steps")
    parser.add_argument(
        "--init_from", default="", help="a finished SFT stage (W/async/sft): skip the SFT"
    )
    parser.add_argument(
        "--runs", default=",".join(RUNS), help=f"which runs, in order (of {', '.join(RUNS)})"
    )
    parser.add_argument(
        "--param", action="append", default=[], help="a gin binding for every run (repeatable)"
    )


def summarise(label: str, workdir: str) -> dict:
    """The run's row: its curve's figures (see the module docstring) from its metrics."""
    records = runner.read(os.path.join(workdir, "metrics.jsonl"))
    evaluations = runner.evals(records)
    if not evaluations:
        raise SystemExit(f"{workdir}: the run has no evaluation in its metrics.jsonl")
    steps = [r for r in records if "reward/mean" in r]
    row = {"run": label, "steps": max((r["step"] for r in steps), default=0)}
    curve = runner.curve_row(evaluations, digits=3)
    for key in ("greedy_start", "greedy_end", "greedy_last3", "greedy_gain_pts", "t1_end"):
        row[key] = curve[key]
    aux = [r["router_aux_loss"] for r in steps if "router_aux_loss" in r]
    row["aux"] = round(runner.mean(aux), 3) if aux else None
    row["s_per_step"] = round(runner.seconds_per_step(steps), 2) if len(steps) > 1 else None
    row["curve"] = " ".join(f"{r['eval/accuracy']:.3f}" for r in evaluations)
    return row


def run(args) -> list[dict]:
    from bench.common import LEARNING_SMOKE, RESULTS_DIR, command, write_results

    names = [n.strip() for n in args.runs.split(",") if n.strip()]
    unknown = [n for n in names if n not in RUNS]
    if unknown or not names:
        raise SystemExit(f"--runs {args.runs!r}: name runs of {', '.join(RUNS)}")
    overrides = (list(LEARNING_SMOKE) if args.smoke else []) + list(getattr(args, "param", []))
    if args.rl_steps:
        overrides += [f"RLConfig.total_steps = {args.rl_steps}"]
    if args.eval_every:
        overrides += [
            f"RLConfig.eval_every_steps = {args.eval_every}",
            f"RLConfig.save_every_steps = {args.eval_every}",
        ]
    warm_start = []
    if args.init_from:
        if not os.path.isdir(args.init_from):
            raise SystemExit(f"--init_from {args.init_from}: no such directory")
        warm_start = ["rl_main.sft = None", f"PolicySpec.init_from = '{args.init_from}'"]
    rows = {}
    for name in names:
        label, config = RUNS[name]
        directory = os.path.join(args.workdir, name)
        runner.run_in_process(config, directory, overrides + warm_start)
        if not warm_start:  # the first run trained the SFT stage: the others start from it
            sft_dir = os.path.join(directory, "sft")
            warm_start = ["rl_main.sft = None", f"PolicySpec.init_from = '{sft_dir}'"]
        rows[name] = summarise(label, directory)
        print(json.dumps(rows[name]), flush=True)
    verdict = {name: row["greedy_gain_pts"] >= BAR_PTS for name, row in rows.items()}
    print(json.dumps({"verdict_gain_ge_15_pts": verdict}))
    name = RESULTS + ("_smoke" if args.smoke else "")
    start = f"; from {args.init_from}" if args.init_from else ""
    note = f"`{command()}`{start}; +{BAR_PTS:g} points greedy (last 3): {verdict}"
    print(write_results(name, list(rows.values()), COLUMNS, note))
    if not args.smoke:
        runs = {RUNS[n][0]: os.path.join(args.workdir, n) for n in names}
        png = os.path.join(RESULTS_DIR, name + ".png")
        print(f"plot: {runner.plot_curves(runs, png, PANELS, bar=BAR_PTS / 100)}")
    print(f"runs: {args.workdir}")
    return list(rows.values())

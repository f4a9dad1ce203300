"""Does LoRA RL learn? Full fine-tuning against LoRA from one SFT warm start, arithmetic.

1. full: `configs/rl/arith_tiny.gin` (async, lag 2, AIPO), `--full_steps` trainer steps; trains
   the SFT stage that the LoRA run then starts from.
2. lora: `configs/rl/arith_tiny_lora.gin` (the same run with the policy trained as adapters on
   the frozen SFT model), `--lora_steps` (default 2x full) steps, `PolicySpec.init_from` = the
   full run's SFT stage; `--lora_param` gin overrides it (rank, targets, LoRA-FA, ...).

Reports greedy held-out accuracy at the start and end, the gain (the mean of the last 3
evaluations over the start: one evaluation of 512 problems has a ~2-point standard error), the
first evaluated step at which each run is +15 points over its start, bytes per weight push
(`sync/bytes_pushed`, and as a share of the full run's push) and the verdict for each LoRA row:
it gains >= +15 greedy points, reaching them in at most 2x the steps full fine-tuning needs,
with a push <= 2% of the full model's. Written to bench/results/rl_lora_learning.{json,md}
(`--out NAME`: NAME.{json,md}, e.g. one name per LoRA variant).

    python -m bench learning rl-lora --full_steps 500     # ~15 min on an idle 2-core CPU
    python -m bench learning rl-lora --full_dir W/full --lora_dir "NAME=W/run" ...  # tabulate
    python -m bench learning rl-lora --smoke              # seconds, checks the plumbing
"""

from __future__ import annotations

from bench import cpu_devices

cpu_devices.simulate(8)

import json  # noqa: E402
import os  # noqa: E402

from bench.learning import runner  # noqa: E402

CONFIG = runner.config_path("arith_tiny.gin")
LORA = runner.config_path("arith_tiny_lora.gin")
RESULTS = "rl_lora_learning"
RUNS = {
    "full": ("full fine-tuning", CONFIG),
    "lora": ("LoRA, the config", LORA),  # --lora_name, --lora_param; or --lora_dir NAME=DIR
}
GAIN = 0.15


def add_options(parser) -> None:
    parser.add_argument("--full_steps", type=int, default=500)
    parser.add_argument("--lora_steps", type=int, default=0, help="default: 2x --full_steps")
    parser.add_argument("--eval_every", type=int, default=50)
    parser.add_argument(
        "--out", default="", help=f"the results' name (default {RESULTS}): bench/results/OUT.json"
    )
    parser.add_argument("--full_dir", default="", help="reuse this finished full run (and its SFT)")
    parser.add_argument("--lora_param", action="append", default=[], help="extra gin for LoRA")
    parser.add_argument("--lora_name", default=RUNS["lora"][0])
    parser.add_argument(
        "--lora_dir", action="append", default=[],
        help="NAME=DIR: tabulate this finished LoRA run (repeatable) instead of launching one",
    )  # fmt: skip


def summarise(name: str, metrics_path: str, seconds: float) -> dict:
    records = runner.read(metrics_path)
    evaluations = runner.evals(records)
    greedy = runner.curve(evaluations, "eval/accuracy")
    reached = [r["step"] for r in evaluations if r["eval/accuracy"] >= greedy["start"] + GAIN]
    pushed = [r["sync/bytes_pushed"] for r in records if "sync/bytes_pushed" in r]
    return {
        "run": name,
        "steps": records[-1]["step"],
        "greedy_start": greedy["start"],
        "greedy_end": greedy["end"],
        "greedy_last3": greedy["last3"],
        "gain": greedy["last3"] - greedy["start"],
        "steps_to_gain": reached[0] if reached else None,
        "bytes_pushed": pushed[-1] if pushed else 0.0,
        "s_per_step": runner.seconds_per_step(records),
        "seconds": round(seconds, 1),
    }


COLUMNS = [
    ("run", "run"), ("steps", "steps"), ("greedy_start_cell", "greedy start"),
    ("greedy_end_cell", "greedy end"), ("greedy_last3_cell", "greedy (last 3 evals)"),
    ("gain_cell", "gain (last 3)"), ("steps_to_gain_cell", "first step at +15"),
    ("bytes_cell", "bytes per push"), ("push_share", "push / full model"),
    ("s_per_step_cell", "s/step"), ("seconds_cell", "wall s"),
]  # fmt: skip


def with_cells(rows: list[dict]) -> list[dict]:
    """The rows with their table cells (`*_cell`, `push_share`) beside the raw figures; the
    first row is full fine-tuning (its push is the 100% of the share column)."""
    full_bytes = rows[0]["bytes_pushed"] or float("nan")
    out = []
    for r in rows:
        seconds = r["seconds"]
        out.append(
            r
            | {
                "greedy_start_cell": f"{r['greedy_start']:.3f}",
                "greedy_end_cell": f"{r['greedy_end']:.3f}",
                "greedy_last3_cell": f"{r['greedy_last3']:.3f}",
                "gain_cell": f"{r['gain']:+.3f}",
                "steps_to_gain_cell": str(r["steps_to_gain"]),
                "bytes_cell": f"{int(r['bytes_pushed']):,}",
                "push_share": f"{100 * r['bytes_pushed'] / full_bytes:.2f}%",
                "s_per_step_cell": f"{r['s_per_step']:.3f}",
                "seconds_cell": "" if seconds != seconds else f"{seconds:.0f}",  # nan: tabulated
            }
        )
    return out


def verdict(full: dict, lora: dict) -> dict:
    """The issue's bar for one LoRA row against the full run."""
    return {
        "lora_gain_ge_15": lora["gain"] >= GAIN,
        "lora_steps_le_2x_full": (
            lora["steps_to_gain"] is not None
            and full["steps_to_gain"] is not None
            and lora["steps_to_gain"] <= 2 * full["steps_to_gain"]
        ),
        "push_le_2pct": lora["bytes_pushed"] <= 0.02 * full["bytes_pushed"],
    }


def run(args) -> list[dict]:
    from bench.common import LEARNING_SMOKE, command, write_results

    lora_steps = args.lora_steps or 2 * args.full_steps
    common = [] if args.smoke else ["RLConfig.save_every_steps = 100000"]
    full_dir = args.full_dir or os.path.join(args.workdir, "full")
    runs = [(RUNS["full"][0], CONFIG, args.full_steps, [], full_dir)]
    given = [spec.rsplit("=", 1) for spec in args.lora_dir]  # names hold "r=4"
    if any(len(spec) != 2 for spec in given):
        raise SystemExit(f"--lora_dir takes NAME=DIR; got {args.lora_dir}")
    runs += [(name, LORA, 0, [], run_dir) for name, run_dir in given] or [
        (args.lora_name, LORA, lora_steps, args.lora_param, os.path.join(args.workdir, "lora"))
    ]
    rows = []
    for name, config, steps, extra, run_dir in runs:
        if (args.full_dir and run_dir == full_dir) or steps == 0:  # finished runs: tabulated
            rows.append(summarise(name, os.path.join(run_dir, "metrics.jsonl"), float("nan")))
            continue
        params = list(LEARNING_SMOKE) if args.smoke else []
        if not args.smoke:
            params += [
                f"RLConfig.total_steps = {steps}",
                f"RLConfig.eval_every_steps = {args.eval_every}",
            ]
        if rows:  # the first run trained the SFT stage: the LoRA run starts from it
            sft_dir = os.path.join(full_dir, "sft")
            params += ["rl_main.sft = None", f"PolicySpec.init_from = '{sft_dir}'"]
        seconds = runner.run_in_process(config, run_dir, common + params + extra)
        rows.append(summarise(name, os.path.join(run_dir, "metrics.jsonl"), seconds))
        print(json.dumps(rows[-1]), flush=True)
    verdicts = {row["run"]: verdict(rows[0], row) for row in rows[1:]}
    rows = with_cells(rows)
    name = args.out or RESULTS + ("_smoke" if args.smoke else "")
    print(write_results(name, rows, COLUMNS, f"`{command()}`; verdicts {verdicts}"))
    return rows

"""Does RL teach a real pretrained model? SmolLM2-135M-Instruct on reasoning-gym's basic_arithmetic
(`configs/rl/smollm2_arith.gin`), against a shuffled-reward control, on a wall-time budget.

Two `launch.rl` runs of the config from the same weights (`--init_from`, a save_pretrained
directory of the model, e.g. the output of `python -m launch.fetch smollm2-135m-instruct`), each
a child process on 2 simulated CPU devices (trainer on one, the generator's engine on the other):

1. rl: the config as is.
2. shuffled: `RLConfig.shuffle_rewards = True` (each batch's rewards permuted across its
   samples: the same reward statistics without information; the control should not rise).

Each run stops at `--steps` trainer steps or after `--minutes` of wall time, whichever comes
first (the child is interrupted; the evaluations it wrote stay in its metrics.jsonl), and is
evaluated on the config's held-out problems (`--eval_size`, greedy) every `--eval_every` steps,
at step 0 included. Reports per run: steps, seconds per step, greedy held-out accuracy at the
start and the mean of the last 3 evaluations, the gain in points, the mean train reward of the
first and last 10 steps; the verdict of issue 36's criterion (rl +15 points within 2 hours, the
control not rising: gain < 5 points). Writes bench/results/NAME.{json,md} and NAME.png (held-out
accuracy and train reward against wall minutes, both runs).

    python -m bench learning smollm2 --init_from ~/.cache/jaxrl/smollm2-135m-instruct \
        --minutes 120                                          # the full experiment, 2 x 2 h
    python -m bench learning smollm2 --init_from DIR --smoke   # 2 short steps each: plumbing
    python -m bench learning smollm2 --workdir W --no_launch   # summarise runs already in W

The runs of one workdir may come from several invocations (e.g. `--runs rl`, then `--runs
shuffled`); each launching command is appended to WORKDIR/launched_by.txt and quoted in the
results note.
"""

from __future__ import annotations

import json
import os
import statistics

from bench.learning import runner

CONFIG = runner.config_path("smollm2_arith.gin")
RESULTS = "smollm2_learning"
DEVICES = 2
RUNS = {
    "rl": ("RL (AIPO)", []),
    "shuffled": ("control: RL, shuffled rewards", ["RLConfig.shuffle_rewards = True"]),
}
GAIN_PTS, CONTROL_MAX_PTS, BUDGET_S = 15.0, 5.0, 7200.0
LORA_LR = 1e-4  # --lora without --lr
PANELS = [("eval/accuracy", "held-out greedy accuracy"), ("reward/mean", "mean train reward")]
TITLE = "SmolLM2-135M-Instruct, reasoning-gym basic_arithmetic (smollm2_arith.gin)"


def add_options(parser) -> None:
    parser.add_argument("--init_from", default="", help="save_pretrained dir of SmolLM2")
    parser.add_argument("--runs", default="rl,shuffled", help=f"comma list of {sorted(RUNS)}")
    parser.add_argument("--steps", type=int, default=400, help="trainer steps per run (at most)")
    parser.add_argument("--minutes", type=float, default=120.0, help="wall minutes per run")
    parser.add_argument("--eval_every", type=int, default=20)
    parser.add_argument("--eval_size", type=int, default=256)
    parser.add_argument("--save_every", type=int, default=20)
    parser.add_argument("--lora", action="store_true", help="train LoRA adapters (rl_main.lora)")
    parser.add_argument(
        "--lr", type=float, default=0.0, help="learning rate (0: the config's; with --lora 1e-4)"
    )
    parser.add_argument("--gin_param", action="append", default=[], help="more overrides")
    parser.add_argument("--parallel", action="store_true", help="both runs at once")
    parser.add_argument("--no_launch", action="store_true", help="summarise WORKDIR's runs")
    parser.add_argument("--name", default="", help="results name (default smollm2_learning)")


def base_params(args, save_every: int) -> list[str]:
    """The gin overrides of a SmolLM2 experiment's runs: the weights (`--init_from`), steps and
    evaluations (`--steps`, `--eval_every`, `--eval_size`), a checkpoint every `save_every`."""
    return [
        f"PolicySpec.init_from = '{os.path.abspath(os.path.expanduser(args.init_from))}'",
        f"RLConfig.total_steps = {args.steps}",
        f"RLConfig.eval_every_steps = {args.eval_every}",
        f"RLConfig.eval_size = {args.eval_size}",
        f"RLConfig.save_every_steps = {save_every}",
    ]


def run_params(args) -> list[str]:
    """The gin overrides every run shares."""
    params = base_params(args, args.save_every)
    if args.lora:  # rank 8 on every attention and MLP projection (LoraConfig's defaults)
        params += ["rl_main.lora = @LoraConfig()", f"OptimizerConfig.learning_rate = {LORA_LR}"]
    if args.lr:
        params.append(f"OptimizerConfig.learning_rate = {args.lr}")
    return params + list(args.gin_param)


def launch_run(workdir: str, params: list[str], seconds: float) -> float:
    """`python -m launch.rl` on the config in a child process (output in WORKDIR.log), stopped
    by SIGINT after `seconds`; returns its wall seconds."""
    return runner.launch_child(
        CONFIG, workdir, params, devices=DEVICES, seconds=seconds, must_succeed=False
    )[1]


def summarise(name: str, label: str, workdir: str) -> dict:
    """One row: steps, seconds per step, greedy accuracy start / last-3 mean / gain, reward."""
    row, evals, steps = runner.run_row(name, label, workdir, digits=1)
    if not evals:
        return row
    t0 = evals[0]["wall_time_s"]
    row["greedy_start"] = evals[0]["eval/accuracy"]
    row["greedy_end"] = round(statistics.mean(r["eval/accuracy"] for r in evals[-3:]), 4)
    row["gain_pts"] = round(100 * (row["greedy_end"] - row["greedy_start"]), 1)
    row["evals"] = len(evals)
    within = [r for r in evals if r["wall_time_s"] - t0 <= BUDGET_S]
    if len(within) >= 2:
        best3 = statistics.mean(r["eval/accuracy"] for r in within[-3:])
        row["gain_pts_2h"] = round(100 * (best3 - row["greedy_start"]), 1)
    return row | reward_ends(steps)


def reward_ends(steps: list[dict]) -> dict:
    """The mean train reward of a run's first and last 10 steps ({} before its first step)."""
    if not steps:
        return {}
    return {
        "reward_first10": round(statistics.mean(r["reward/mean"] for r in steps[:10]), 3),
        "reward_last10": round(statistics.mean(r["reward/mean"] for r in steps[-10:]), 3),
    }


def run_dirs(args, runs: dict) -> dict[str, str]:
    """{name: WORKDIR/name} of the runs `--runs` names, checked against `runs` (and, unless
    `--no_launch`, `--init_from` given); WORKDIR made."""
    names = [n for n in args.runs.split(",") if n]
    unknown = sorted(set(names) - set(runs))
    if unknown:
        raise SystemExit(f"--runs {unknown}: choose from {sorted(runs)}")
    if not args.no_launch and not args.init_from:
        raise SystemExit("--init_from: a save_pretrained directory of SmolLM2-135M-Instruct")
    os.makedirs(args.workdir, exist_ok=True)
    return {n: os.path.join(args.workdir, n) for n in names}


def run(args) -> None:
    if args.smoke:
        args.steps, args.eval_every, args.eval_size, args.save_every = 2, 1, 8, 100
        args.gin_param += ["RLConfig.num_prompts = 2", "RLConfig.max_new_tokens = 16"]
    dirs = run_dirs(args, RUNS)
    names, workdir = list(dirs), args.workdir

    if not args.no_launch:  # every launching command, in order
        from bench.common import command

        runner.note_launch(workdir, f"{command()}\n")
        params = run_params(args)
        jobs = [(dirs[n], params + RUNS[n][1], args.minutes * 60) for n in names]
        if args.parallel:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(len(jobs)) as pool:
                list(pool.map(lambda job: launch_run(*job), jobs))
        else:
            for job in jobs:
                launch_run(*job)

    rows = [summarise(n, RUNS[n][0], dirs[n]) for n in names]
    for row in rows:
        print(json.dumps(row), flush=True)
    by_name = {r["name"]: r for r in rows}
    verdict = {}
    if "gain_pts_2h" in by_name.get("rl", {}):
        verdict["rl_gain_ge_15_within_2h"] = by_name["rl"]["gain_pts_2h"] >= GAIN_PTS
    if "gain_pts" in by_name.get("shuffled", {}):
        verdict["control_does_not_rise"] = by_name["shuffled"]["gain_pts"] < CONTROL_MAX_PTS
    print(json.dumps({"verdict": verdict, "workdir": workdir}), flush=True)

    from bench.common import command

    name = args.name or (RESULTS + ("_smoke" if args.smoke else ""))
    columns = [
        ("run", "run"), ("steps", "steps"), ("s_per_step", "s / step"), ("wall_s", "wall s"),
        ("greedy_start", "greedy start"), ("greedy_end", "greedy end (last 3)"),
        ("gain_pts", "gain (pts)"), ("gain_pts_2h", "gain within 2 h (pts)"),
        ("reward_first10", "reward, first 10 steps"), ("reward_last10", "reward, last 10 steps"),
    ]  # fmt: skip
    note = f"`{command()}` on {DEVICES}x cpu ({os.cpu_count()} cpus); verdict {verdict}"
    labels = {RUNS[n][0]: dirs[n] for n in names}
    runner.write_report(name, rows, columns, note, workdir, labels, PANELS, x="minutes",
                        title=TITLE, dpi=110)  # fmt: skip

"""Does streaming RL learn as fixed-lag async RL does? Equal trainer steps from one SFT checkpoint,
on chain sums (the long-tailed task).

All runs use `configs/rl/chain_tiny_streaming.gin` on the "2dev" setting of bench/rl_streaming
(trainer on device 0, generator on device 1: the fewest devices that run the streaming schedule)
and start from one SFT checkpoint (the config's SFT stage, trained first by its own `launch.rl`
process, or `--sft_dir`), with `init_from`; only the schedule and the loss differ:

1. fixed_lag: `RLConfig.schedule = 'fixed_lag'`, lag 1 (the baseline the config comment names):
   batch k sampled whole by version k - 1, the engine drained after each batch.
2. streaming: the config as is (kv_on_update "keep", max_staleness 2, queue_size 1,
   stream_in_flight 4, PPO clip, dynamic sampling at oversample 4).
3. streaming_no_is: the same streaming run with the importance correction off: loss "pg_no_is"
   (bench/learning/pg_no_is.py's `PlainPGLoss`: AIPO with min(pi/mu, rho) replaced by 1), at the
   same staleness bound, so the same staleness distribution (measured, reported).
4. streaming_recompute (optional, `--runs`): kv_on_update "recompute".

RL prompts are the task's stream after the SFT stage's items, without the demonstration pool's
prompts (task "chain_sum_after_sft", registered by the child process: `jaxrl.train.sft.
rl_source_after_sft` on chain_sum; launch.rl does this itself only when it trains the SFT stage in
the same run, not with `init_from`). Each run is a fresh `launch.rl` process (`--parallel` at
once), resuming from its own checkpoint if its workdir holds one.

Reports held-out greedy and T=1 accuracy at the SFT start (the step-0 evaluation of every run:
the same weights, so the same figure) and at every `--eval_every` steps: start, end, mean of the
last 3 evaluations, gain in points (last-3 mean minus start), and from metrics.jsonl the mean
per-token staleness (versions; fixed lag: the batch's), the fraction of rows sampled by several
versions, dropped groups, mean completion length, seconds per step. Verdict of the issue's
criteria: streaming within 3 points of fixed lag, both >= +15 points over the SFT start
(last-3 means). Writes bench/results/NAME.{json,md} and NAME.png (curves).

    python -m bench learning rl-streaming --steps 600 --parallel 2
    python -m bench learning rl-streaming --sft_dir RUN/sft --runs fixed_lag --steps 100
    python -m bench learning rl-streaming --smoke      # minutes (5 processes compile): plumbing
    python -m bench learning rl-streaming --workdir W --sft_dir W/sft_run/sft --no_launch \
        --until_step 120    # re-summarise the runs in W (e.g. stopped ones) at a common step
    python -m bench learning rl-streaming --recipe_table  # the recipe runs' table (RECIPE_RUNS)

Measured 2026-12-02 (docs/benchmarks.md, "Learning: streaming vs fixed lag on chain sums"): from the
config's 600-step SFT start at 44.5% greedy (512 problems), 2000 steps: fixed lag 70.2% (+25.7
points, last 3 evaluations), streaming 69.7% (+25.2); without the correction 33.9% (-10.7) at
step 1000. With the engine's 16 groups as the streaming margin (`stream_in_flight` -1) streaming
ended 5.9 points under fixed lag; with AIPO at the same learning rate accuracy fell under every
schedule.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import re
import statistics
import sys

from bench.learning import runner

CONFIG = "configs/rl/chain_tiny_streaming.gin"
RESULTS = "rl_streaming_learning"
DEVICES = 2
# bench/rl_streaming's "2dev" setting: one device per role.
TWO_DEVICES = [
    "trainer/MeshConfig.axis_sizes = (1, 1)",
    "trainer/MeshConfig.num_devices = 1",
    "generator/MeshConfig.axis_sizes = (1, 1)",
    "generator/MeshConfig.first_device = 1",
    "generator/MeshConfig.num_devices = 1",
]
# Labels; a row's name adds the loss its config.gin binds (`run_label`).
RUNS = {
    "fixed_lag": ("fixed lag 1", ["RLConfig.schedule = 'fixed_lag'", "RLConfig.lag = 1"]),
    "streaming": ("streaming, keep", []),
    # rho None: in case the config binds AIPO's, which the plain policy gradient does not take.
    "streaming_no_is": (
        "streaming, keep, no correction",
        ["LossConfig.name = 'pg_no_is'", "LossConfig.rho = None"],
    ),
    "streaming_recompute": ("streaming, recompute", ["RLConfig.kv_on_update = 'recompute'"]),
}
DEFAULT_RUNS = "fixed_lag,streaming,streaming_no_is"
SMOKE = [
    "SFTConfig.steps = 4", "SFTConfig.eval_every_steps = 2", "SFTConfig.eval_size = 16",
    "RLConfig.num_prompts = 4",
]  # fmt: skip
TASK = "chain_sum_after_sft"
COLUMNS = [
    ("name", "run"), ("steps", "steps"), ("greedy_start", "greedy start"),
    ("greedy_end", "greedy end"), ("greedy_last3", "greedy (last 3)"),
    ("greedy_gain_pts", "gain (pts)"), ("t1_start", "T=1 start"), ("t1_last3", "T=1 (last 3)"),
    ("token_staleness", "token staleness"), ("mixed_rows", "mixed-version rows"),
    ("dropped_groups", "dropped groups"), ("filtered_groups", "filtered groups"),
    ("completion_tokens", "mean completion"),
    ("reward_last50", "reward (last 50)"), ("s_per_step", "s/step"), ("seconds", "wall s"),
]  # fmt: skip
PANELS = [("eval/accuracy", "chain sums, held-out accuracy, greedy"),
          ("eval/accuracy_t1", "chain sums, held-out accuracy, temperature 1")]  # fmt: skip


def add_options(parser) -> None:
    parser.add_argument("--sft_dir", default="", help="an SFT checkpoint dir (RUN/sft) to reuse")
    parser.add_argument("--sft_steps", type=int, default=0, help="0: the config's SFT steps")
    parser.add_argument("--runs", default=DEFAULT_RUNS, help=f"of {','.join(RUNS)}")
    parser.add_argument("--steps", type=int, default=600, help="RL trainer steps per run")
    parser.add_argument("--eval_every", type=int, default=50)
    parser.add_argument("--eval_size", type=int, default=512)
    parser.add_argument("--eval_samples", type=int, default=1, help="T=1 draws per prompt")
    parser.add_argument("--learning_rate", type=float, default=0.0, help="0: the config's")
    parser.add_argument(
        "--gin_param", action="append", default=[], help="a binding added to every RL run"
    )
    parser.add_argument("--parallel", type=int, default=2, help="runs at once")
    parser.add_argument("--name", default="", help="results name (default by mode)")
    parser.add_argument("--until_step", type=int, default=0, help="summarise steps <= this")
    parser.add_argument(
        "--no_launch", action="store_true", help="only summarise the runs in --workdir"
    )
    parser.add_argument(
        "--recipe_table", action="store_true",
        help=f"launch nothing: write {RECIPE}.json, the runs that found the recipe, from the "
        f"committed {RESULTS}_*.json",
    )  # fmt: skip


# --- the recipe table: the runs that found the config's recipe, from their result files -------

RECIPE = "rl_streaming_recipe"
# The runs, in the order they were tried: the suffix of their result file (RESULTS_suffix.json)
# and what they changed, the loss and the sampling, which the files do not record (their
# commands name the bindings; the loss is in the rows' labels only where config.gin bound it).
# All from one earlier SFT start of the config (48.0% greedy on 256 problems), lr 1e-4 unless
# stated. 2026-12-02_0726: the 2000-step summary of the runs in `_1500` (restored from e863509).
RECIPE_RUNS = [
    ("aipo", "AIPO rho 4"),
    ("lr3e-5", "AIPO rho 4, lr 3e-5"),
    ("ppo_clip", "PPO clip"),
    ("pilot_lr3e-4", "PPO clip, lr 3e-4"),
    ("pilot_oversample4", "PPO clip, `oversample` 4"),
    ("pilot_partial_reward", "PPO clip, `oversample` 4, reward `chain_sum_partial`"),
    ("engine_waits_1000", "PPO clip, `oversample` 4, engine waiting on a full queue (512 slots)"),
    (
        "2026-12-02_0726",
        "PPO clip, `oversample` 4, back-pressure on admission, `stream_in_flight` -1 (16 groups)",
    ),
]
# A run's control summarised only in another file of the same runs (stopped before the others).
RECIPE_CONTROL = {"2026-12-02_0726": "1500"}
RECIPE_CELLS = [("fixed_lag", "fixed_lag"), ("streaming", "streaming"),
                ("streaming_no_is", "no_correction")]  # fmt: skip
RECIPE_COLUMNS = [
    ("sampling", "loss and sampling"), ("steps", "steps"),
    ("fixed_lag", "fixed lag: greedy last 3 (gain)"),
    ("streaming", "streaming: greedy last 3 (gain)"),
    ("no_correction", "no correction: greedy last 3 (gain)"), ("file", "file"),
]  # fmt: skip


def recipe_rows(source: str = "") -> list[dict]:
    """One row per run of `RECIPE_RUNS`, its figures read from SOURCE/RESULTS_SUFFIX.json
    (default: the committed results): per schedule the greedy last-3 mean and its gain over the
    SFT start (points), as numbers and as the cell "39.7% (-8.3)", the cell naming the run's
    steps where they differ from the row's (a run stopped early, a control summarised at
    another step)."""
    from bench.common import COMMITTED_RESULTS_DIR

    def read(suffix: str) -> dict[str, dict]:
        with open(os.path.join(source or COMMITTED_RESULTS_DIR, f"{RESULTS}_{suffix}.json")) as f:
            return {r["run"]: r for r in json.load(f)["rows"]}

    rows = []
    for suffix, sampling in RECIPE_RUNS:
        runs = {run: (r, suffix) for run, r in read(suffix).items()}
        if suffix in RECIPE_CONTROL:
            other = RECIPE_CONTROL[suffix]
            runs.setdefault("streaming_no_is", (read(other)["streaming_no_is"], other))
        steps = max(r["steps"] for r, _ in runs.values())
        row = {"sampling": sampling, "steps": steps}
        files = [f"`_{suffix}`"]
        for run, key in RECIPE_CELLS:
            if run not in runs:
                row[key] = "-"
                continue
            r, where = runs[run]
            row[f"{key}_greedy_last3"] = r["greedy_last3"]
            row[f"{key}_gain_pts"] = r["greedy_gain_pts"]
            row[f"{key}_steps"] = r["steps"]
            row[key] = f"{100 * r['greedy_last3']:.1f}% ({r['greedy_gain_pts']:+.1f})"
            if r["steps"] != steps:
                row[key] += f", {r['steps']} steps"
            if where != suffix:
                files.append(f"`_{where}` ({key.replace('_', ' ')})")
        rows.append(row | {"file": ", ".join(files)})
    return rows


def write_recipe(source: str = "") -> list[dict]:
    from bench.common import write_results

    rows = recipe_rows(source)
    note = (
        f"the runs that found the recipe of {CONFIG}, from bench/results/{RESULTS}_*.json "
        "(the file column); greedy accuracy, mean of the last 3 evaluations (gain over the SFT "
        "start, points)"
    )
    print(write_results(RECIPE, rows, RECIPE_COLUMNS, note))
    return rows


# --- the child process: one launch.rl run, with this experiment's task and loss registered ----


def chain_after_sft(spec, tokenizer):
    """chain_sum's prompt stream after the SFT stage the config binds (`SFTConfig`), without its
    demonstration pool's prompts: what launch.rl reads after training the SFT stage itself."""
    import gin

    from jaxrl.tasks.source import get_task
    from jaxrl.train.sft import SFTConfig, rl_source_after_sft

    try:
        sft = SFTConfig(**{
            k: gin.query_parameter(f"SFTConfig.{k}")
            for k in ("steps", "batch_size", "num_demonstrations")
        })  # fmt: skip
    except ValueError as err:
        raise ValueError(
            f"task {TASK!r} needs the SFT stage's SFTConfig.steps, batch_size and "
            "num_demonstrations bound in the gin config (to skip its items)"
        ) from err
    source = get_task("chain_sum")(dataclasses.replace(spec, name="chain_sum"), tokenizer)
    return rl_source_after_sft(source, sft)


def child_main(flags: list[str]) -> None:
    from bench.learning import pg_no_is  # noqa: F401  (registers the loss "pg_no_is")
    from jaxrl.infra.launcher import launch
    from jaxrl.tasks.source import register_task
    from launch.rl import rl_main

    register_task(TASK, chain_after_sft, overwrite=True)
    launch(rl_main, flags)


# --- the experiment: SFT once, then the runs, then the summary --------------------------------


def launch_run(workdir: str, params: list[str]) -> float:
    """One `launch.rl` run (with this module's task and loss) in a child process on DEVICES
    simulated devices (its output in WORKDIR.log); returns its wall seconds."""
    _, seconds = runner.launch_child(
        CONFIG, workdir, params, devices=DEVICES,
        module="bench.learning.rl_streaming", module_args=("--child",),
    )  # fmt: skip
    return seconds


def make_sft(root: str, overrides: list[str]) -> str:
    """The config's SFT stage (then one RL step, launch.rl's smallest run); returns its dir."""
    workdir = os.path.join(root, "sft_run")
    params = TWO_DEVICES + overrides + [
        "RLConfig.total_steps = 1", "RLConfig.eval_size = 0",
        "RLConfig.schedule = 'fixed_lag'", "RLConfig.lag = 1",
    ]  # fmt: skip
    launch_run(workdir, params)
    return os.path.join(workdir, "sft")


def run_label(run: str, workdir: str) -> str:
    """The run's label with the loss its config.gin binds, e.g. "fixed lag 1 (ppo_clip)"."""
    path = os.path.join(workdir, "config.gin")
    text = open(path).read() if os.path.exists(path) else ""
    loss = re.search(r"^LossConfig\.name = '(\w+)'", text, re.M)
    return f"{RUNS[run][0]} ({loss.group(1) if loss else 'aipo'})"


def summarise(
    run: str,
    metrics_path: str,
    seconds: float,
    samples_per_prompt: int,
    until_step: int = 0,
    num_prompts: int = 16,
) -> dict:
    """One table row from a run's metrics.jsonl (step 0: the evaluation of the SFT start)."""
    mean = runner.mean
    records = runner.read(metrics_path, until_step)
    steps = [r for r in records if r["step"] > 0 and "loss" in r]
    last = steps[-1]
    label = run_label(run, os.path.dirname(metrics_path))
    row = {"run": run, "name": label, "steps": last["step"], "seconds": round(seconds)}
    row |= runner.curve_row(runner.evals(records))
    if "stream/token_staleness_mean" in last:
        row["token_staleness"] = mean(r["stream/token_staleness_mean"] for r in steps)
        row["token_staleness_max"] = max(r["stream/token_staleness_max"] for r in steps)
        row["mixed_rows"] = mean(r["stream/mixed_version_rows"] for r in steps)
        row["dropped_groups"] = last["stream/dropped_groups"]
        row["filtered_groups"] = last.get("data/filtered_groups", 0.0)
    else:  # fixed lag: every token of a batch has the batch's staleness
        row["token_staleness"] = mean(r["async/staleness"] for r in steps)
        row["token_staleness_max"] = max(r["async/staleness"] for r in steps)
        row["mixed_rows"] = 0.0
        row["dropped_groups"] = last.get("async/dropped_samples", 0.0) / samples_per_prompt
        # Dynamic sampling: the sampled groups not trained (oversample - 1 per trained one).
        trained = last["step"] * num_prompts
        row["filtered_groups"] = last.get("data/prompts_seen", trained) - trained
    row["completion_tokens"] = mean(r["completion/mean_tokens"] for r in steps)
    row["reward_last50"] = mean(r["reward/mean"] for r in steps[-50:])
    row["s_per_step"] = statistics.median(
        r["time/step_s"] for r in steps[1:] or steps
    )  # 1: compiles
    row["eval_s"] = mean(r["time/eval_s"] for r in runner.evals(records) if "time/eval_s" in r)
    return row


def verdict(rows: dict[str, dict]) -> dict:
    """The issue's criteria on the last-3-evaluation means (greedy)."""
    out = {}
    fixed, stream = rows.get("fixed_lag"), rows.get("streaming")
    if fixed and stream:
        gap = 100 * (stream["greedy_last3"] - fixed["greedy_last3"])
        out["streaming_minus_fixed_lag_pts"] = round(gap, 1)
        out["streaming_within_3_points_of_fixed_lag"] = abs(gap) <= 3.0
    for run in ("fixed_lag", "streaming"):
        if run in rows:
            out[f"{run}_gain_ge_15_points"] = rows[run]["greedy_gain_pts"] >= 15.0
    if stream and "streaming_no_is" in rows:
        out["no_correction_minus_streaming_pts"] = round(
            100 * (rows["streaming_no_is"]["greedy_last3"] - stream["greedy_last3"]), 1
        )
    return out


def run(args) -> list[dict]:
    if args.recipe_table:
        return write_recipe()
    runs = args.runs.split(",")
    if unknown := set(runs) - set(RUNS):
        raise SystemExit(f"--runs: unknown {sorted(unknown)}; choose from {list(RUNS)}")
    root = args.workdir
    os.makedirs(root, exist_ok=True)
    steps, eval_every, eval_size = args.steps, args.eval_every, args.eval_size
    base = []
    if args.smoke:
        base = list(SMOKE)
        steps, eval_every, eval_size = 6, 2, 16
    # The SFT stage's own evaluations (its default: 512 prompts x 5 every 100 steps) are only a
    # progress report here; the RL runs' step-0 evaluation is the start the table uses.
    sft_evals = base or ["SFTConfig.eval_every_steps = 300", "SFTConfig.eval_size = 256"]
    if args.sft_steps:
        sft_evals.append(f"SFTConfig.steps = {args.sft_steps}")
    if args.no_launch and not args.sft_dir:
        raise SystemExit("--no_launch summarises existing runs: pass their --sft_dir too")
    sft = args.sft_dir or make_sft(root, sft_evals + ["SFTConfig.eval_samples = 1"])
    params = TWO_DEVICES + base + [
        "rl_main.sft = None", f"PolicySpec.init_from = '{os.path.abspath(sft)}'",
        f"TaskSpec.name = '{TASK}'", f"RLConfig.total_steps = {steps}",
        f"RLConfig.eval_every_steps = {eval_every}", f"RLConfig.save_every_steps = {eval_every}",
        f"RLConfig.eval_size = {eval_size}", f"RLConfig.eval_samples = {args.eval_samples}",
    ]  # fmt: skip
    if args.learning_rate:
        params.append(f"OptimizerConfig.learning_rate = {args.learning_rate}")
    params += args.gin_param
    workdirs = {run: os.path.join(root, run) for run in runs}
    load = {"before": os.getloadavg()[0]}

    def one(run: str) -> tuple[str, float]:
        return run, launch_run(workdirs[run], params + RUNS[run][1])

    seconds = {}
    if args.no_launch:  # summarise the runs already in --workdir (stopped or finished)
        for run in runs:
            records = runner.read(os.path.join(workdirs[run], "metrics.jsonl"), args.until_step)
            seconds[run] = records[-1]["wall_time_s"] - records[0]["wall_time_s"]
    else:
        with concurrent.futures.ThreadPoolExecutor(max(args.parallel, 1)) as pool:
            for run, s in pool.map(one, runs):
                seconds[run] = s
                print(f"[bench] {run} done in {s:.0f} s ({workdirs[run]})", flush=True)
    load["after"] = os.getloadavg()[0]
    import launch.rl  # noqa: F401  (registers rl_main, which the config binds)
    from bench.common import RESULTS_DIR, command, gin_values, write_results

    shape = gin_values(CONFIG, [], "RLConfig.samples_per_prompt", "RLConfig.num_prompts")
    rows = {
        run: summarise(
            run,
            os.path.join(workdirs[run], "metrics.jsonl"),
            seconds[run],
            shape["RLConfig.samples_per_prompt"],
            args.until_step,
            shape["RLConfig.num_prompts"],
        )  # fmt: skip
        for run in runs
    }
    for row in rows.values():
        print(json.dumps(row), flush=True)
    result = verdict(rows)
    print(json.dumps({"verdict": result}), flush=True)
    name = args.name or (RESULTS + ("_smoke" if args.smoke else ""))
    note = (
        f"`{command()}`; SFT checkpoint {sft}; {os.cpu_count()} cores, load average "
        f"{load['before']:.1f} before / {load['after']:.1f} after; verdict {result}"
    )
    print(write_results(name, list(rows.values()), COLUMNS, note))
    png = os.path.join(RESULTS_DIR, name + ".png")
    labels = {run_label(run, workdirs[run]): workdirs[run] for run in runs}
    print(f"plot: {runner.plot_curves(labels, png, PANELS, until_step=args.until_step, bar=0.15)}")
    print(f"runs: {root}")
    return list(rows.values())


if __name__ == "__main__":  # a child run (`launch_run`); the experiment: python -m bench learning
    if sys.argv[1:2] != ["--child"]:
        raise SystemExit("run the experiment as `python -m bench learning rl-streaming`")
    child_main(sys.argv[2:])

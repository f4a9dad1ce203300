"""Does a real instruct model learn to call a tool by RL? SmolLM2-135M-Instruct on the chat
calculator (`configs/rl/calc_smollm2_learn.gin`: 3-digit x 2-digit products, its ChatML tool
calls, one worked exchange before the question), against three controls and in the two async
modes, each run from the same weights on a wall-time budget.

Runs (each a `launch.rl` child of the config on 2 simulated CPU devices):

1. rl: the config (sync RL on multi-turn episodes).
2. tool_disabled: `TaskSpec.tool_disabled = True`, every call answered `{"result": "?"}`
   (held-out evaluations too): calling gains nothing, so accuracy should not rise.
3. shuffled: `RLConfig.shuffle_rewards = True`: rewards permuted within each batch.
4. single_turn: the same prompts as one-turn completions (`rl_main.episodes = None`): no tool
   answers, the reply scored by its last number; what RL gets without the tool.
5. fixed_lag: the config in async mode, fixed lag 1 (the generator one version behind, AIPO
   corrects it), the engine on the second device.
6. streaming: async, streaming schedule (episodes join the running batch and span versions).

The engine compiles its decode programs as episodes first need them, and on SmolLM2 one such
program took 5.7 minutes to compile on this 2-core CPU; the runs therefore share JAX's
persistent compilation cache (`--compile_cache`, default WORKDIR/xla_cache), so a program one
run compiled is loaded by the next. Each run stops at `--steps` trainer steps or after
`--minutes` of wall time, whichever comes first, and is evaluated greedily on `--eval_size`
held-out problems every `--eval_every` steps (step 0 included): eval/accuracy and
eval/tool_call_rate (the share of episodes with a call). Reports per run: steps, s / step
(evaluations included) and the median seconds of an RL step alone (steps that evaluated left
out: the async modes' wall-clock against sync), tool-call rate and accuracy at the start and
at the end (mean of the last 2 evaluations), the gain, the mean train reward of the first and
last 10 steps, and how episodes ended (the mean over steps of the share done / truncated /
tool_error / timeout, and of malformed calls among steps). The verdicts of issue 55: rl's
greedy tool-call rate >= 80% and gain >= 25 points within 2 hours; each control's gain below
rl's; the async runs within 5 points of rl's accuracy at equal steps, and their median RL step
over sync's. Writes bench/results/NAME.{json,md,png}.

    python -m bench learning calc-smollm2 --init_from ~/.cache/jaxrl/smollm2-135m-instruct
    python -m bench learning calc-smollm2 --init_from DIR --runs rl,single_turn --minutes 30
    python -m bench learning calc-smollm2 --init_from DIR --smoke   # 1 short step each
    python -m bench learning calc-smollm2 --workdir W --no_launch   # summarise W's runs
"""

from __future__ import annotations

import json
import os
import statistics

from bench.learning import runner, smollm2

CONFIG = runner.config_path("calc_smollm2_learn.gin")
RESULTS = "calc_smollm2_learning"
DEVICES = 2
ASYNC = [  # the generator's engine on the second device
    "RLConfig.mode = 'async'",
    "rl_main.generator_mesh = @generator/MeshConfig()",
    "generator/MeshConfig.axis_names = ('dp', 'tp')",
    "generator/MeshConfig.axis_sizes = (1, 1)",
    "generator/MeshConfig.first_device = 1",
    "generator/MeshConfig.num_devices = 1",
    "RLConfig.max_staleness = 1",
    "RLConfig.queue_size = 1",
]
RUNS = {
    "rl": ("RL (AIPO), tool on, sync", []),
    "tool_disabled": ("control: tool disabled (?)", ["TaskSpec.tool_disabled = True"]),
    "shuffled": ("control: shuffled rewards", ["RLConfig.shuffle_rewards = True"]),
    "single_turn": ("control: single-turn RL, same prompts", ["rl_main.episodes = None"]),
    "fixed_lag": (
        "async, fixed lag 1",
        [*ASYNC, "RLConfig.schedule = 'fixed_lag'", "RLConfig.lag = 1"],
    ),
    "streaming": ("async, streaming", [*ASYNC, "RLConfig.schedule = 'streaming'"]),
}
TOOL_RATE_MIN, GAIN_PTS, ASYNC_WITHIN_PTS, BUDGET_S = 0.8, 25.0, 5.0, 7200.0
STATUSES = ("done", "truncated", "tool_error", "timeout", "malformed_step")
PANELS = [
    ("eval/accuracy", "held-out greedy accuracy"),
    ("eval/tool_call_rate", "held-out greedy tool-call rate"),
    ("reward/mean", "mean train reward"),
    ("episode/malformed_step_fraction", "malformed calls (share of steps)"),
]
TITLE = "SmolLM2-135M-Instruct learns the calculator tool (calc_smollm2_learn.gin)"


def add_options(parser) -> None:
    parser.add_argument("--init_from", default="", help="save_pretrained dir of SmolLM2")
    parser.add_argument("--runs", default=",".join(RUNS), help=f"comma list of {list(RUNS)}")
    parser.add_argument("--steps", type=int, default=400, help="trainer steps per run (at most)")
    parser.add_argument("--minutes", type=float, default=120.0, help="wall minutes per run")
    parser.add_argument("--eval_every", type=int, default=20)
    parser.add_argument("--eval_size", type=int, default=256)
    parser.add_argument("--save_every", type=int, default=20)
    parser.add_argument("--gin_param", action="append", default=[], help="more overrides")
    parser.add_argument(
        "--compile_cache", default="",
        help="JAX's persistent compilation cache for every run (default WORKDIR/xla_cache; "
        "'off': none)",
    )  # fmt: skip
    parser.add_argument("--no_launch", action="store_true", help="summarise WORKDIR's runs")
    parser.add_argument("--name", default="", help=f"results name (default {RESULTS})")


def _mean(records: list[dict], key: str) -> float | None:
    values = [r[key] for r in records if key in r]
    return round(statistics.mean(values), 4) if values else None


def summarise(name: str, label: str, workdir: str) -> dict:
    """One row: steps, s / step, tool-call rate and accuracy at the start and the end (mean of
    the last 2 evaluations), the gain (and within 2 hours), reward, how episodes ended."""
    row, evals, steps = runner.run_row(name, label, workdir, digits=1)
    if evals:
        last = evals[-2:]
        row["acc_start"] = evals[0]["eval/accuracy"]
        row["acc_end"] = round(statistics.mean(r["eval/accuracy"] for r in last), 4)
        row["gain_pts"] = round(100 * (row["acc_end"] - row["acc_start"]), 1) + 0.0  # not -0
        if "eval/tool_call_rate" in evals[0]:
            row["tool_start"] = evals[0]["eval/tool_call_rate"]
            row["tool_end"] = round(statistics.mean(r["eval/tool_call_rate"] for r in last), 4)
        within = [r for r in evals if r["wall_time_s"] - evals[0]["wall_time_s"] <= BUDGET_S]
        row["gain_pts_2h"] = round(100 * (within[-1]["eval/accuracy"] - row["acc_start"]), 1) + 0.0
        if "eval/tool_call_rate" in within[-1]:
            row["tool_2h"] = within[-1]["eval/tool_call_rate"]
        row["evals"] = len(evals)
    row |= smollm2.reward_ends(steps)
    evaluated = {r["step"] for r in evals}
    plain = [r["time/step_s"] for r in steps if "time/step_s" in r and r["step"] not in evaluated]
    if plain:  # the RL steps alone: steps that also evaluated are left out
        row["step_s_median"] = round(statistics.median(plain), 1)
    for status in STATUSES:  # episodes only (a single-turn run has none)
        if (value := _mean(steps, f"episode/{status}_fraction")) is not None:
            row[status] = value
    return row


def verdicts(by_name: dict) -> dict:
    """Issue 55's criteria on the rows that are there."""
    verdict = {}
    rl = by_name.get("rl", {})
    if "gain_pts_2h" in rl:
        verdict["rl_tool_rate_ge_80_within_2h"] = (rl.get("tool_2h") or 0) >= TOOL_RATE_MIN
        verdict["rl_gain_ge_25_within_2h"] = rl["gain_pts_2h"] >= GAIN_PTS
        for control in ("tool_disabled", "shuffled", "single_turn"):
            if "gain_pts" in by_name.get(control, {}):
                verdict[f"{control}_gains_less"] = by_name[control]["gain_pts"] < rl["gain_pts"]
    for mode in ("fixed_lag", "streaming"):
        other = by_name.get(mode, {})
        if "acc_end" in other and "acc_end" in rl and other.get("steps") == rl.get("steps"):
            gap = 100 * abs(other["acc_end"] - rl["acc_end"])
            verdict[f"{mode}_within_5_pts_of_sync"] = gap <= ASYNC_WITHIN_PTS
            if other.get("step_s_median") and rl.get("step_s_median"):
                ratio = other["step_s_median"] / rl["step_s_median"]
                verdict[f"{mode}_step_s_over_sync"] = round(ratio, 3)
    return verdict


def run(args) -> None:
    if args.smoke:
        args.steps, args.eval_every, args.eval_size, args.save_every = 1, 1, 4, 100
        args.gin_param += ["RLConfig.num_prompts = 2", "RLConfig.samples_per_prompt = 2"]
    dirs = smollm2.run_dirs(args, RUNS)
    names, workdir = list(dirs), args.workdir
    if not args.no_launch:
        from bench.common import command

        runner.note_launch(workdir, f"{command()}\n")
        params = smollm2.base_params(args, save_every=args.save_every)
        params += ["rl_main.plot = False", *args.gin_param]
        cache = args.compile_cache or os.path.join(workdir, "xla_cache")
        env = {} if cache == "off" else {"JAX_COMPILATION_CACHE_DIR": os.path.abspath(cache)}
        for n in names:
            runner.launch_child(
                CONFIG, dirs[n], params + RUNS[n][1], devices=DEVICES,
                seconds=args.minutes * 60, must_succeed=False, env=env,
            )  # fmt: skip

    rows = [summarise(n, RUNS[n][0], dirs[n]) for n in names]
    for row in rows:
        print(json.dumps(row), flush=True)
    verdict = verdicts({r["name"]: r for r in rows})
    print(json.dumps({"verdict": verdict, "workdir": workdir}), flush=True)

    from bench.common import command

    name = args.name or (RESULTS + ("_smoke" if args.smoke else ""))
    columns = [
        ("run", "run"), ("steps", "steps"), ("s_per_step", "s / step"),
        ("step_s_median", "median s / RL step"), ("wall_s", "wall s"),
        ("tool_start", "tool-call rate start"), ("tool_end", "tool-call rate end"),
        ("acc_start", "accuracy start"), ("acc_end", "accuracy end"), ("gain_pts", "gain (pts)"),
        ("gain_pts_2h", "gain within 2 h (pts)"), ("reward_first10", "reward, first 10 steps"),
        ("reward_last10", "reward, last 10 steps"), ("done", "done"),
        ("truncated", "truncated"), ("tool_error", "tool error"), ("timeout", "timeout"),
        ("malformed_step", "malformed calls"),
    ]  # fmt: skip
    note = f"`{command()}` on {DEVICES}x cpu ({os.cpu_count()} cpus); verdict {verdict}"
    labels = {RUNS[n][0]: dirs[n] for n in names}
    runner.write_report(name, rows, columns, note, workdir, labels, PANELS, x="minutes",
                        title=TITLE, dpi=110)  # fmt: skip

"""Is tool use learned by RL? The calculator task (`configs/rl/calc_tiny.gin`: a 0.4M Llama, the
character tokenizer, 2-digit products, a tool call `(37*48)` answered `=1776`) from one SFT warm
start whose demonstrations call the tool in ~10% of cases, against three controls.

Runs (each a `launch.rl` child process of the config, one CPU device, under the same settings):

1. rl: the config: the SFT stage (WORKDIR/rl/sft), then sync RL on multi-turn episodes.
2. tool_disabled: `TaskSpec.tool_disabled = True`, the environment answers every call with `=?`
   (held-out evaluations too): calling the tool gains nothing, so accuracy should stay within
   5 points of the start.
3. mask_off: `rl_main.mask_observations = False`, the tool's replies are trained on as if the
   policy had written them (behaviour log-prob placeholder 0, `Trajectory.to_rollout`).
4. shuffled: `RLConfig.shuffle_rewards = True`, rewards permuted within each batch: no
   information in the signal; accuracy should not rise.

The controls start from a copy of run 1's finished SFT stage (`launch.rl` finds it done and goes
straight to RL, on the same prompt stream). Each RL stage stops at `--steps` or `--minutes` of
wall time after its first record (the step-0 evaluation; the child is interrupted and saves),
whichever comes first. Greedy held-out episodes (`RLConfig.eval_size` problems disjoint from
training) give eval/accuracy and eval/tool_call_rate every `--eval_every` steps.

"Writes the tool output itself" (the mask_off question) is measured on each run's final
checkpoint and on the warm start by a probe: greedy decoding of the held-out prompts with `)`
*not* a stop id (so the environment never answers); the rate is the share of completions that
go on after their first `)` with `=` and a digit, i.e. the policy writes the observation
`=<value>` itself; `probe_correct` is the share whose written value is the right product. A
second pass gives each prompt its own right call `a*b=(a*b)` and samples the continuation at
temperature 1 (as in RL episodes): `probe_forced_t1_writes_output` / `_correct`. A third gives
the right call and value `a*b=(a*b)=<value>` and counts greedy answers equal to the value, by
the value's digit count (`copy_3_digits`, `copy_4_digits`: right / all).

Writes bench/results/NAME.{json,md,png} (NAME calc_learning, or calc_learning_smoke): one row
per run (steps, s/step, RL wall, tool-call rate and accuracy at the start and the end, the
gain, the probe's rates) and the curves against RL wall minutes. The header notes the machine's
load average before and after (the machine may be shared).

    python -m bench learning calc                  # the full experiment (about an hour)
    python -m bench learning calc --smoke          # 20 SFT steps, 3 RL steps each: plumbing
    python -m bench learning calc --workdir W --no_launch   # summarise runs already in W
"""

from __future__ import annotations

import json
import os
import re
import shutil

from bench.learning import runner

CONFIG = runner.config_path("calc_tiny.gin")
RESULTS = "calc_learning"
RUNS = {
    "rl": ("RL (AIPO), tool on", []),
    "tool_disabled": ("control: tool disabled (=?)", ["TaskSpec.tool_disabled = True"]),
    "mask_off": ("control: no observation mask", ["rl_main.mask_observations = False"]),
    "shuffled": ("control: shuffled rewards", ["RLConfig.shuffle_rewards = True"]),
}
TOOL_RATE_MIN, GAIN_PTS, CONTROL_MAX_PTS = 0.9, 40.0, 5.0
SMOKE = [
    "SFTConfig.steps = 20", "SFTConfig.eval_every_steps = 10", "SFTConfig.eval_size = 16",
    "RLConfig.num_prompts = 4",
]  # fmt: skip
WRITES_OUTPUT = re.compile(r"\)=(\d+)")
PANELS = [("eval/accuracy", "held-out greedy accuracy"),
          ("eval/tool_call_rate", "held-out greedy tool-call rate")]  # fmt: skip


def add_options(parser) -> None:
    parser.add_argument("--runs", default=",".join(RUNS), help=f"comma list of {list(RUNS)}")
    parser.add_argument("--steps", type=int, default=0, help="RL steps per run (0: the config's)")
    parser.add_argument("--minutes", type=float, default=15.0, help="RL wall minutes per run")
    parser.add_argument("--eval_every", type=int, default=0, help="0: the config's")
    parser.add_argument("--eval_size", type=int, default=512)
    parser.add_argument("--gin_param", action="append", default=[], help="more overrides")
    parser.add_argument("--no_launch", action="store_true", help="summarise WORKDIR's runs")


def launch_run(workdir: str, params: list[str], seconds: float) -> None:
    """`python -m launch.rl` on the config in a child process (output in WORKDIR.log); its RL
    stage is interrupted (SIGINT: it saves and stops) `seconds` after its first record."""
    runner.launch_child(CONFIG, workdir, params, seconds=seconds, budget_from_first_record=True)


def claim_workdir(workdir: str, params: list[str], sft_dir: str) -> None:
    """Starts `workdir` as `launch.rl` would with `params` (its config.gin, written as the
    launcher writes it) and puts a copy of the finished SFT stage `sft_dir` in it: the launch
    then resumes this run, finds its SFT stage done and goes straight to RL."""
    import gin

    import launch.rl
    from jaxrl.infra.config import parse_gin, resolve_bindings
    from jaxrl.infra.launcher import prepare_workdir

    parse_gin([CONFIG], params)
    try:
        resolve_bindings(launch.rl.rl_main)
        prepare_workdir(workdir, gin.config_str(), overwrite=False)
    finally:
        gin.clear_config()
    if not os.path.exists(os.path.join(workdir, "sft")):
        shutil.copytree(sft_dir, os.path.join(workdir, "sft"))


def probe(workdir: str, eval_size: int, digits: tuple[int, int], max_new_tokens: int = 16) -> dict:
    """The "writes the tool output itself" probe (module docstring) on `workdir`'s newest
    checkpoint (a run's, or an SFT stage's); `digits`: the task's (min, max) operand digits."""
    import jax

    from jaxrl.generation.placement import colocated_sampler
    from jaxrl.generation.sampling import SamplingConfig
    from jaxrl.job.specs import TaskSpec, build_source
    from jaxrl.tasks.source import encode_prompts

    trainer, tokenizer, step, params = runner.restored_trainer(workdir)
    sampler = colocated_sampler(trainer, tokenizer)
    task = TaskSpec(name="calculator", operators="*", min_digits=digits[0], max_digits=digits[1])
    source = build_source(task, tokenizer)
    items = source.eval_items(eval_size)
    prompt_ids = encode_prompts(tokenizer, items, chat_formatted=False)
    operands = [source.task.operands(i, "heldout") for i in range(len(items))]

    def rates(prompts, sampling, prefix: str) -> tuple[float, float]:
        """Shares of completions (after `prefix`, their own text) going on after their first
        `)` with `=` and a value, and with the right value."""
        written = correct = 0
        for start in range(0, len(prompts), 256):
            rows = prompts[start : start + 256]
            out = sampler.generate(params, rows, sampling, jax.random.key(start))
            for i in range(len(rows)):
                ids = out.tokens_bn[i, : out.lengths_b[i]]
                a, b = operands[start + i]
                text = prefix.format(a=a, b=b) + tokenizer.decode(ids, skip_special_tokens=True)
                m = WRITES_OUTPUT.search(text)
                if m and m.start() == text.find(")"):
                    written += 1
                    correct += int(m.group(1)) == a * b
        return round(written / len(prompts), 4), round(correct / len(prompts), 4)

    greedy = SamplingConfig(max_new_tokens, greedy=True)  # EOS only: `)` does not stop
    calls = rates(prompt_ids, greedy, "")
    # Its own call forced, sampled at temperature 1 (the RL episodes' sampling).
    forced = [list(tokenizer.encode(f"{a}*{b}=({a}*{b})")) for a, b in operands]
    forced_rates = rates(forced, SamplingConfig(max_new_tokens), "({a}*{b})")
    # The right call and value given: is the answer copied right, by the value's length?
    given = [list(tokenizer.encode(f"{a}*{b}=({a}*{b})={a * b}")) for a, b in operands]
    copied: dict[int, list[bool]] = {}
    for start in range(0, len(given), 256):
        rows = given[start : start + 256]
        out = sampler.generate(params, rows, greedy, jax.random.key(0))
        for i in range(len(rows)):
            a, b = operands[start + i]
            text = tokenizer.decode(out.tokens_bn[i, : out.lengths_b[i]], skip_special_tokens=True)
            copied.setdefault(len(str(a * b)), []).append(text == str(a * b))
    copy_rates = {f"copy_{d}_digits": f"{sum(v)}/{len(v)}" for d, v in sorted(copied.items())}
    return copy_rates | {
        "probe_step": step,
        "probe_writes_output": calls[0],
        "probe_correct": calls[1],
        "probe_forced_t1_writes_output": forced_rates[0],
        "probe_forced_t1_correct": forced_rates[1],
    }


def summarise(name: str, label: str, workdir: str) -> dict:
    """One row: steps, s/step, RL wall, tool-call rate and accuracy at the start / the end."""
    row, evals, _ = runner.run_row(name, label, workdir, digits=2)
    if not evals:
        return row
    t0 = evals[0]["wall_time_s"]
    first, last = evals[0], evals[-1]
    row |= {
        "tool_start": first["eval/tool_call_rate"],
        "tool_end": last["eval/tool_call_rate"],
        "acc_start": first["eval/accuracy"],
        "acc_end": last["eval/accuracy"],
        "acc_max": max(r["eval/accuracy"] for r in evals),
        "end_step": last["step"],
        "evals": len(evals),
    }
    row["gain_pts"] = round(100 * (row["acc_end"] - row["acc_start"]), 1)
    reached = [
        r
        for r in evals
        if r["eval/tool_call_rate"] >= TOOL_RATE_MIN
        and 100 * (r["eval/accuracy"] - row["acc_start"]) >= GAIN_PTS
    ]
    if reached:
        row["target_step"] = reached[0]["step"]
        row["target_s"] = round(reached[0]["wall_time_s"] - t0, 1)
    return row


def sft_row(sft_dir: str) -> dict:
    """The warm start: its SFT steps and wall seconds (its own evaluation is single-turn)."""
    records = runner.read(os.path.join(sft_dir, "metrics.jsonl"))
    return {
        "run": "SFT warm start (10% tool demonstrations)",
        "name": "sft",
        "steps": records[-1]["step"],
        "wall_s": round(records[-1]["wall_time_s"] - records[0]["wall_time_s"], 1),
    }


def run(args) -> None:
    params = list(args.gin_param)
    if args.smoke:
        args.steps, args.eval_every, args.eval_size = 3, 3, 16
        params = SMOKE + params
    if args.steps:
        params.append(f"RLConfig.total_steps = {args.steps}")
        params.append(f"RLConfig.save_every_steps = {args.steps}")
    if args.eval_every:
        params.append(f"RLConfig.eval_every_steps = {args.eval_every}")
    params.append(f"RLConfig.eval_size = {args.eval_size}")
    names = [n for n in args.runs.split(",") if n]
    unknown = sorted(set(names) - set(RUNS))
    if unknown or names[:1] != ["rl"]:
        raise SystemExit(f"--runs {args.runs!r}: choose from {list(RUNS)}, 'rl' first")
    workdir = args.workdir
    os.makedirs(workdir, exist_ok=True)
    dirs = {n: os.path.join(workdir, n) for n in names}
    sft_dir = os.path.join(dirs["rl"], "sft")

    from bench.common import command

    load_before = runner.load()
    if not args.no_launch:
        runner.note_launch(workdir, f"{command()} (load average {load_before} at its start")
        if not os.path.exists(os.path.join(dirs["rl"], "metrics.jsonl")):
            launch_run(dirs["rl"], params + RUNS["rl"][1], args.minutes * 60)
        for n in names[1:]:
            claim_workdir(dirs[n], params + RUNS[n][1], sft_dir)  # the same warm start
            launch_run(dirs[n], params + RUNS[n][1], args.minutes * 60)
        runner.note_launch(workdir, f", {runner.load()} at its end)\n", stamp=False)
    load_after = runner.load()

    import launch.rl  # noqa: F401  (registers rl_main, which the config binds)
    from bench.common import gin_values

    bound = gin_values(CONFIG, params, "TaskSpec.min_digits", "TaskSpec.max_digits")
    digits = (bound["TaskSpec.min_digits"], bound["TaskSpec.max_digits"])
    rows = [sft_row(sft_dir) | probe(sft_dir, args.eval_size, digits)]
    for n in names:
        rows.append(summarise(n, RUNS[n][0], dirs[n]) | probe(dirs[n], args.eval_size, digits))
    for row in rows:
        print(json.dumps(row), flush=True)
    by_name = {r["name"]: r for r in rows}
    rl, verdict = by_name["rl"], {}
    if "acc_end" in rl:
        verdict["rl_tool_rate_ge_90_and_gain_ge_40_within_budget"] = (
            rl.get("target_s", float("inf")) <= args.minutes * 60
        )
    for n in ("tool_disabled", "shuffled"):
        if "acc_end" in by_name.get(n, {}):
            verdict[f"{n}_within_5_pts"] = abs(by_name[n]["gain_pts"]) <= CONTROL_MAX_PTS
    print(json.dumps({"verdict": verdict, "workdir": workdir}), flush=True)

    name = RESULTS + ("_smoke" if args.smoke else "")
    columns = [
        ("run", "run"), ("steps", "steps"), ("s_per_step", "s / step"), ("wall_s", "wall s"),
        ("tool_start", "tool rate start"), ("tool_end", "tool rate end"),
        ("acc_start", "accuracy start"), ("acc_end", "accuracy end"), ("gain_pts", "gain (pts)"),
        ("target_s", "s to tool >= 90% and +40 pts"),
        ("probe_writes_output", "probe (greedy): writes `)=value` itself"),
        ("probe_correct", "probe (greedy): value right"),
        ("probe_forced_t1_writes_output", "probe (call given, T=1): writes `=value`"),
        ("probe_forced_t1_correct", "probe (call given, T=1): value right"),
        ("copy_3_digits", "answer right, call + 3-digit value given"),
        ("copy_4_digits", "answer right, call + 4-digit value given"),
    ]  # fmt: skip
    note = (
        f"`{command()}`, each run a launch.rl child on 1 CPU device ({os.cpu_count()} cpus, "
        f"shared; load average 1/5/15 min {load_before} before this summary, {load_after} after); "
        f"held-out problems: {args.eval_size}; verdict {verdict}"
    )
    labels = {RUNS[n][0]: dirs[n] for n in names}
    title = "calc_tiny.gin: held-out greedy episodes (warm start: 10% tool demonstrations)"
    runner.write_report(name, rows, columns, note, workdir, labels, PANELS, x="minutes",
                        title=title, dpi=110)  # fmt: skip

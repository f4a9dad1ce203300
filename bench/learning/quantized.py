"""Does sampling in 8 bits change what RL learns? SmolLM2-135M-Instruct on reasoning-gym's
basic_arithmetic (`configs/rl/smollm2_arith.gin`: async, fixed lag 1, AIPO), the same seeds and
steps, three runs from the same weights:

1. fp32: the generator samples the pushed weights as they are (`GeneratorConfig.weights`
   'native').
2. int8: the generator's engine samples an int8 copy of each pushed version (W8A8 on CPU,
   `jaxrl.generation.quantize`); AIPO's importance weights see the quantized policy's
   behaviour log-probs, so they correct the quantization as they correct the lag.
   `gen/mismatch_kl` measures KL(int8 || fp32) at the behaviour version per step.
3. int8, uncorrected (the negative control): the same sampling, but the trainer is handed the
   full-precision log-probs of the sampled tokens at the behaviour version as the behaviour
   log-probs (`GeneratorConfig.mismatch = 'uncorrected'`): the lag is corrected, the
   quantization is not.
4. int5 and its uncorrected control (`--runs int5,int5_uncorrected`): the same pair with 5-bit
   levels (`GeneratorConfig.weights = 'int5_weights'`), a mismatch several times int8's, where
   leaving the quantization uncorrected should cost more.

Each run is a child `launch.rl` on 2 simulated CPU devices (trainer on one, the generator on the
other) for `--steps` steps, evaluated greedily in full precision on `--eval_size` held-out
problems every `--eval_every` steps (step 0 included). Reports per run: the greedy accuracy at
the start and the end, the gain, the mean train reward of the first and last 10 steps, the mean
`gen/mismatch_kl`, AIPO's truncated fraction and the trainer's `abs_log_ratio_max`; the verdict
of issue 54's criterion (int8's gain within 3 points of fp32's). Writes bench/results/NAME.{json,
md} and NAME.png (held-out accuracy, train reward, mismatch KL and truncated fraction by step).

    python -m bench learning quantized --init_from ~/.cache/jaxrl/smollm2-135m-instruct
    python -m bench learning quantized --init_from DIR --smoke   # 2 short steps each: plumbing
    python -m bench learning quantized --workdir W --no_launch   # summarise runs already in W
    python -m bench learning quantized --pool A,B,C --name P   # pairs over seeds' results files

`--pool` reads results files written by runs of the same pairs on different seeds (each row's
`eval_curve`) and writes, per seed and pooled, the control's held-out accuracy minus the
corrected run's (its gain, and its mean over the evaluations after step 0) and the differences
of their mean mismatch KL and late train reward; over the seeds each difference's mean, standard
error and t (`pool`).
"""

from __future__ import annotations

import json
import os
import statistics

from bench.learning import runner, smollm2

CONFIG = smollm2.CONFIG
RESULTS = "quantized_learning"
RUNS = {
    "fp32": ("fp32 generator", ["GeneratorConfig.weights = 'native'"]),
    "int8": ("int8 generator (AIPO corrects it)", ["GeneratorConfig.weights = 'int8'"]),
    "uncorrected": (
        "control: int8, full-precision log-probs as behaviour",
        ["GeneratorConfig.weights = 'int8'", "GeneratorConfig.mismatch = 'uncorrected'"],
    ),
    # 5-bit levels (in int8 bytes): a larger mismatch, where the correction should matter.
    "int5": ("int5 generator (AIPO corrects it)", ["GeneratorConfig.weights = 'int5_weights'"]),
    "int5_uncorrected": (
        "control: int5, full-precision log-probs as behaviour",
        ["GeneratorConfig.weights = 'int5_weights'", "GeneratorConfig.mismatch = 'uncorrected'"],
    ),
}
WITHIN_PTS = 3.0
PAIRS = (("int8", "uncorrected"), ("int5", "int5_uncorrected"))  # (corrected, its control)
PANELS = [
    ("eval/accuracy", "held-out greedy accuracy"),
    ("reward/mean", "mean train reward"),
    ("gen/mismatch_kl", "KL(quantized || fp32) at the behaviour version"),
    ("truncated_fraction", "AIPO truncated fraction"),
]
TITLE = "SmolLM2-135M-Instruct, basic_arithmetic: 8-bit rollouts (smollm2_arith.gin)"


def add_options(parser) -> None:
    parser.add_argument("--init_from", default="", help="save_pretrained dir of SmolLM2")
    parser.add_argument("--runs", default="fp32,int8,uncorrected", help=f"of {sorted(RUNS)}")
    parser.add_argument("--steps", type=int, default=60, help="trainer steps per run")
    parser.add_argument("--eval_every", type=int, default=30)
    parser.add_argument("--eval_size", type=int, default=256)
    parser.add_argument("--gin_param", action="append", default=[], help="more overrides")
    parser.add_argument("--no_launch", action="store_true", help="summarise WORKDIR's runs")
    parser.add_argument("--name", default="", help=f"results name (default {RESULTS})")
    parser.add_argument("--pool", default="", help="comma list of results names: pool their pairs")


def _mean(records, key):
    values = [r[key] for r in records if key in r]
    return round(statistics.mean(values), 6) if values else None


def summarise(name: str, label: str, workdir: str) -> dict:
    row, evals, steps = runner.run_row(name, label, workdir, digits=1)
    if evals:
        row["greedy_start"] = evals[0]["eval/accuracy"]
        row["greedy_end"] = evals[-1]["eval/accuracy"]
        row["gain_pts"] = round(100 * (row["greedy_end"] - row["greedy_start"]), 1)
        row["evals"] = len(evals)
        row["eval_curve"] = [[r["step"], r["eval/accuracy"]] for r in evals]
    row |= smollm2.reward_ends(steps)
    if steps:
        for key, column in (("gen/mismatch_kl", "mismatch_kl"),
                            ("truncated_fraction", "truncated_fraction"),
                            ("abs_log_ratio_max", "abs_log_ratio_max")):  # fmt: skip
            row[column] = _mean(steps, key)
    return row


def paired_kl(workdir_a: str, workdir_b: str, key: str = "gen/mismatch_kl") -> dict:
    """`key` of run b minus run a, paired by step (the same seeds give both runs the same
    prompts at each step, so the pairing removes the prompts' share of the variance): the mean
    difference, its standard error and t over the steps both logged, over all of them and over
    their second half (a mismatch the uncorrected run lets grow shows there), and each run's
    mean over the first and the second half."""
    a, b = ({r["step"]: r[key] for r in runner.read(os.path.join(w, "metrics.jsonl")) if key in r}
            for w in (workdir_a, workdir_b))  # fmt: skip
    steps = sorted(set(a) & set(b))
    if len(steps) < 4:
        return {}
    out = {"paired_steps": len(steps)}
    first, half = steps[: len(steps) // 2], steps[len(steps) // 2 :]
    for part, chosen in (("all", steps), ("second_half", half)):
        diffs = [b[s] - a[s] for s in chosen]
        mean, se = statistics.mean(diffs), statistics.stdev(diffs) / len(diffs) ** 0.5
        t = round(mean / se, 2) if se else None  # None: the same difference at every step
        out[part] = {"mean_diff": round(mean, 6), "se": round(se, 6), "t": t}
    for name, run in (("a", a), ("b", b)):
        out[f"{name}_first_half"] = round(statistics.mean(run[s] for s in first), 6)
        out[f"{name}_second_half"] = round(statistics.mean(run[s] for s in half), 6)
    return out


def _spread(values: list[float]) -> dict:
    """Mean, standard error and t of `values` (one per seed; se and t need two)."""
    out = {"mean": round(statistics.mean(values), 6)}
    if len(values) >= 2:
        se = statistics.stdev(values) / len(values) ** 0.5
        out |= {"se": round(se, 6), "t": round(out["mean"] / se, 2) if se else None}
    return out


def pool(names: list[str]) -> list[dict]:
    """The corrected / control pairs of the results files `names` (one seed each), one row per
    pair and seed: the control's gain minus the corrected run's (points), the mean over the
    held-out evaluations after step 0 of the control's accuracy minus the corrected run's
    (points; both runs evaluate the same problems, so each difference is paired), the
    control's mean mismatch KL minus the corrected run's, and its mean train reward (on its own
    quantized samples) over the last 10 steps minus the corrected run's; then, per pair kind, a
    pooled row of each difference over the seeds (`_spread`)."""
    from bench.common import RESULTS_DIR

    rows = []
    for name in names:
        with open(os.path.join(RESULTS_DIR, f"{name}.json")) as f:
            by = {r["name"]: r for r in json.load(f)["rows"]}
        for a, b in PAIRS:
            if a not in by or b not in by:
                continue
            if "eval_curve" not in by[a] or "eval_curve" not in by[b]:
                raise SystemExit(f"{name}.json has no eval_curve: summarise its runs again "
                                 "(--workdir W --no_launch)")  # fmt: skip
            ca, cb = dict(map(tuple, by[a]["eval_curve"])), dict(map(tuple, by[b]["eval_curve"]))
            later = sorted(s for s in set(ca) & set(cb) if s > 0)
            rows.append({
                "results": name, "pair": f"{b} - {a}", "steps": by[a]["steps"],
                "gain_diff_pts": round(by[b]["gain_pts"] - by[a]["gain_pts"], 1),
                "eval_diff_pts": round(100 * statistics.mean(cb[s] - ca[s] for s in later), 2),
                "evals_after_0": len(later),
                "kl_diff": round(by[b]["mismatch_kl"] - by[a]["mismatch_kl"], 6),
                "reward_last10_diff": round(by[b]["reward_last10"] - by[a]["reward_last10"], 3),
            })  # fmt: skip
    for pair in dict.fromkeys(r["pair"] for r in rows):
        mine = [r for r in rows if r["pair"] == pair]
        if len(mine) < 2:
            continue
        pooled = {"results": f"pooled over {len(mine)} seeds", "pair": pair}
        for key in ("gain_diff_pts", "eval_diff_pts", "kl_diff", "reward_last10_diff"):
            spread = _spread([r[key] for r in mine])
            pooled[key] = spread["mean"]
            pooled |= {f"{key}_{k}": v for k, v in spread.items() if k != "mean"}
        rows.append(pooled)
    return rows


def write_pool(args) -> None:
    from bench.common import command, write_results

    workdir = args.workdir  # launches nothing: the directory `bench learning` made goes again
    if os.path.basename(workdir).startswith(RESULTS + "_") and not os.listdir(workdir):
        os.rmdir(workdir)
    rows = pool([n for n in args.pool.split(",") if n])
    if not rows:
        raise SystemExit(f"--pool {args.pool}: no corrected / control pair in those results")
    for row in rows:
        print(json.dumps(row), flush=True)
    columns = [
        ("results", "results"), ("pair", "control - corrected"), ("steps", "steps"),
        ("gain_diff_pts", "gain diff (pts)"), ("gain_diff_pts_se", "se"),
        ("gain_diff_pts_t", "t"), ("eval_diff_pts", "eval diff after step 0 (pts)"),
        ("eval_diff_pts_se", "se"), ("eval_diff_pts_t", "t"), ("kl_diff", "mismatch KL diff"),
        ("kl_diff_se", "se"), ("kl_diff_t", "t"),
        ("reward_last10_diff", "train reward diff, last 10 steps"),
        ("reward_last10_diff_se", "se"), ("reward_last10_diff_t", "t"),
    ]  # fmt: skip
    print(write_results(args.name or RESULTS + "_pooled", rows, columns, f"`{command()}`"))


def run(args) -> None:
    if args.pool:
        return write_pool(args)
    if args.smoke:
        args.steps, args.eval_every, args.eval_size = 2, 1, 8
        args.gin_param += ["RLConfig.num_prompts = 2", "RLConfig.max_new_tokens = 16"]
    dirs = smollm2.run_dirs(args, RUNS)
    names, workdir = list(dirs), args.workdir
    if not args.no_launch:
        from bench.common import command

        runner.note_launch(workdir, f"{command()}\n")
        params = smollm2.base_params(args, save_every=args.steps)
        params += ["rl_main.plot = False", *args.gin_param]
        for n in names:
            runner.launch_child(CONFIG, dirs[n], params + RUNS[n][1], devices=smollm2.DEVICES)

    rows = [summarise(n, RUNS[n][0], dirs[n]) for n in names]
    for row in rows:
        print(json.dumps(row), flush=True)
    by_name = {r["name"]: r for r in rows}
    verdict = {}
    if "gain_pts" in by_name.get("fp32", {}) and "gain_pts" in by_name.get("int8", {}):
        gap = by_name["int8"]["gain_pts"] - by_name["fp32"]["gain_pts"]
        verdict["int8_gain_minus_fp32_pts"] = round(gap, 1)
        verdict["int8_within_3_pts"] = abs(gap) <= WITHIN_PTS
    for a, b in PAIRS:
        if a in dirs and b in dirs:
            verdict[f"uncorrected_minus_{a}_mismatch_kl"] = paired_kl(dirs[a], dirs[b])
    print(json.dumps({"verdict": verdict, "workdir": workdir}), flush=True)

    from bench.common import command

    name = args.name or (RESULTS + ("_smoke" if args.smoke else ""))
    columns = [
        ("run", "run"), ("steps", "steps"), ("s_per_step", "s / step"),
        ("greedy_start", "greedy start"), ("greedy_end", "greedy end"), ("gain_pts", "gain (pts)"),
        ("reward_first10", "reward, first 10 steps"), ("reward_last10", "reward, last 10 steps"),
        ("mismatch_kl", "gen/mismatch_kl (mean)"), ("truncated_fraction", "truncated fraction"),
        ("abs_log_ratio_max", "abs log-ratio max (mean)"),
    ]  # fmt: skip
    note = f"`{command()}` on {smollm2.DEVICES}x cpu ({os.cpu_count()} cpus); verdict {verdict}"
    labels = {RUNS[n][0]: dirs[n] for n in names}
    runner.write_report(name, rows, columns, note, workdir, labels, PANELS, title=TITLE, dpi=110)

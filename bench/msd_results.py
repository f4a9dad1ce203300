"""MSD against KD, KD-aug and no KD on DigitsCaption over several seeds: the results table.

Runs `launch.msd` (in this process) on configs/msd/digits_caption.gin twice:

- main: the config as written (its regime mix: some samples with one modality uninformative or
  a conflicting caption);
- control: every sample in the "both informative" regime (MSD is not expected to help there).

Each study lives in ROOT/<study> and is resumable (rerun the same command to continue). The
MSD weighting is chosen on the validation split; the verdict compares it with KD on test
full-input accuracy in paired standard errors (`msd_jax.report`). Writes
bench/results/msd_results.{json,md,png} (the table per study and method; the markdown also
carries the verdicts and the teachers' accuracy) and msd_results_regimes.{json,md} (test
full-input accuracy within each regime, per study and method); `--smoke` writes the same
names with `_smoke` at the end.

    python -m bench.msd_results                       # both studies, the config's seeds
    python -m bench.msd_results --seeds 10            # seeds 0..9
    python -m bench.msd_results --smoke               # tiny sizes, the main study only (CI)
"""

from __future__ import annotations

import argparse
import json
import os
import time

import gin

from bench.common import RESULTS_DIR, command, machine, write_results
from jaxrl.infra.launcher import launch
from msd_jax import report
from msd_jax.data import REGIMES

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, "configs", "msd", "digits_caption.gin")
STUDIES = {
    "main": [],
    "control": ["DigitsCaptionConfig.regime_mix = (1.0, 0.0, 0.0, 0.0)"],
}
# A few steps of everything (the CI smoke test of the config runs these overrides).
SMOKE_PARAMS = [
    "teacher/ModelSpec.mlp_hidden_sizes = (16,)",
    "teacher/TrainConfig.steps = 2",
    "teacher/TrainConfig.save_every_steps = 2",
    "TeacherConfig.num_folds = 2",
    "student/ModelSpec.mlp_hidden_sizes = (8,)",
    "student/TrainConfig.steps = 6",
    "student/TrainConfig.save_every_steps = 6",
    "student/TrainConfig.log_every_steps = 2",
    "StudyConfig.seeds = (0, 1)",
    "StudyConfig.methods = ('kd', 'kd_aug', 'msd/instance', 'msd/learned')",
]
COLUMNS = [
    ("study", "study"),
    ("method", "method"),
    ("seeds", "seeds"),
    ("val_full", "val full"),
    ("test_full", "test full input"),
    ("test_text", "test text only"),
    ("test_image", "test image only"),
    ("vs_kd", "test full − KD (paired)"),
]
# msd_results_regimes: `msd_jax.report.regime_rows` of each study (a study without a regime
# leaves its cells empty: the control has only "both").
REGIME_COLUMNS = [("study", "study"), ("method", "method")] + [
    (regime, regime.replace("_", " ")) for regime in REGIMES
]


def run_study(workdir: str, params: list[str]) -> dict:
    """`python -m launch.msd --gin_file=CONFIG --workdir=WORKDIR --gin_param=...` in-process."""
    from launch.msd import msd_main

    flags = ["--gin_file", CONFIG, "--workdir", workdir]
    for p in params:
        flags += ["--gin_param", p]
    try:
        return launch(msd_main, flags)
    finally:
        gin.clear_config()


def _cell(mean_se: tuple[float, float]) -> str:
    mean, se = mean_se
    return f"{100 * mean:.1f}" if se != se else f"{100 * mean:.1f} ± {100 * se:.1f}"


def table_rows(study: str, summary: dict) -> list[dict]:
    """One row per method: accuracies in %, mean ± SE over seeds; paired difference to KD."""
    diffs = {c["a"]: c for c in summary["comparisons"]}
    rows = []
    for r in summary["rows"]:
        name = report.method_title(r["method"])
        if r["method"] == summary["selected"]:
            name += " (selected on val)"
        c = diffs.get(r["method"])
        vs_kd = "—"
        if c is not None and c["se"] == c["se"]:
            vs_kd = f"{100 * c['diff']:+.1f} ± {100 * c['se']:.1f} ({c['diff_over_se']:+.1f} SE)"
        rows.append(
            {
                "study": study,
                "method": name,
                "seeds": r["seeds"],
                "val_full": _cell(r["validation/accuracy/full"]),
                "test_full": _cell(r["test/accuracy/full"]),
                "test_text": _cell(r["test/accuracy/text"]),
                "test_image": _cell(r["test/accuracy/image"]),
                "vs_kd": vs_kd,
            }
        )
    return rows


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, the main study only")
    parser.add_argument("--seeds", type=int, default=0, help="seeds 0..N-1 (0: the config's)")
    parser.add_argument("--root", default=os.path.join(REPO, "runs", "msd_results"))
    args = parser.parse_args(argv)
    studies = {"main": STUDIES["main"]} if args.smoke else STUDIES
    extra = list(SMOKE_PARAMS) if args.smoke else []
    if args.seeds:
        extra.append(f"StudyConfig.seeds = {tuple(range(args.seeds))}")
    started = time.perf_counter()
    outputs = {
        name: run_study(os.path.join(args.root, name), params + extra)
        for name, params in studies.items()
    }
    wall_s = time.perf_counter() - started
    summaries = {name: out["summary"] for name, out in outputs.items()}
    rows = [row for name, s in summaries.items() for row in table_rows(name, s)]
    suffix = "_smoke" if args.smoke else ""
    name = f"msd_results{suffix}"
    note = f"`{command()}` on {machine()}, {wall_s / 60:.1f} min"
    table = write_results(name, rows, COLUMNS, note)
    regime_rows = [
        {"study": study} | row for study, s in summaries.items() for row in report.regime_rows(s)
    ]
    regimes = write_results(
        f"msd_results_regimes{suffix}",
        regime_rows,
        REGIME_COLUMNS,
        f"test full-input accuracy (%) within each regime, mean ± SE over seeds; {note}",
    )
    teachers = {
        study: json.loads(open(os.path.join(args.root, study, "teacher", "eval.json")).read())
        for study in summaries
    }
    lines = [f"- {study}: {report.verdict_line(s)}" for study, s in summaries.items()]
    lines += [f"- {study} teacher: {report.teacher_line(t)}" for study, t in teachers.items()]
    with open(os.path.join(RESULTS_DIR, f"{name}.md"), "a") as f:
        f.write("\n" + "\n".join(lines) + "\n")
    plot = report.write_plot(summaries, os.path.join(RESULTS_DIR, f"{name}.png"))
    print(table + "\n\n" + "\n".join(lines) + "\n\n" + regimes)
    print(f"plot: {plot}\nwall time: {wall_s:.0f} s")
    verdicts = {study: report.verdict(s) for study, s in summaries.items()}
    return {
        "rows": rows, "regime_rows": regime_rows, "verdicts": verdicts, "wall_s": wall_s,
        "plot": plot,
    }  # fmt: skip


if __name__ == "__main__":
    main()

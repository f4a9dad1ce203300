"""launch.msd end to end on a tiny DigitsCaption config (the CI smoke test of
configs/msd/digits_caption.gin), the bench table built from it, and exact resume of a student
killed by the fault hook."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import gin
import jax
import numpy as np
import pytest

from bench import msd_results
from jaxrl.infra.checkpoint import Checkpointer
from jaxrl.infra.config import parse_gin, resolve_bindings
from jaxrl.infra.launcher import launch
from jaxrl.infra.mesh import MeshConfig, make_mesh
from jaxrl.infra.metrics import read_metrics
from jaxrl.infra.run_io import CHECKPOINT_DIR, state_tree
from msd_jax import models, report
from msd_jax.data import make_splits
from msd_jax.study import make_method
from msd_jax.train import CompiledModel

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, "configs", "msd", "digits_caption.gin")
SMOKE = msd_results.SMOKE_PARAMS
METHODS = ("kd", "kd_aug", "msd/instance", "msd/learned")


def _flags(workdir, params):
    flags = ["--gin_file", CONFIG, "--workdir", str(workdir)]
    for p in params:
        flags += ["--gin_param", p]
    return flags


def _launch(workdir, params):
    from launch.msd import msd_main

    try:
        return launch(msd_main, _flags(workdir, params))
    finally:
        gin.clear_config()


def _run(workdir, params, cache_dir, fault=None):
    """`python -m launch.msd` in a subprocess (optionally with a JAXRL_FAULT)."""
    env = {k: v for k, v in os.environ.items() if k != "JAXRL_FAULT"}
    env["PYTHONPATH"] = REPO
    # The smoke study and the resume runs compile the same programs: share them through JAX's
    # disk cache (a cached executable is the same machine code, so results are unchanged).
    env["JAX_COMPILATION_CACHE_DIR"] = str(cache_dir)
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    if fault:
        env["JAXRL_FAULT"] = fault
    return subprocess.run(
        [sys.executable, "-m", "launch.msd", *_flags(workdir, params)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """The smoke study, run once as the real command: (workdir, results.json, stdout)."""
    root = tmp_path_factory.mktemp("msd")
    done = _run(root / "main", SMOKE, os.environ["JAXRL_TEST_XLA_CACHE"])
    assert done.returncode == 0, done.stderr[-3000:]
    return root / "main", json.loads((root / "main" / "results.json").read_text()), done.stdout


def test_launch_msd_smoke_writes_every_stage(smoke):
    workdir, result, stdout = smoke
    assert "| KD |" in stdout and "results:" in stdout and "plot:" in stdout
    assert (workdir / "config.gin").exists()
    with np.load(workdir / "teacher" / "logits.npz", allow_pickle=False) as cache:
        assert {k: cache[k].shape for k in cache.files} == {
            "train": (1079, 3, 10), "validation": (359, 3, 10), "test": (359, 3, 10)
        }  # fmt: skip
    teacher_eval = json.loads((workdir / "teacher" / "eval.json").read_text())
    assert {"accuracy/full", "accuracy/text", "accuracy/image"} <= set(teacher_eval["test"])
    with np.load(workdir / "folds" / "saliency.npz", allow_pickle=False) as folds:
        assert folds["saliency_nm"].shape == (1079, 2)
        assert set(np.unique(folds["fold_n"]).tolist()) == {0, 1}
        assert np.all((folds["saliency_nm"] >= 0) & (folds["saliency_nm"] <= 1))  # s3: a prob.
    assert sorted(p.name for p in (workdir / "folds").glob("fold_*")) == ["fold_0", "fold_1"]

    results = result["results"]
    assert [(r["method"], r["seed"]) for r in results] == [(m, s) for m in METHODS for s in (0, 1)]
    for r in results:
        run = workdir / "students" / r["method"].replace("/", "-") / f"seed_{r['seed']}"
        assert json.loads((run / "result.json").read_text()) == r
        assert sorted(p.name for p in (run / CHECKPOINT_DIR).iterdir()) == ["6"]
        records = read_metrics(run / "metrics.jsonl")
        assert [x["step"] for x in records] == [2, 4, 6]
        assert all(np.isfinite(x["loss/total"]) for x in records)
        if r["method"] != "kd":
            assert "loss/aux_kl/text" in records[-1] and "weights/mass" in records[-1]
        if r["method"] == "msd/learned":
            assert "meta/val_loss_lookahead" in records[-1]
        for split in ("validation", "test"):
            assert all(0.0 <= r[split][f"accuracy/{v}"] <= 1.0 for v in ("full", "text", "image"))
    summary = result["summary"]
    assert summary["selected"] in METHODS[2:]
    assert {c["a"] for c in summary["comparisons"]} == set(METHODS) - {"kd"}
    assert all(c["seeds"] == 2 for c in summary["comparisons"])
    markdown = (workdir / "results.md").read_text()
    for title in ("| KD |", "| KD-aug |", "MSD, instance", "MSD, learned", "(selected on val)"):
        assert title in markdown, title
    assert "paired standard errors" in markdown
    assert "within each regime" in markdown
    assert "| method | both | image only | text only | conflicting |" in markdown
    regimes = ("both", "image_only", "text_only", "conflicting")
    assert all(set(r["test"]) >= {f"by_regime/{g}" for g in regimes} for r in results)
    assert (workdir / "results.png").stat().st_size > 10_000
    assert result["verdict"]["a"] == summary["selected"]


def test_rerun_reads_back_finished_stages(smoke, capsys):
    workdir, result, _ = smoke
    mtimes = {p: p.stat().st_mtime_ns for p in workdir.rglob("metrics.jsonl")}
    again = _launch(workdir, SMOKE)
    assert again["results"] == result["results"]
    assert {p: p.stat().st_mtime_ns for p in workdir.rglob("metrics.jsonl")} == mtimes
    assert "cached logits" in capsys.readouterr().out


def test_bench_table_from_the_smoke_study(smoke, tmp_path, monkeypatch, capsys):
    import bench.common

    workdir, _, _ = smoke
    monkeypatch.setattr(bench.common, "RESULTS_DIR", str(tmp_path))
    monkeypatch.setattr(msd_results, "RESULTS_DIR", str(tmp_path))
    out = msd_results.main(["--smoke", "--root", str(workdir.parent)])  # finished: reads back
    assert [row["method"].split(" (")[0] for row in out["rows"]] == [
        "KD", "KD-aug", "MSD, instance", "MSD, learned"
    ]  # fmt: skip
    assert out["verdicts"]["main"]["seeds"] == 2
    table = (tmp_path / "msd_results_smoke.md").read_text()
    assert "| main | KD |" in table and "main: MSD" in table and "main teacher:" in table
    assert json.loads((tmp_path / "msd_results_smoke.json").read_text())["rows"] == out["rows"]
    assert (tmp_path / "msd_results_smoke.png").exists()
    regimes = json.loads((tmp_path / "msd_results_regimes_smoke.json").read_text())
    assert regimes["rows"] == out["regime_rows"]
    assert [(r["study"], r["method"]) for r in regimes["rows"]] == [
        ("main", m) for m in ("KD", "KD-aug", "MSD, instance", "MSD, learned")
    ]  # fmt: skip
    assert all(" ± " in r[g] for r in regimes["rows"] for g in ("both", "conflicting"))
    regime_md = (tmp_path / "msd_results_regimes_smoke.md").read_text()
    assert "| study | method | both | image only | text only | conflicting |" in regime_md


def test_config_errors_name_the_problem(tmp_path):
    from launch.msd import msd_main

    with pytest.raises(SystemExit, match="unknown; choose from"):
        launch(msd_main, _flags(tmp_path / "a", ["StudyConfig.methods = ('kd', 'msd/magic')"]))
    gin.clear_config()
    with pytest.raises(SystemExit, match="regime_mix"):
        launch(msd_main, _flags(tmp_path / "b", ["DigitsCaptionConfig.regime_mix = (1, 1, 0, 0)"]))
    gin.clear_config()


def test_report_statistics_and_selection():
    """Means, standard errors and paired differences against a hand computation; the MSD
    weighting is chosen by validation accuracy even where another has better test accuracy."""

    def result(method, seed, val, test):
        views = ("full", "text", "image")
        return {"method": method, "seed": seed, "validation": {"accuracy/full": val},
                "test": {f"accuracy/{v}": test for v in views}}  # fmt: skip

    kd = [0.80, 0.82, 0.81]
    results = [result("kd", s, 0.8, x) for s, x in enumerate(kd)]
    results += [result("msd/uniform", s, 0.90, x) for s, x in enumerate([0.85, 0.86, 0.88])]
    results += [result("msd/learned", s, 0.80, 0.99) for s in (1, 2, 3)]  # seed 3: no KD pair
    summary = report.summarize(results)
    assert summary["selected"] == "msd/uniform"
    row = summary["rows"][1]
    assert row["test/accuracy/full"][0] == pytest.approx(0.8633333333)
    assert row["test/accuracy/full"][1] == pytest.approx(
        np.std([0.85, 0.86, 0.88], ddof=1) / 3**0.5
    )
    uniform, learned = summary["comparisons"]
    diffs = [0.05, 0.04, 0.07]
    assert uniform["diff"] == pytest.approx(np.mean(diffs))
    assert uniform["se"] == pytest.approx(np.std(diffs, ddof=1) / 3**0.5)
    assert uniform["diff_over_se"] == pytest.approx(uniform["diff"] / uniform["se"])
    assert learned["seeds"] == 2 and learned["diff"] == pytest.approx(0.99 - 0.815)
    verdict = report.verdict(summary)
    assert verdict["a"] == "msd/uniform" and verdict["beats"]
    assert "beats KD" in report.verdict_line(summary)
    table = report.markdown_table(summary)
    row = "| MSD, uniform (selected on val) | 3 | 90.0 ± 0.0 |" + " 86.3 ± 0.9 |" * 3
    assert row + " +5.3 ± 0.9 (+6.0 SE) |" in table
    assert "| KD | 3 | 80.0 ± 0.0 |" + " 81.0 ± 0.6 |" * 3 + " — |" in table


# Exact resume ---------------------------------------------------------------------------------

# The smoke study's msd/learned students alone (the same training), saving every 2 steps.
RESUME = SMOKE + [
    "StudyConfig.methods = ('msd/learned',)",
    "StudyConfig.seeds = (0,)",
    "student/TrainConfig.save_every_steps = 2",
    "student/TrainConfig.keep_last_n = 2",
]


def _state_bytes(run_dir, step=None) -> dict[str, bytes]:
    """Every array of a student checkpoint (params, Adam moments, learned weights + their Adam
    state) as bytes, restored onto the test mesh."""
    from launch.msd import msd_main  # registers the msd configurables before parsing

    parse_gin([CONFIG], RESUME)
    try:
        kwargs = resolve_bindings(msd_main)
    finally:
        gin.clear_config()
    config = kwargs["study"]
    mesh = make_mesh(MeshConfig(("data",), (-1,)))
    train = make_splits(kwargs["data"])["train"]
    model = CompiledModel(config.model.model_config(train), mesh, models.DATA_PARALLEL_RULES)
    _, scheme = make_method("msd/learned", config, None)
    target = state_tree(model.abstract_state(config.train.optimizer(), scheme))
    with Checkpointer(run_dir / CHECKPOINT_DIR, read_only=True) as ckpt:
        restored = ckpt.restore(step, abstract_target=target)
    leaves = jax.tree_util.tree_flatten_with_path(restored.state)[0]
    return {jax.tree_util.keystr(p): np.asarray(x).tobytes() for p, x in leaves}


def test_killed_student_resumes_bitwise_equal(smoke, tmp_path):
    """Killed inside the save of step 4 (its temporary directory exists, never committed; step 2
    is saved), the same command, rerun, resumes from step 2; stopped there by SIGTERM after step
    4, it saves step 5 and exits 0; rerun again, it resumes from step 5 and ends with the state
    of the smoke study's uninterrupted msd/learned student."""
    reference = smoke[0] / "students" / "msd-learned" / "seed_0"
    workdir, cache = tmp_path / "run", os.environ["JAXRL_TEST_XLA_CACHE"]
    run = workdir / "students" / "msd-learned" / "seed_0"
    killed = _run(workdir, RESUME, cache, "kill_in_save=4")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert (workdir / "teacher" / "logits.npz").exists()  # the teacher (2 steps) finished
    assert (run / CHECKPOINT_DIR / "4.orbax-checkpoint-tmp").exists()
    assert sorted(p.name for p in (run / CHECKPOINT_DIR).glob("[0-9]")) == ["2"]
    # SIGTERM after step 4: the student saves step 5 (off the save interval) and exits 0.
    stopped = _run(workdir, RESUME, cache, "sigterm_at_step=4")
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert "cached logits" in stopped.stdout  # the teacher was not trained again
    assert "from step 2" in stopped.stdout  # the half-written step 4 was not restored
    assert "stopped by SIGTERM after step 5" in stopped.stdout
    assert sorted(p.name for p in (run / CHECKPOINT_DIR).glob("[0-9]")) == ["4", "5"]
    resumed = _run(workdir, RESUME, cache)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "from step 5" in resumed.stdout

    final = _state_bytes(run)
    assert final == _state_bytes(reference)
    assert any("weighting" in name for name in final)
    assert final != _state_bytes(run, step=5)  # training moved the state
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [2, 4, 6]
    result = json.loads((run / "result.json").read_text())
    assert result == json.loads((reference / "result.json").read_text()) | {
        "train_s": result["train_s"]
    }

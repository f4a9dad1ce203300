"""`python -m bench`: the one benchmark runner over the workloads of bench/registry.py (and the
learning experiments of bench/learning/): each listed, each importable with a `main`, unknown
names refused with the close matches, and one cheap workload run end to end through it into a
temporary results directory, its result carrying the schema's fields."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

from bench import learning, registry

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bench", *args],
        cwd=REPO,
        env=dict(os.environ, **(env or {})),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_list_names_every_workload_with_what_it_measures():
    out = _bench("--list")
    assert out.returncode == 0, out.stderr
    for workload in registry.WORKLOADS:
        (line,) = [x for x in out.stdout.splitlines() if x.split()[:1] == [workload.name]]
        assert workload.measures in line
    assert len(registry.BY_NAME) == len(registry.WORKLOADS)  # no name twice


def test_learning_lists_its_experiments():
    out = _bench("learning", "--list")
    assert out.returncode == 0, out.stderr
    for name in learning.EXPERIMENTS:
        assert f"  {name} " in out.stdout


def test_every_registered_module_runs_as_a_module_command():
    """`python -m bench.MODULE` runs each workload (`bench compare` runs a baseline tree's
    workloads that way: an older tree may predate `python -m bench NAME`)."""
    for workload in registry.WORKLOADS:
        path = os.path.join(REPO, *workload.module.split("."))
        path = os.path.join(path, "__main__.py") if os.path.isdir(path) else path + ".py"
        assert os.path.exists(path), workload.module
        with open(path) as f:
            assert 'if __name__ == "__main__":' in f.read(), workload.module


def test_every_registered_module_imports_and_has_its_entry_point():
    """All imported (none run) in one fresh process: some set XLA flags at import."""
    modules = {w.module: ("main",) for w in registry.WORKLOADS}
    for experiment in learning.EXPERIMENTS.values():  # declares its runs; runs by `run`
        modules[experiment.module] = ("CONFIG", "RUNS", "RESULTS", "add_options", "run")
    code = (
        "import importlib, json, sys\n"
        "bad = []\n"
        f"for module, names in {modules!r}.items():\n"
        "    m = importlib.import_module(module)\n"
        "    bad += [f'{module}.{n}' for n in names if not hasattr(m, n)]\n"
        "    bad += [] if callable(getattr(m, names[-1], None)) else [module]\n"
        "print(json.dumps(bad))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=180
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.splitlines()[-1]) == []


def test_the_runner_imports_no_jax_before_the_workload():
    code = "import sys, bench.__main__, bench.registry, bench.learning; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr


def test_an_unknown_workload_fails_naming_the_close_matches():
    out = _bench("synk")
    assert out.returncode != 0
    assert "unknown workload 'synk'" in out.stderr and "sync" in out.stderr
    assert "--list" in out.stderr
    out = _bench("learning", "rl-snyc")
    assert out.returncode != 0
    assert "rl-sync" in out.stderr and "--list" in out.stderr


def test_a_workload_help_is_its_own():
    out = _bench("learning", "rl-streaming", "--help")
    assert out.returncode == 0, out.stderr
    assert "python -m bench learning rl-streaming" in out.stdout and "--sft_dir" in out.stdout


def test_a_smoke_run_through_the_runner_writes_the_result_schema(tmp_path):
    """`python -m bench sync --smoke` (~10 s) into a temporary results directory."""
    out = _bench("sync", "--smoke", env={"JAXRL_BENCH_RESULTS_DIR": str(tmp_path)}, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((tmp_path / "sync_smoke.json").read_text())
    assert {"schema", "command", "tree", "machine", "date", "note", "columns", "rows"} <= set(
        result
    )
    assert result["command"] == "python -m bench sync --smoke"
    assert result["rows"] and all(row["command"] == result["command"] for row in result["rows"])
    assert (tmp_path / "sync_smoke.md").exists()
    assert importlib.import_module("bench.common").SCHEMA == result["schema"]


def test_the_streaming_recipe_table_is_read_from_the_committed_runs(tmp_path):
    """`python -m bench learning rl-streaming --recipe_table`: one row per recipe run, its
    figures from the committed bench/results/rl_streaming_learning_*.json; the result is
    written into a temporary results directory, nothing launched."""
    env = {"JAXRL_BENCH_RESULTS_DIR": str(tmp_path)}
    args = ("learning", "rl-streaming", "--recipe_table", "--workdir", str(tmp_path / "w"))
    out = _bench(*args, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((tmp_path / "rl_streaming_recipe.json").read_text())
    assert result["command"] == "python -m bench " + " ".join(args)
    rows = {row["file"].split(",")[0]: row for row in result["rows"]}
    assert len(rows) == 8
    aipo = rows["`_aipo`"]
    assert (aipo["steps"], aipo["fixed_lag"], aipo["streaming"]) == (
        300,
        "39.7% (-8.3)",
        "27.3% (-20.7)",
    )
    assert aipo["no_correction"] == "25.5% (-22.5)" and aipo["no_correction_steps"] == 300
    # a run stopped early: its steps in the cell
    assert rows["`_pilot_partial_reward`"]["streaming"] == "49.1% (+1.0), 291 steps"
    assert rows["`_pilot_lr3e-4`"]["streaming"] == "-"
    # the 2000-step runs (restored from history), their control from the 1500-step summary
    last = rows["`_2026-12-02_0726`"]
    assert last["steps"] == 2000 and last["fixed_lag"] == "73.6% (+25.5)"
    assert last["no_correction"] == "27.0% (-21.1), 1500 steps" and "`_1500`" in last["file"]


def test_the_scale_validation_tables_are_composed_from_the_committed_runs(tmp_path):
    """`python -m bench scale-validate --summarize`: the per-row table of the latest run and
    every run's ratios, from the committed bench/results/scale_validate*.json, written into a
    temporary results directory; nothing run."""
    out = _bench("scale-validate", "--summarize", env={"JAXRL_BENCH_RESULTS_DIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "scale_validate_summary.json").read_text())
    assert summary["command"] == "python -m bench scale-validate --summarize"
    rows = {row["row"]: row for row in summary["rows"]}
    sync = rows["proxy sync, 1 core"]
    assert sync["generate"] == "0.174 + 0.007 = 0.180 / 0.172 (1.05)"
    assert (sync["host_ms"], sync["verdict"]) == ("6.7 / 9.5", "yes, all 5")
    turns = rows["8 devices, async (4 + 4)"]
    assert turns["generate"] == "0.262 + 0.013 + Tt + Ts = 0.611 / 0.673 (0.91)"
    assert turns["generate_cpu"] == turns["host_ms"] == "-" and turns["verdict"] == "yes, all 3"
    runs = json.loads((tmp_path / "scale_validate_runs.json").read_text())["rows"]
    first = [row for row in runs if row["run_number"] == 1]
    assert first[0]["run"] == "1 (03:20-03:30, 8.4 -> 7.7)"
    assert first[0]["source"] == "`scale_validate_a`" and "source" not in first[1]
    # run 1's async 8-device row, from before the turns term, recomputed with it (bold: > 30%)
    assert first[2]["row"] == "8 devices sync / fixed lag"
    assert first[2]["wall"] == "0.93 / 0.80 / 0.84; **1.31** / 1.08 / **1.36**"
    assert first[2]["cpu"] == "0.93 / 0.84; -"
    # the doc's count: 4 of the 100 comparisons of runs 1-5 outside 30%, none of run 6's 11
    heads = {row["run_number"]: row for row in runs if "comparisons" in row}
    assert sum(heads[n]["comparisons"] for n in range(1, 6)) == 100
    assert sum(heads[n]["outside_30"] for n in range(1, 6)) == 4
    assert (heads[6]["comparisons"], heads[6]["outside_30"]) == (11, 0)
    assert heads[6]["run"].endswith("; 8 devices only)")

"""`python -m bench compare`: a workload run in this tree and in a baseline commit's git
worktree, alternating, each row's figures and their ratio in one result file. End to end on
`scale-llamarl` (a hand count, seconds, no JAX program run) against HEAD; the errors and the
row arithmetic on synthetic results, nothing launched."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bench import compare

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _compare(*args: str, tmp) -> subprocess.CompletedProcess:
    """`python -m bench compare ARGS` with its temporary files (the worktree) under `tmp`."""
    tmp.mkdir(exist_ok=True)
    return subprocess.run(
        [sys.executable, "-m", "bench", "compare", *args],
        cwd=REPO,
        env=dict(os.environ, TMPDIR=str(tmp)),
        capture_output=True,
        text=True,
        timeout=180,
    )


def _worktrees() -> str:
    out = subprocess.run(
        ["git", "-C", REPO, "worktree", "list", "--porcelain"], capture_output=True
    )
    return out.stdout.decode()


def _assert_removed(tmp) -> None:
    assert str(tmp) not in _worktrees()
    assert not list(tmp.glob("bench_compare_*")), list(tmp.iterdir())


def test_head_against_itself_gives_every_row_ratio_one(tmp_path):
    args = ["--baseline", "HEAD", "--rounds", "1", "--key", "model"]
    args += ["--value", "speedup", "paper_speedup", "--", "scale-llamarl"]
    out = _compare(*args, tmp=tmp_path / "tmp")
    assert out.returncode == 0, out.stderr[-3000:]
    _assert_removed(tmp_path / "tmp")
    path = os.path.join(os.environ["JAXRL_BENCH_RESULTS_DIR"], "compare_scale_llamarl.json")
    with open(path) as f:
        result = json.load(f)
    assert result["command"] == "python -m bench compare " + " ".join(args)
    head = subprocess.run(
        ["git", "-C", REPO, "rev-parse", "--short=7", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    assert f"in `{head}` (HEAD, a git worktree)" in result["note"]
    assert "`python -m bench.scale_llamarl` (result scale_llamarl)" in result["note"]
    assert "1 round(s)" in result["note"] and "load average" in result["note"]
    assert [h for _, h in result["columns"]] == [
        "model",
        "figure",
        "this tree",
        f"`{head}`",
        "ratio",
    ]
    rows = {(r["row"], r["figure"]): r for r in result["rows"]}
    assert set(rows) == {
        (model, figure)
        for model in ("8B", "70B", "405B")
        for figure in ("predicted speed-up", "paper")
    }
    assert rows["8B", "paper"]["this_tree"] == rows["8B", "paper"]["baseline"] == "2.52x"
    for row in rows.values():  # a hand count: the same figures in both trees
        assert (
            row["this_tree_values"] == row["baseline_values"] and len(row["baseline_values"]) == 1
        )
        assert row["ratio"] == 1.0 and row["ratio_shown"] == "1.000"


def test_a_failing_run_names_its_exit_code_and_last_output(tmp_path):
    args = ["--baseline", "HEAD", "--key", "model", "--value", "speedup"]
    out = _compare(*args, "--", "scale-llamarl", "--compiled", "--platform=nope", tmp=tmp_path)
    assert out.returncode != 0
    assert "the run (baseline " in out.stderr and "failed with exit code 1" in out.stderr
    assert "--platform=nope: use one of" in out.stderr  # the run's own last words
    _assert_removed(tmp_path)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--baseline", "HEAD", "--key", "a", "--value", "b", "--", "synk"], "did you mean sync"),
        (
            ["--baseline", "no-such-rev-0xq", "--key", "a", "--value", "b", "--", "gen"],
            "git cannot resolve the baseline 'no-such-rev-0xq'",
        ),
        (["--baseline", "HEAD", "--key", "a", "--value", "b", "gen"], "after `--`"),
        (["--baseline", "HEAD", "--key", "a", "--value", "b", "--", "compare"], "itself"),
        (
            ["--baseline", "HEAD", "--key", "a", "--value", "b", "--rounds", "0", "--", "gen"],
            "1 or more",
        ),
    ],
)
def test_wrong_commands_are_refused_before_anything_runs(argv, message):
    with pytest.raises(SystemExit, match=message):
        compare.main(argv)


def _result(*rows: dict, file: str = "gen") -> dict:
    return {"rows": list(rows), "columns": [["tok_s", "tok/s"]], "file": file}


def test_a_missing_or_ambiguous_column_names_the_columns_the_result_has():
    data = _result({"model": "tiny", "system": "engine", "tok_s": 5.0})
    with pytest.raises(SystemExit, match=r"no column 'setting' for --key; its columns: model, "):
        compare.keyed_rows(data, ["setting"], ["tok_s"], "the baseline")
    with pytest.raises(SystemExit, match=r"no column 'step_s' for --value.*system, tok_s"):
        compare.keyed_rows(data, ["model"], ["step_s"], "the baseline")
    two = _result({"model": "tiny", "system": "engine"}, {"model": "tiny", "system": "static"})
    with pytest.raises(
        SystemExit,
        match="two rows of this tree's result are named 'tiny' by --key model; add a col",
    ):
        compare.keyed_rows(two, ["model"], ["system"], "this tree")
    assert set(compare.keyed_rows(two, ["model", "system"], ["system"], "x")) == {
        "tiny, engine",
        "tiny, static",
    }


def test_rows_hold_each_rounds_figures_and_the_ratio_of_the_means():
    runs = {
        "baseline": [
            _result({"model": "tiny", "tok_s": 7331.0}, {"model": "old", "tok_s": 1.0}),
            _result({"model": "tiny", "tok_s": "7,101"}, {"model": "old", "tok_s": 1.0}),
        ],
        "this": [
            _result({"model": "tiny", "tok_s": 7261}),
            _result({"model": "tiny", "tok_s": 7200}),
        ],
    }
    rows, headers = compare.compare_rows(runs, ["model"], ["tok_s"])
    assert headers == {"tok_s": "tok/s"}
    tiny, old = rows
    assert (tiny["row"], tiny["this_tree"], tiny["baseline"]) == (
        "tiny",
        "7,261, 7,200",
        "7,331, 7,101",
    )
    assert (
        tiny["ratio"] == round((7261 + 7200) / (7331 + 7101), 4) and tiny["ratio_shown"] == "1.002"
    )
    assert (old["row"], old["this_tree"], old["ratio"]) == ("old", "-", "-")  # baseline only
    assert compare.figure("2.52x", "") == 2.52 and compare.figure(" 22.4 s", "") == 22.4
    assert compare.figure("48.6%", "") == 48.6 and compare.figure(3, "") == 3.0
    with pytest.raises(SystemExit, match="'15.60 \\+ 4.91 = 20.55 s', not a number"):
        compare.figure("15.60 + 4.91 = 20.55 s", "row '8B'")


def test_the_result_read_back_is_the_file_the_run_wrote(tmp_path):
    """This tree's runs write into their own results directory; an older tree's into its
    bench/results/, where only files new or rewritten by the run count."""
    run_dir, tree_results = tmp_path / "run", tmp_path / "tree"
    run_dir.mkdir()
    tree_results.mkdir()
    (tree_results / "gen.json").write_text("{}")  # committed, not rewritten by the run
    before = compare._json_stamps(str(tree_results))
    assert compare.written_result(str(run_dir), str(tree_results), before, "") is None
    (tree_results / "gen_long_tail.json").write_text("{}")
    found = compare.written_result(str(run_dir), str(tree_results), before, "")
    assert found == str(tree_results / "gen_long_tail.json")
    assert compare.written_result(str(run_dir), str(tree_results), before, "gen") is None
    for name in ("a", "b"):
        (run_dir / f"{name}.json").write_text("{}")
    os.utime(run_dir / "a.json", ns=(0, 0))
    assert compare.written_result(str(run_dir), str(tree_results), before, "") == str(
        run_dir / "b.json"
    )
    assert compare.written_result(str(run_dir), str(tree_results), before, "a") == str(
        run_dir / "a.json"
    )

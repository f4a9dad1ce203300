"""`python -m bench.report`: the docs' benchmark tables equal what their result files give, every
table of a benchmark doc is generated or marked, and bad markers fail with their line and fix."""

from __future__ import annotations

import glob
import json
import os

import pytest

from bench import report

DOCS = report.default_docs()


def _write(tmp_path, text: str) -> str:
    path = os.path.join(tmp_path, "doc.md")
    with open(path, "w") as f:
        f.write(text)
    return path


@pytest.mark.parametrize("doc", DOCS, ids=os.path.basename)
def test_docs_tables_equal_what_the_report_writes(doc):
    counts, problems = report.report(doc)
    assert problems == [], "\n".join(problems)
    if os.path.relpath(doc, report.ROOT) in report.BENCHMARK_DOCS:
        assert counts["blocks"] > 0  # records are allowed, none is needed (docs/scale.md)


def test_every_table_of_a_benchmark_doc_is_generated_or_marked():
    for doc in DOCS:
        with open(doc) as f:
            lines = f.read().split("\n")
        blocks, markers = report.parse(doc, lines)
        if blocks or markers or os.path.relpath(doc, report.ROOT) in report.BENCHMARK_DOCS:
            assert report.unmarked(doc, lines, blocks, markers) == []


def test_a_changed_cell_fails_the_check_and_names_the_block(tmp_path):
    with open(os.path.join(report.ROOT, "docs", "benchmarks.md")) as f:
        lines = f.read().split("\n")
    block = report.parse("docs/benchmarks.md", lines)[0][0]
    row = next(
        i
        for i in range(block.start, block.end)
        if lines[i].startswith("| ") and i > block.start + 3
    )
    cells = lines[row].split("|")
    cells[2] = " 12345 "
    lines[row] = "|".join(cells)
    doc = _write(tmp_path, "\n".join(lines))
    _, problems = report.report(doc)
    assert len(problems) == 1
    assert f"{doc}:{block.line}:" in problems[0] and block.result in problems[0]
    assert "differs" in problems[0]
    # without --check the report writes the file's figures back
    assert report.report(doc, write=True)[1] == []
    assert report.report(doc)[1] == []
    with open(doc) as f:
        assert "12345" not in f.read()


def test_a_hand_pasted_table_fails(tmp_path):
    with open(os.path.join(report.ROOT, "docs", "peers.md")) as f:
        text = f.read()
    doc = _write(tmp_path, text + "\nNew figures:\n\n| side | s |\n|---|---|\n| a | 1.0 |\n")
    _, problems = report.report(doc)
    assert len(problems) == 1 and "neither generated nor marked" in problems[0]
    lines = text.count("\n") + 4
    assert problems[0].startswith(f"{doc}:{lines}:")


MARKER = "<!-- bench.report: {result}\ncolumns: {columns} -->\n\n<!-- /bench.report -->\n"


@pytest.mark.parametrize(
    "result, columns, message",
    [
        ("bench/results/no_such_result.json", "setting", "does not exist"),
        ("bench/results/rl.json", "setting | no_such_key=x", "unknown column 'no_such_key'"),
    ],
)
def test_a_bad_marker_fails_with_its_line_and_fix(tmp_path, result, columns, message):
    doc = _write(tmp_path, "# t\n\n" + MARKER.format(result=result, columns=columns))
    _, problems = report.report(doc)
    assert len(problems) == 1
    assert problems[0].startswith(f"{doc}:3:") and message in problems[0] and "fix:" in problems[0]


RL = "<!-- bench.report: bench/results/rl.json"
END = "<!-- /bench.report -->\n"


@pytest.mark.parametrize(
    "text, message",
    [
        (RL + " -->\n| a |\n|---|\n", "has no <!-- /bench.report -->"),
        ("<!-- bench.report: rl -->\n" + END, "is not a result file"),
        ("<!-- bench.report: record; by hand -->\n| a |\n|---|\n", "without a date"),
        (RL + "\nsort: mode -->\n" + END, "unknown marker line"),
        (RL + "\ncolumns: mode\nrows: nokey=x -->\n" + END, "row filter"),
        (RL + " -->\n" + END, "names no columns"),
    ],
)
def test_malformed_markers(tmp_path, text, message):
    doc = _write(tmp_path, "# t\n\n" + text)
    _, problems = report.report(doc)
    assert problems and problems[0].startswith(f"{doc}:3:") and message in problems[0]


def test_main_check_exits_1_and_lists_the_block(tmp_path, capsys):
    doc = _write(
        tmp_path, "# t\n\n" + MARKER.format(result="bench/results/rl.json", columns="mode")
    )
    assert report.main(["--check", doc]) == 1
    out = capsys.readouterr().out
    assert f"{doc}:3: the table of bench/results/rl.json differs" in out
    assert "1 generated tables" in out
    assert report.main([doc]) == 0 and report.main(["--check", doc]) == 0


def test_a_result_of_the_current_schema_brings_its_own_columns_and_command(tmp_path):
    os.makedirs(tmp_path / "bench" / "results")
    result = {
        "schema": 1,
        "command": "python -m bench x --steps 3",
        "tree": {"commit": "abc123def456", "dirty": True},
        "machine": {"devices": "8x cpu", "cpu": "Xeon", "cpus": 2},
        "date": "2026-12-06 22:00 UTC",
        "note": "n",
        "columns": [["mode", "mode"], ["step_s", "s/step"]],
        "rows": [{"mode": "sync", "step_s": 0.5}, {"mode": "async", "step_s": 1234.5}],
    }
    with open(tmp_path / "bench" / "results" / "x.json", "w") as f:
        json.dump(result, f)
    doc = _write(
        tmp_path, "# t\n\n<!-- bench.report: bench/results/x.json\nrows: mode=async -->\n" + END
    )
    assert report.report(doc, root=str(tmp_path), write=True)[1] == []
    with open(doc) as f:
        text = f.read()
    assert "`python -m bench x --steps 3`, 2026-12-06 22:00 UTC, commit abc123def456" in text
    assert "(uncommitted changes), on 8x cpu (Xeon, 2 cpus)" in text
    assert "| mode | s/step |\n|---|---|\n| async | 1,234 |\n" in text
    assert report.report(doc, root=str(tmp_path)) == (
        {"blocks": 1, "records": 0, "references": 0, "tables": 1, "rewritten": 0},
        [],
    )


def test_a_block_of_several_files_joins_their_rows_each_tagged_by_its_file(tmp_path):
    os.makedirs(tmp_path / "bench" / "results")
    for name, date, mode, step_s in (
        ("x_32", "2026-12-03 20:33", "a", 0.5),
        ("x_64", "d2", "b", 2),
    ):
        result = {
            "date": date,
            "note": f"`python -m bench.x --n {name[2:]}`; load 1",
            "rows": [{"mode": mode, "step_s": step_s}, {"mode": "sync", "step_s": 1.0}],
        }
        with open(tmp_path / "bench" / "results" / f"{name}.json", "w") as f:
            json.dump(result, f)
    doc = _write(
        tmp_path,
        "# t\n\n<!-- bench.report: bench/results/x_32.json  bench/results/x_64.json\n"
        "columns: file=run | mode | step_s=s/step\nrows: mode=a | b -->\n" + END,
    )
    assert report.report(doc, root=str(tmp_path), write=True)[1] == []
    with open(doc) as f:
        text = f.read()
    assert (
        "from `bench/results/x_32.json`: `python -m bench.x --n 32`, 2026-12-03 20:33; and "
        "`bench/results/x_64.json`: `python -m bench.x --n 64`, d2.*" in text
    )
    assert "| run | mode | s/step |\n|---|---|---|\n| x_32 | a | 0.5 |\n| x_64 | b | 2 |\n" in text
    assert report.report(doc, root=str(tmp_path))[1] == []
    os.remove(tmp_path / "bench" / "results" / "x_64.json")
    problems = report.report(doc, root=str(tmp_path))[1]
    assert problems[0].startswith("doc.md:3: result file bench/results/x_64.json does not exist")


def test_a_transcribed_result_names_its_doc_and_a_changed_row_fails_the_check(
    tmp_path, monkeypatch
):
    from bench import common

    monkeypatch.setattr(common, "RESULTS_DIR", str(tmp_path / "bench" / "results"))
    table = common.write_archive(
        "archive_x",
        [{"side": "a", "step_s": "**1.0**", "vs": ""}, {"side": "b", "step_s": "2.50", "vs": "2"}],
        [["side", "side"], ["step_s", "RL step s", "right"], ["vs", "vs a"]],
        "what it measures. Rows transcribed from docs/x.md at abc1234",
        "python -m bench.x --n 3 ; python -m launch.rl --gin_file=C",
        {"commit": None, "note": "not recorded"},
        "2-core machine, load ~20",
        "2026-12-01 22:20-22:38 UTC",
        "docs/x.md",
    )
    rendered = "| side | RL step s | vs a |\n|---|---:|---|\n| a | **1.0** |  |\n| b | 2.50 | 2 |"
    assert table.endswith(rendered)  # the cells' text as given, the alignment kept
    with open(tmp_path / "bench" / "results" / "archive_x.json") as f:
        result = json.load(f)
    assert result["transcribed_from"] == "docs/x.md" and result["schema"] == common.SCHEMA
    doc = _write(tmp_path, "# t\n\n<!-- bench.report: bench/results/archive_x.json -->\n" + END)
    assert report.report(doc, root=str(tmp_path), write=True)[1] == []
    with open(doc) as f:
        text = f.read()
    assert (
        "from `bench/results/archive_x.json`: rows transcribed by hand from docs/x.md, where "
        "no result file held them; measured by "
        "`python -m bench.x --n 3 ; python -m launch.rl --gin_file=C`, 2026-12-01 22:20-22:38 "
        "UTC, commit not recorded; machine: 2-core machine, load ~20.*" in text
    )
    assert rendered + "\n" in text
    assert report.report(doc, root=str(tmp_path)) == (
        {"blocks": 1, "records": 0, "references": 0, "tables": 1, "rewritten": 0},
        [],
    )
    with open(doc, "w") as f:
        f.write(text.replace("| b | 2.50 |", "| b | 2.5 |"))
    problems = report.report(doc, root=str(tmp_path))[1]
    assert len(problems) == 1 and "archive_x.json differs" in problems[0]


def test_a_record_marker_still_marks_a_table(tmp_path):
    doc = _write(
        tmp_path,
        "# t\n\n<!-- bench.report: record; measured 2026-12-01 by `python -m bench.x`; by hand -->"
        "\n| a |\n|---|\n| 1 |\n",
    )
    assert report.report(doc) == (
        {"blocks": 0, "records": 1, "references": 0, "tables": 1, "rewritten": 0},
        [],
    )


def test_every_archive_file_names_its_source_and_is_a_block_of_that_doc():
    paths = sorted(glob.glob(os.path.join(report.ROOT, "bench", "results", "archive_*.json")))
    for path in paths:
        with open(path) as f:
            result = json.load(f)
        for key in ("schema", "command", "tree", "machine", "date", "note", "columns", "rows"):
            assert result.get(key) not in (None, ""), (path, key)
        doc = os.path.join(report.ROOT, result["transcribed_from"])
        with open(doc) as f:
            blocks = report.parse(doc, f.read().split("\n"))[0]
        name = os.path.relpath(path, report.ROOT)
        assert any(name in b.result.split(" ") for b in blocks), (name, doc)

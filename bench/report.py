"""`python -m bench.report [--check] [DOC ...]`: the docs' benchmark tables, rebuilt from results.

A generated table sits in a block of a doc (default: `docs/*.md` and `README.md`) between two
HTML comments. The opening one names a result file of `bench/results/` (or several, separated by
spaces: their rows in that order, each with the key `file`, its file's name without the folder
and `.json`), and optionally, one per line:

- `columns: key=Header | key | ...`: the columns (`key` alone: the key is the header); without
  it the (first) file's own `columns` (files of the current schema, `bench.common.SCHEMA`;
  `[key, header, "right"]` there right-aligns a column);
- `rows: key=value | value; key=value`: the rows whose cell under each `key` reads one of its
  values (as the table prints it), in the file's order;
- `command: ...`: the command that wrote the file(s), for files written before the schema
  (which hold no `command`; without it, the command at the head of each file's `note`).

    <!-- bench.report: bench/results/rl.json
    columns: setting | mode | step_s=s/step
    rows: mode=sync | async
    -->
    (generated: a line naming the file, its command, date and commit; then the table)
    <!-- /bench.report -->

The table is `bench.common.render_table`'s, the same text as the result's `NAME.md`. A file
written by `bench.common.write_archive` holds rows transcribed from a doc's table (runs whose own
result files were not kept): its key `transcribed_from` names the doc, and the generated line
says the rows were transcribed from it, then the command, date, commit and machine the doc gave
("commit not recorded" where it gave none).

Other tables of a benchmark doc carry a one-line marker right above them (blank lines between
are allowed), so that a reader, and the check, can tell generated tables from the rest:

- `<!-- bench.report: record; measured DATE by COMMAND; why no result file holds the rows -->`:
  figures no result file holds (measured by hand, or the file was overwritten since); the text
  must name a date (YYYY-MM-DD).
- `<!-- bench.report: not a measurement -->`: a reference table (configs, files, fault cases).

The benchmark docs are `BENCHMARK_DOCS` and every doc with a `bench.report` marker: in those,
a table outside a block and without a marker is an error. Without `--check` the blocks are
rewritten in place; with `--check` nothing is written and the exit status is 1 when a block
differs from what the report would write, or a marker or table is wrong (each named by file and
line, with the fix). `tests/test_bench_report.py` runs the check on the real docs.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARK_DOCS = ("docs/benchmarks.md", "docs/peers.md", "docs/scale.md")
OPEN = "<!-- bench.report:"
CLOSE = "<!-- /bench.report -->"
RECORD = "record;"
REFERENCE = "not a measurement"
DELIMITER_ROW = re.compile(r"^\|[-:| ]+\|\s*$")


class MarkerError(ValueError):
    """A marker the report cannot follow; the message names the doc, the line and the fix."""


@dataclasses.dataclass
class Block:
    doc: str  # the doc's path as given
    line: int  # 1-based line of the opening comment
    result: str  # path of the result file(s), relative to the repository root, space-separated
    options: dict  # "columns", "rows", "command": the marker's option lines
    start: int  # 0-based index of the first content line
    end: int  # 0-based index of the closing comment


def default_docs(root: str = ROOT) -> list[str]:
    docs = sorted(glob.glob(os.path.join(root, "docs", "*.md")))
    return docs + [os.path.join(root, "README.md")]


def _fail(doc: str, line: int, what: str, fix: str) -> MarkerError:
    return MarkerError(f"{doc}:{line}: {what}; fix: {fix}")


def parse(doc: str, lines: list[str]) -> tuple[list[Block], dict[int, str]]:
    """The doc's generated blocks, and {0-based line: "record" | "reference"} of its markers."""
    blocks, markers, i = [], {}, 0
    while i < len(lines):
        text = lines[i].strip()
        if text.startswith(CLOSE):
            raise _fail(
                doc,
                i + 1,
                "a closing bench.report comment without an opening one",
                "remove it, or open the block above it",
            )
        if not text.startswith(OPEN):
            i += 1
            continue
        head = text[len(OPEN) :].strip()
        if head.startswith(RECORD) or head.startswith(REFERENCE):
            kind = "record" if head.startswith(RECORD) else "reference"
            if not head.endswith("-->"):
                raise _fail(doc, i + 1, f"a {kind} marker must be one line", "end it with -->")
            if kind == "record" and not re.search(r"\d{4}-\d\d-\d\d", head):
                raise _fail(
                    doc,
                    i + 1,
                    "a record marker without a date",
                    "say when and by which command the rows were measured",
                )
            markers[i] = kind
            i += 1
            continue
        opening = i
        spec = [head]
        while not spec[-1].endswith("-->"):
            i += 1
            if i == len(lines) or lines[i].strip().startswith(OPEN):
                raise _fail(
                    doc,
                    opening + 1,
                    "a bench.report comment that does not end",
                    "close the marker with -->",
                )
            spec.append(lines[i].strip())
        spec[-1] = spec[-1][: -len("-->")].strip()
        result, options = " ".join(spec[0].split()), {}
        for path in result.split(" "):
            if not path.endswith(".json"):
                raise _fail(
                    doc,
                    opening + 1,
                    f"{path!r} is not a result file",
                    "name bench/results/NAME.json, or write `record; ...` for a record",
                )
        for option in filter(None, spec[1:]):
            key, _, value = option.partition(":")
            if key.strip() not in ("columns", "rows", "command") or not value.strip():
                raise _fail(
                    doc,
                    opening + 1,
                    f"unknown marker line {option!r}",
                    "write `columns: key=Header | ...`, `rows: key=value | ...` or `command: ...`",
                )
            options[key.strip()] = value.strip()
        end = i + 1
        while end < len(lines) and lines[end].strip() != CLOSE:
            if lines[end].strip().startswith(OPEN):
                end = len(lines)
                break
            end += 1
        if end == len(lines):
            raise _fail(
                doc,
                opening + 1,
                f"the block of {result} has no {CLOSE}",
                f"add {CLOSE} after its table",
            )
        blocks.append(Block(doc, opening + 1, result, options, i + 1, end))
        i = end + 1
    return blocks, markers


def _command(result: dict, options: dict) -> str:
    if options.get("command"):
        return options["command"]
    if result.get("command"):
        return result["command"]
    note = result.get("note", "")
    quoted = re.match(r"`([^`]+)`", note)
    return quoted.group(1) if quoted else note.split(";")[0].strip()


def _load(path: str, where: str, root: str) -> dict:
    if not os.path.isfile(os.path.join(root, path)):
        raise MarkerError(
            f"{where}: result file {path} does not exist; fix: name a file "
            "of bench/results/, or turn the block into a record marker"
        )
    with open(os.path.join(root, path)) as f:
        result = json.load(f)
    if not isinstance(result.get("rows"), list) or not result["rows"]:
        raise MarkerError(f"{where}: {path} holds no rows; fix: name a benchmark's result")
    return result


def _made(result: dict, options: dict) -> str:
    """The command, date, commit and machine of a result, as the source line names them."""
    tree = result.get("tree") or {}
    from bench.registry import runner_command

    command = _command(result, options)
    now = " ; ".join(runner_command(c) for c in command.split(" ; "))
    made = f"`{command}`"
    if now != command:  # a module command: the runner's spelling
        made += f" (now `{now}`)"
    made += f", {result.get('date', 'undated')}"
    if tree.get("commit"):
        made += f", commit {tree['commit']}" + (
            " (uncommitted changes)" if tree.get("dirty") else ""
        )
    machine = result.get("machine") or {}
    if result.get("transcribed_from"):  # the doc's words for the commit and the machine
        made += "" if tree.get("commit") else ", commit not recorded"
        return (
            f"rows transcribed by hand from {result['transcribed_from']}, where no result file "
            f"held them; measured by {made}; machine: {machine or 'not recorded'}"
        )
    if machine.get("devices"):
        made += f", on {machine['devices']} ({machine.get('cpu', '?')}, {machine.get('cpus')} cpus)"
    return made


def render(block: Block, root: str = ROOT) -> list[str]:
    """The content lines the report writes into `block`."""
    from bench.common import render_table

    where = f"{block.doc}:{block.line}"
    paths = block.result.split(" ")
    results = [_load(path, where, root) for path in paths]
    rows = [
        {"file": os.path.basename(path)[: -len(".json")], **row}
        for path, result in zip(paths, results, strict=True)
        for row in result["rows"]
    ]
    if "columns" in block.options:
        columns = []
        for item in block.options["columns"].split("|"):
            key, _, header = item.strip().partition("=")
            columns.append((key.strip(), header.strip() or key.strip()))
    elif results[0].get("columns"):
        columns = [tuple(c) for c in results[0]["columns"]]
    else:
        raise MarkerError(
            f"{where}: {paths[0]} names no columns (written before schema 1); "
            "fix: add `columns: key=Header | ...` to the marker"
        )
    keys = {k for row in rows for k in row}
    for key, *_ in columns:
        if key not in keys:
            raise MarkerError(
                f"{where}: unknown column {key!r} of {block.result}; fix: use one "
                f"of {', '.join(sorted(keys))}"
            )
    if "rows" in block.options:
        rows = _filter(rows, block.options["rows"], where, block.result)
    made = [f"`{p}`: {_made(r, block.options)}" for p, r in zip(paths, results, strict=True)]
    source = f"*Generated by `python -m bench.report` from {'; and '.join(made)}.*"
    return [source, "", *render_table(rows, columns).split("\n"), ""]


def _filter(rows: list[dict], spec: str, where: str, result: str) -> list[dict]:
    """The rows that pass every `key=value | value` condition of `spec` (`;` between them)."""
    from bench.common import format_cell

    for condition in spec.split(";"):
        key, _, values = condition.partition("=")
        key, wanted = key.strip(), [v.strip() for v in values.split("|")]
        if not values.strip() or key not in {k for row in rows for k in row}:
            raise MarkerError(
                f"{where}: row filter {condition.strip()!r} names no column of "
                f"{result}; fix: write `rows: key=value | value` with a key of "
                "the file's rows"
            )
        rows = [row for row in rows if key in row and format_cell(row[key]) in wanted]
        missing = [v for v in wanted if v not in {format_cell(row[key]) for row in rows}]
        if missing:
            raise MarkerError(
                f"{where}: no row of {result} has {key} = {missing[0]!r}; fix: use "
                "a value as the result's table prints it"
            )
    return rows


def tables(lines: list[str]) -> list[int]:
    """0-based line of each markdown table's header row."""
    return [
        i
        for i in range(len(lines) - 1)
        if lines[i].startswith("|")
        and DELIMITER_ROW.match(lines[i + 1])
        and (i == 0 or not lines[i - 1].startswith("|"))
    ]


def unmarked(doc: str, lines: list[str], blocks: list[Block], markers: dict) -> list[str]:
    """A problem for each table that is neither in a block nor right under a marker."""
    problems = []
    for t in tables(lines):
        if any(b.start <= t < b.end for b in blocks):
            continue
        above = t - 1
        while above >= 0 and not lines[above].strip():
            above -= 1
        if above not in markers:
            problems.append(
                f"{doc}:{t + 1}: a table that is neither generated nor marked; fix: "
                "put it in a bench.report block, or mark it `<!-- bench.report: "
                "record; measured DATE by COMMAND; ... -->` or `<!-- bench.report: "
                f"{REFERENCE} -->`"
            )
    return problems


def report(doc: str, root: str = ROOT, write: bool = False) -> tuple[dict, list[str]]:
    """Checks (and with `write`, rewrites) one doc: ({"blocks", "records", "references",
    "tables", "rewritten"}: counts, [problem, ...])."""
    with open(doc) as f:
        lines = f.read().split("\n")
    inside = os.path.abspath(doc).startswith(os.path.abspath(root) + os.sep)
    name = os.path.relpath(os.path.abspath(doc), root) if inside else doc
    try:
        blocks, markers = parse(name, lines)
    except MarkerError as e:
        return {}, [str(e)]
    problems, out, last, rewritten = [], [], 0, 0
    for block in blocks:
        try:
            content = render(block, root)
        except MarkerError as e:
            problems.append(str(e))
            content = lines[block.start : block.end]
        rewritten += content != lines[block.start : block.end]
        if content != lines[block.start : block.end] and not write:
            problems.append(
                f"{name}:{block.line}: the table of {block.result} differs from what "
                "bench.report writes; fix: run python -m bench.report"
            )
        out += lines[last : block.start] + content
        last = block.end
    out += lines[last:]
    if blocks or markers or name in BENCHMARK_DOCS:
        problems += unmarked(name, lines, blocks, markers)
    counts = {
        "blocks": len(blocks),
        "records": sum(1 for k in markers.values() if k == "record"),
        "references": sum(1 for k in markers.values() if k == "reference"),
        "tables": len(tables(lines)),
        "rewritten": rewritten if write else 0,
    }
    if write and out != lines:
        with open(doc, "w") as f:
            f.write("\n".join(out))
    return counts, problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 on a difference"
    )
    parser.add_argument("docs", nargs="*", help="doc files (default: docs/*.md and README.md)")
    args = parser.parse_args(argv)
    totals, problems = {}, []
    for doc in args.docs or default_docs():
        counts, found = report(doc, write=not args.check)
        for k, v in counts.items():
            totals[k] = totals.get(k, 0) + v
        problems += found
    for problem in problems:
        print(problem)
    print(
        f"{totals.get('blocks', 0)} generated tables, {totals.get('records', 0)} records, "
        f"{totals.get('references', 0)} reference tables (of {totals.get('tables', 0)} tables); "
        f"{len(problems)} problems"
        + ("" if args.check else f"; {totals.get('rewritten', 0)} rewritten")
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

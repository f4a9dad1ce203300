"""`python -m bench compare`: one workload run in this tree and in an earlier commit, alternating,
with the ratio of each row's figure (this tree / baseline).

    python -m bench compare --baseline bfba6ed --rounds 2 --pin 1 \\
        --key model --value jax_tok_s engine_tok_s -- gen --no_torch

The baseline is a temporary detached `git worktree` of `--baseline`
(`bench.common.baseline_worktree`), removed at the end, also on a failure, Ctrl-C or SIGTERM.
The runs alternate baseline, this tree, baseline, ... for `--rounds` rounds, each a fresh
process with its tree as the working directory and the only entry of PYTHONPATH, under this
Python (the same venv), optionally pinned (`--pin CPUS`: `taskset -c CPUS`). Each runs the
workload's module, `python -m bench.MODULE ARGS` (the module this tree's bench/registry.py names
for the workload), since older trees have no `python -m bench NAME` runner.

Each run's result JSON is read back: with JAXRL_BENCH_RESULTS_DIR pointed at a temporary
directory, or, from a tree whose bench/common.py ignores that variable, from the files the run
wrote or rewrote under the tree's own bench/results/. The newest one is read, or `--result NAME`
(NAME.json) when the workload writes several. Result files before the schema (`bench.common.
SCHEMA`) hold rows too; only `rows` is read.

A row of the workload's result is named by its `--key` columns (joined by ", "); per row and
`--value` column, the comparison's row holds each tree's figures, one per round ("7,261, 7,200")
and the ratio of their means, this tree over the baseline (for times, below 1 is faster). A
figure is a number or a text cell holding one number with an optional unit ("2.52x", "22.4 s",
"48.6%"). Rows found in one tree only show "-" for the other. The result is written through
`bench.common.write_results` as NAME.json and NAME.md (`--name`, default `compare_WORKLOAD`,
`-` as `_`); its note names both commits, the workload's command, the rounds, the pinning and
the machine's load average before and after.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile

from bench.common import REPO, baseline_worktree, resolve_commit
from bench.registry import BY_NAME

# One number, maybe with thousands commas, then an optional unit: "7,261", "2.52x", "22.4 s".
NUMBER = re.compile(
    r"^\s*([-+]?(?:\d{1,3}(?:,\d{3})+|\d*)(?:\.\d+)?(?:[eE][-+]?\d+)?)\s*(?:x|%|s|ms)?\s*$"
)
TAIL_LINES = 40


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench compare",
        usage="python -m bench compare --baseline REV --key COL [COL ...] --value COL [COL ...] "
        "[options] -- WORKLOAD [ARGS ...]",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--baseline", required=True, help="the earlier commit (what git resolves)")
    parser.add_argument("--rounds", type=int, default=1, help="runs per tree, alternating")
    parser.add_argument("--key", nargs="+", required=True, help="the result columns naming a row")
    parser.add_argument("--value", nargs="+", required=True, help="the result columns compared")
    parser.add_argument("--pin", default="", help="CPUs for `taskset -c` (e.g. 1 or 0-1)")
    parser.add_argument("--name", default="", help="result name (default compare_WORKLOAD)")
    parser.add_argument("--result", default="", help="the workload's result NAME to read")
    return parser


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """The compare's own options and the workload's command (after `--`)."""
    if "--" not in argv:
        if any(a in ("-h", "--help") for a in argv):
            return argv, []
        raise SystemExit(
            "bench compare: give the workload after `--`, e.g. `python -m bench compare "
            "--baseline REV --key model --value tok_s -- gen --no_torch`"
        )
    at = argv.index("--")
    return argv[:at], argv[at + 1 :]


def module_of(workload: str) -> str:
    """The module this tree's registry names for `workload`; the runner's message if unknown."""
    from bench.__main__ import unknown

    if workload == "compare":
        raise SystemExit("bench compare: the workload to compare cannot be `compare` itself")
    if workload not in BY_NAME:
        raise SystemExit(f"bench compare: {unknown(workload)}")
    return BY_NAME[workload].module


def check_runnable(tree: str, module: str, label: str) -> None:
    """`python -m MODULE` runs something in `tree`: its file exists and has a main block."""
    base = os.path.join(tree, *module.split("."))
    relative = os.path.relpath(base, tree)
    if os.path.isfile(os.path.join(base, "__main__.py")):
        return
    if not os.path.isfile(base + ".py"):
        raise SystemExit(
            f"bench compare: {label} has no {relative}.py (nor {relative}/__main__.py), so "
            f"`python -m {module}` cannot run there (bench compare runs a workload's module)"
        )
    with open(base + ".py") as f:
        if "__main__" not in f.read():
            raise SystemExit(
                f'bench compare: {label}\'s {relative}.py has no `if __name__ == "__main__":` '
                f"block, so `python -m {module}` would run nothing; add one that calls "
                "main(sys.argv[1:])"
            )


def _json_stamps(directory: str) -> dict[str, int]:
    return {p: os.stat(p).st_mtime_ns for p in glob.glob(os.path.join(directory, "*.json"))}


def written_result(results_dir: str, tree_results: str, before: dict, name: str) -> str | None:
    """The result file a run wrote: NAME.json when `name` is given, else the newest JSON;
    first in `results_dir` (the run's JAXRL_BENCH_RESULTS_DIR), then among the files of
    `tree_results` (the tree's bench/results/) that are new or changed since `before`."""
    for directory, earlier in ((results_dir, {}), (tree_results, before)):
        stamps = _json_stamps(directory)
        fresh = [p for p, t in stamps.items() if earlier.get(p) != t]
        if name:
            fresh = [p for p in fresh if os.path.basename(p) == f"{name}.json"]
        if fresh:
            return max(fresh, key=lambda p: (stamps[p], p))
    return None


def run_once(tree: str, module: str, args: list[str], pin: str, result: str, label: str) -> dict:
    """One run of `python -m MODULE ARGS` in `tree`; its result JSON (with `file`: its name)."""
    scratch = tempfile.mkdtemp(prefix="bench_compare_results_")
    tree_results = os.path.join(tree, "bench", "results")
    before = _json_stamps(tree_results)
    env = dict(os.environ, PYTHONPATH=tree, JAXRL_BENCH_RESULTS_DIR=scratch)
    env.pop("JAXRL_BENCH_COMMAND", None)  # this compare's own command, not the run's
    cmd = [sys.executable, "-m", module, *args]
    cmd = ["taskset", "-c", pin, *cmd] if pin else cmd
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    try:
        proc = subprocess.Popen(
            cmd, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        try:
            for line in proc.stdout:
                tail.append(line.rstrip("\n"))
                print(f"[compare {label}] {line}", end="", flush=True)
            code = proc.wait()
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        if code:
            raise SystemExit(
                f"bench compare: the run ({label}) failed with exit code {code}: {shlex.join(cmd)} "
                f"in {tree}; its last output:\n" + "\n".join(tail)
            )
        path = written_result(scratch, tree_results, before, result)
        if path is None:
            which = f"{result}.json" if result else "a result JSON"
            raise SystemExit(
                f"bench compare: the run ({label}: {shlex.join(cmd)}) wrote no {which} in "
                f"JAXRL_BENCH_RESULTS_DIR or in {tree_results}"
                + ("" if result else "; name the file it writes with --result NAME")
            )
        with open(path) as f:
            data = json.load(f)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    data = {"rows": data} if isinstance(data, list) else data
    data["file"] = os.path.splitext(os.path.basename(path))[0]
    return data


def figure(cell, where: str) -> float | None:
    """A cell as a number: a number, or text holding one number and an optional unit."""
    if cell is None or cell == "":
        return None
    if isinstance(cell, (int, float)) and not isinstance(cell, bool):
        return float(cell)
    match = NUMBER.match(str(cell))
    if isinstance(cell, str) and match and re.match(r"[-+]?[.\d]*\d", match.group(1)):
        return float(match.group(1).replace(",", ""))
    raise SystemExit(f"bench compare: {where} is {cell!r}, not a number; pick a numeric --value")


def keyed_rows(data: dict, keys: list[str], values: list[str], label: str) -> dict[str, dict]:
    """The result's rows by their joined key; `SystemExit` naming the columns it has when a
    key or value column is in none of its rows, or when two rows share a key."""
    rows = data.get("rows") or []
    have = list(dict.fromkeys(k for row in rows for k in row))
    for kind, columns in (("--key", keys), ("--value", values)):
        for column in columns:
            if column not in have:
                raise SystemExit(
                    f"bench compare: {label}'s result {data.get('file', '')!r} has no column "
                    f"{column!r} for {kind}; its columns: {', '.join(have) or '(no rows)'}"
                )
    out: dict[str, dict] = {}
    for row in rows:
        key = ", ".join(str(row.get(k, "")) for k in keys)
        if key in out:
            raise SystemExit(
                f"bench compare: two rows of {label}'s result are named {key!r} by --key "
                f"{' '.join(keys)}; add a column to --key (its columns: {', '.join(have)})"
            )
        out[key] = row
    return out


def _shown(cells: list) -> str:
    from bench.common import format_cell

    if not cells:
        return "-"
    return ", ".join(c if isinstance(c, str) else format_cell(float(c)) for c in cells)


def compare_rows(
    runs: dict[str, list[dict]], keys: list[str], values: list[str]
) -> tuple[list[dict], dict[str, str]]:
    """Per row key and value: each tree's figures and the ratio of their means; `runs` holds
    each tree's results ("this", "baseline"), one per round. Also the value columns' headers
    (from the first result that names its columns)."""
    keyed = {
        tree: [keyed_rows(d, keys, values, "the baseline" if tree == "baseline" else "this tree")
               for d in results]
        for tree, results in runs.items()
    }  # fmt: skip
    order = list(dict.fromkeys(k for tree in ("this", "baseline") for r in keyed[tree] for k in r))
    headers = {}
    for data in runs["this"] + runs["baseline"]:
        for column, header in data.get("columns") or []:
            headers.setdefault(column, header)
    rows = []
    for key in order:
        for value in values:
            row = {"row": key, "figure": headers.get(value, value)}
            means = {}
            for tree, label in (("this", "this_tree"), ("baseline", "baseline")):
                cells = [r[key].get(value) for r in keyed[tree] if key in r]
                cells = [c for c in cells if c is not None and c != ""]
                where = f"row {key!r}, column {value!r}, in {label.replace('_', ' ')}"
                numbers = [figure(c, where) for c in cells]
                row[label] = _shown(cells)
                row[f"{label}_values"] = numbers
                means[tree] = statistics.mean(numbers) if numbers else None
            if means["this"] is not None and means["baseline"]:
                row["ratio"] = round(means["this"] / means["baseline"], 4)
                row["ratio_shown"] = f"{row['ratio']:.3f}"
            else:
                row["ratio"] = row["ratio_shown"] = "-"
            rows.append(row)
    return rows, {v: headers.get(v, v) for v in values}


def main(argv=None) -> list[dict]:
    argv = list(sys.argv[1:] if argv is None else argv)
    own, workload_argv = split_argv(argv)
    args = _parser().parse_args(own)
    if args.rounds < 1:
        raise SystemExit(f"bench compare: --rounds {args.rounds}; give 1 or more")
    if args.pin and not re.fullmatch(r"[0-9]+([-,][0-9]+)*", args.pin):
        raise SystemExit(f"bench compare: --pin {args.pin!r}; give CPUs as taskset -c takes them")
    if args.pin and shutil.which("taskset") is None:
        raise SystemExit("bench compare: --pin needs `taskset` (util-linux), not on PATH")
    if not workload_argv:
        raise SystemExit("bench compare: no workload after `--`; `python -m bench --list`")
    workload, workload_args = workload_argv[0], workload_argv[1:]
    module = module_of(workload)
    commit = resolve_commit(args.baseline)
    check_runnable(REPO, module, "this tree")
    short = commit[:7]
    load_before = os.getloadavg()[0]
    runs: dict[str, list[dict]] = {"baseline": [], "this": []}
    with baseline_worktree(commit, "bench_compare_") as base:
        check_runnable(base, module, f"baseline {short}")
        for r in range(args.rounds):
            for side, path in (("baseline", base), ("this", REPO)):
                which = f"baseline {short}" if side == "baseline" else "this tree"
                label = f"{which}, round {r + 1}/{args.rounds}"
                runs[side].append(
                    run_once(path, module, workload_args, args.pin, args.result, label)
                )
    load_after = os.getloadavg()[0]
    files = {d["file"] for d in runs["this"] + runs["baseline"]}
    if len(files) > 1:
        raise SystemExit(
            f"bench compare: the runs wrote different results ({', '.join(sorted(files))}); "
            "name the one to compare with --result NAME"
        )
    rows, headers = compare_rows(runs, args.key, args.value)

    from bench.common import command, tree, write_results

    here = tree()
    workload_command = shlex.join(["python", "-m", module, *workload_args])
    unit = f" {headers[args.value[0]]}" if len(args.value) == 1 else ""
    columns = [("row", ", ".join(args.key))]
    columns += [("figure", "figure")] if len(args.value) > 1 else []
    columns += [
        ("this_tree", f"this tree{unit}"),
        ("baseline", f"`{short}`{unit}"),
        ("ratio_shown", "ratio"),
    ]
    note = (
        f"`{command()}`: `{workload_command}` (result {files.pop()}) in this tree "
        f"({here['commit']}{', with changes' if here['dirty'] else ''}) and in `{short}` "
        f"({args.baseline}, a git worktree), the same Python, alternating baseline first, "
        f"{args.rounds} round(s), "
        + (f"pinned to CPUs {args.pin} (taskset -c)" if args.pin else "not pinned")
        + f", load average {load_before:.1f} -> {load_after:.1f}; "
        "ratio: mean of this tree's figures / mean of the baseline's"
    )
    name = args.name or "compare_" + workload.replace("-", "_")
    print(write_results(name, rows, columns, note))
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])

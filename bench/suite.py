"""`python -m bench suite`: the test suite's time, this commit against an earlier one, the runs
alternating on one machine.

    python -m bench suite --baseline b2e8446 --order baseline,this,baseline,this
    python -m bench suite --smoke      # one small test file, this commit only (a test runs it)

Each run is `make test`'s pytest command (`python -m pytest -q --durations=15 -n 2 --dist
loadfile --no-loadscope-reorder tests`, without its `ruff check`) in a temporary detached `git
worktree` of its commit (`bench.common.baseline_worktree`): "this" is the HEAD commit, so
uncommitted edits never reach a run. The runs use this Python (the same venv), the commit's
tree as the working directory and the only entry of PYTHONPATH, and the Makefile's XLA_FLAGS
and JAX_PLATFORMS. Timing on 2 cores is only meaningful on an idle machine: each row records
the load average before its run.

A row per run: the tree and commit, the wall seconds around the pytest process, the seconds
pytest reports, the passed and failed counts, the sum of the tests' own seconds (its junit XML:
setup, call and teardown; with 2 workers about twice the wall), the load before it; then a row
per tree with the means and the ratio of the mean wall seconds (this / baseline). Each run also
prints its 15 slowest tests and any failed one. Results: bench/results/suite.json (`--name`),
suite_smoke.json with `--smoke`.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

from bench.common import baseline_worktree, resolve_commit, write_results

# The Makefile's environment for `make test` (its XLA_FLAGS and JAX_PLATFORMS defaults).
MAKE_ENV = {
    "XLA_FLAGS": "--xla_force_host_platform_device_count=8 "
    "--xla_backend_extra_options=-pre-RA-sched=fast",
    "JAX_PLATFORMS": "cpu",
}
# Not passed on to the suite: this process's own bench command and results folder (the smoke
# tests of the benchmarks check the command their rows record), a fault, pytest options.
INHERITED_NOT = ("JAXRL_BENCH_COMMAND", "JAXRL_BENCH_RESULTS_DIR", "JAXRL_FAULT", "PYTEST_ADDOPTS")
PYTEST = ["-m", "pytest", "-q", "--durations=15", "--dist", "loadfile", "--no-loadscope-reorder"]
SMOKE_TESTS = ["tests/test_structure.py"]
# pytest's last line: "2 failed, 928 passed, 3 warnings in 1112.99s (0:18:32)".
SUMMARY = re.compile(r"^=*\s*(.*?) in ([\d.]+)s\b", re.MULTILINE)
COLUMNS = [
    ("tree", "tree"),
    ("commit", "commit"),
    ("round", "run"),
    ("wall_s", "wall s"),
    ("pytest_s", "pytest s"),
    ("passed", "passed"),
    ("failed", "failed"),
    ("test_s", "sum of tests s"),
    ("load_before", "load before"),
    ("ratio", "wall / baseline"),
]


def parse_summary(output: str) -> dict:
    """pytest's final counts and seconds from its output: {"passed", "failed", "pytest_s"}."""
    matches = SUMMARY.findall(output)
    if not matches:
        raise ValueError(f"no pytest summary line in the output: {output[-2000:]!r}")
    counts, seconds = matches[-1]
    found = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|errors?)", counts)}
    failed = found.get("failed", 0) + found.get("error", 0) + found.get("errors", 0)
    return {"passed": found.get("passed", 0), "failed": failed, "pytest_s": float(seconds)}


def junit_seconds(path: str) -> float:
    """The sum of the test cases' seconds in a junit XML file."""
    return sum(float(case.get("time", 0)) for case in ET.parse(path).iter("testcase"))


def suite_env(tree: str) -> dict[str, str]:
    """This process's environment for a run in `tree`: the Makefile's flags, `tree` the only
    PYTHONPATH entry, without `INHERITED_NOT`."""
    env = {k: v for k, v in os.environ.items() if k not in INHERITED_NOT}
    return env | MAKE_ENV | {"PYTHONPATH": tree}


def run_suite(tree: str, workers: int, tests: list[str]) -> dict:
    """One run of the suite in `tree`; its figures (see the module docstring)."""
    with tempfile.TemporaryDirectory(prefix="bench_suite_") as scratch:
        junit = os.path.join(scratch, "junit.xml")
        command = [sys.executable, *PYTEST, "-n", str(workers), f"--junitxml={junit}", *tests]
        env = suite_env(tree)
        load = os.getloadavg()[0]
        start = time.monotonic()
        out = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
        wall = time.monotonic() - start
        output = out.stdout + out.stderr
        row = parse_summary(output)
        row |= {"wall_s": round(wall, 1), "load_before": round(load, 2)}
        row["test_s"] = round(junit_seconds(junit), 1) if os.path.exists(junit) else float("nan")
    lines = output.splitlines()
    slowest = [x for x in lines if re.match(r"^\d+\.\d+s (call|setup|teardown)", x)]
    failed = [x for x in lines if x.startswith(("FAILED ", "ERROR "))]
    print(f"[suite] {tree}: {row}\n  " + "\n  ".join(slowest[:15] + failed), flush=True)
    return row


def _means(rows: list[dict], tree: str) -> dict:
    mine = [r for r in rows if r["tree"] == tree]
    out = {"tree": tree, "commit": mine[0]["commit"], "round": "mean"}
    for key in ("wall_s", "pytest_s", "test_s", "load_before"):
        out[key] = round(statistics.fmean(r[key] for r in mine), 2 if key == "load_before" else 1)
    out["passed"] = mine[-1]["passed"]
    out["failed"] = sum(r["failed"] for r in mine)
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m bench suite", description=__doc__)
    parser.add_argument("--baseline", default="", help="the earlier commit (what git resolves)")
    parser.add_argument(
        "--order", default="baseline,this", help="the runs, in order: 'this' and 'baseline'"
    )
    parser.add_argument("--workers", type=int, default=2, help="pytest-xdist workers (make: 2)")
    parser.add_argument(
        "--smoke", action="store_true", help=f"{SMOKE_TESTS}, this commit, once, no workers"
    )
    parser.add_argument("--name", default="", help="result name (default suite, suite_smoke)")
    args = parser.parse_args(argv)
    order = ["this"] if args.smoke else [x.strip() for x in args.order.split(",") if x.strip()]
    unknown = sorted(set(order) - {"this", "baseline"})
    if unknown or not order:
        parser.error(f"--order takes 'this' and 'baseline', comma-separated; got {args.order!r}")
    if "baseline" in order and not args.baseline:
        parser.error("--order names 'baseline': give --baseline REV (e.g. a commit hash)")
    tests = SMOKE_TESTS if args.smoke else ["tests"]
    workers = 0 if args.smoke else args.workers  # the smoke: no xdist workers to start
    commits = {"this": resolve_commit("HEAD")}
    if args.baseline:
        commits["baseline"] = resolve_commit(args.baseline)
    rows = []
    for n, which in enumerate(order):
        with baseline_worktree(commits[which], prefix="bench_suite_tree_") as tree:
            row = run_suite(tree, workers, tests)
        rounds = sum(1 for x in order[: n + 1] if x == which)
        rows.append({"tree": which, "commit": commits[which][:8], "round": rounds} | row)
    means = [_means(rows, which) for which in ("baseline", "this") if which in order]
    if len(means) == 2:
        means[1]["ratio"] = f"{means[1]['wall_s'] / means[0]['wall_s']:.3f}"
    rows += means
    note = (
        f"`make test`'s pytest command ({len(tests)} path(s): {' '.join(tests)}, "
        f"{workers} workers) in a worktree of each commit, run in the order {order}; "
        "wall s around the pytest process, pytest s as it reports, sum of tests s from its junit "
        "XML (setup + call + teardown of every test); load before = the 1-minute load average "
        "before the run."
    )
    name = args.name or ("suite_smoke" if args.smoke else "suite")
    print(write_results(name, rows, COLUMNS, note))
    return rows


if __name__ == "__main__":
    main()

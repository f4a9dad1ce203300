"""Shared output format of the benchmarks: one JSON line per measurement on stdout, and
results files under bench/results/ (JSON list + markdown table) that docs/benchmarks.md quotes;
and the temporary git worktree of an earlier commit that before/after checks run in."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

# The RL learning benchmarks' --smoke: a few steps of everything, to check the plumbing.
LEARNING_SMOKE = [
    "SFTConfig.steps = 4", "SFTConfig.eval_every_steps = 2", "SFTConfig.eval_size = 16",
    "RLConfig.total_steps = 6", "RLConfig.eval_every_steps = 2",
    "RLConfig.eval_size = 16", "RLConfig.num_prompts = 4", "RLConfig.oversample = 2",
]  # fmt: skip

# The committed results (what the docs cite), which summaries of several runs read.
COMMITTED_RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
# JAXRL_BENCH_RESULTS_DIR: somewhere else (a test's temporary directory) for the results.
RESULTS_DIR = os.environ.get("JAXRL_BENCH_RESULTS_DIR") or COMMITTED_RESULTS_DIR


SCHEMA = 1  # the version of the result files' layout (see `write_results`)


def machine() -> str:
    import jax

    devices = jax.devices()
    return f"{len(devices)}x {devices[0].device_kind} ({platform.machine()}, {os.cpu_count()} cpus)"


def machine_facts() -> dict:
    """What a result's figures depend on: the devices, the host CPU and its cores, the versions."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    import jax

    devices = jax.devices()
    return {
        "devices": f"{len(devices)}x {devices[0].device_kind}",
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "jax": jax.__version__,
    }


def tree() -> dict:
    """The commit the figures were measured at, and whether the work tree had changes."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def git(*args: str) -> str:
        try:
            out = subprocess.run(
                ["git", *args], cwd=root, capture_output=True, text=True, timeout=10
            )
        except (OSError, subprocess.TimeoutExpired):
            return ""
        return out.stdout.strip() if out.returncode == 0 else ""

    commit = git("rev-parse", "--short=12", "HEAD")
    dirty = bool(
        git("status", "--porcelain", "--untracked-files=no", "--", "jaxrl", "launch", "bench")
    )
    return {"commit": commit or "unknown", "dirty": dirty}


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def resolve_commit(rev: str) -> str:
    """The full hash of the commit `rev` names in this repository; `SystemExit` naming `rev`
    when git cannot resolve it."""
    out = subprocess.run(
        ["git", "-C", REPO, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
        capture_output=True,
        text=True,
    )
    if out.returncode or not out.stdout.strip():
        raise SystemExit(
            f"git cannot resolve the baseline {rev!r} to a commit of {REPO}; give a commit "
            "hash, branch or tag that `git log --oneline` shows"
        )
    return out.stdout.strip()


@contextlib.contextmanager
def baseline_worktree(rev: str, prefix: str = "bench_baseline_"):
    """Yields the path of a temporary detached `git worktree` of commit `rev`, removed again
    (`git worktree remove --force`, then `git worktree prune`) on exit, on an exception, on
    Ctrl-C and, in the main thread, on SIGTERM (turned into `SystemExit` while it is open)."""
    commit = resolve_commit(rev)
    scratch = tempfile.mkdtemp(prefix=prefix)
    path = os.path.join(scratch, "tree")
    previous = None
    if threading.current_thread() is threading.main_thread():

        def terminate(signum, frame):
            raise SystemExit(128 + signum)

        previous = signal.signal(signal.SIGTERM, terminate)
    try:
        out = subprocess.run(
            ["git", "-C", REPO, "worktree", "add", "--detach", path, commit],
            capture_output=True,
            text=True,
        )
        if out.returncode:
            raise SystemExit(f"git worktree add of {rev!r} failed: {out.stderr.strip()}")
        yield path
    finally:
        subprocess.run(
            ["git", "-C", REPO, "worktree", "remove", "--force", path], capture_output=True
        )
        subprocess.run(["git", "-C", REPO, "worktree", "prune"], capture_output=True)
        shutil.rmtree(scratch, ignore_errors=True)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def command() -> str:
    """The command line that ran this process, as a user would type it."""
    if os.environ.get("JAXRL_BENCH_COMMAND"):  # set by `python -m bench`
        return os.environ["JAXRL_BENCH_COMMAND"]
    return (
        "python -m "
        + os.path.splitext(os.path.relpath(sys.argv[0]))[0].replace(os.sep, ".")
        + "".join(f" {a}" for a in sys.argv[1:])
    )


def format_cell(value) -> str:
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"
    return str(value)


ALIGN = {"left": ":---", "right": "---:", "center": ":---:"}  # a column's optional third item


def render_table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """The markdown table of `rows` under `columns` ((key, header) pairs, or (key, header,
    alignment): "left", "right" or "center" in the delimiter row), no heading comment."""
    lines = [
        "| " + " | ".join(c[1] for c in columns) + " |",
        "|" + "|".join(ALIGN.get(c[2], "---") if len(c) > 2 else "---" for c in columns) + "|",
    ]
    for row in rows:
        lines.append("| " + " | ".join(format_cell(row.get(c[0], "")) for c in columns) + " |")
    return "\n".join(lines)


def write_results(name: str, rows: list[dict], columns: list[tuple[str, str]], note: str) -> str:
    """Writes bench/results/NAME.json and NAME.md; returns the markdown table.

    `columns` are (key, header) pairs; `note` (what was measured, how) heads the table. The JSON
    holds, besides the rows: the schema version, the command, the tree (commit, and whether
    `jaxrl/`, `launch/` or `bench/` had uncommitted changes), the machine, the date and the
    columns, so that `python -m bench.report` can rebuild the table from the file alone.
    """
    os.makedirs(RESULTS_DIR, exist_ok=True)
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    result = {
        "schema": SCHEMA,
        "command": command(),
        "tree": tree(),
        "machine": machine_facts(),
        "date": stamp,
        "note": note,
        "columns": [list(c) for c in columns],
        "rows": rows,
    }
    return _write(name, result)


def write_archive(
    name: str,
    rows: list[dict],
    columns: list[tuple[str, ...]],
    note: str,
    command: str,
    tree: dict,
    machine: str,
    date: str,
    transcribed_from: str,
) -> str:
    """Writes bench/results/NAME.json and NAME.md for rows transcribed from a doc's table (runs
    whose own result files were not kept); returns the markdown table. The same layout as
    `write_results`, but what it cannot know comes from the doc: the command, the tree (e.g.
    {"commit": None, "note": "not recorded"}), the machine (a sentence) and the date as the doc
    writes them, and `transcribed_from`, the doc's path, which the report's heading names."""
    os.makedirs(RESULTS_DIR, exist_ok=True)
    result = {
        "schema": SCHEMA,
        "command": command,
        "tree": tree,
        "machine": machine,
        "date": date,
        "note": note,
        "columns": [list(c) for c in columns],
        "rows": rows,
        "transcribed_from": transcribed_from,
    }
    return _write(name, result)


def _write(name: str, result: dict) -> str:
    """Writes `result` to RESULTS_DIR/NAME.json and its note and table to NAME.md."""
    path = os.path.join(RESULTS_DIR, f"{name}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f, indent=1)
    os.replace(path + ".tmp", path)
    columns = [tuple(c) for c in result["columns"]]
    table = f"<!-- {result['note']}; {result['date']} -->\n" + render_table(result["rows"], columns)
    with open(os.path.join(RESULTS_DIR, f"{name}.md"), "w") as f:
        f.write(table + "\n")
    return table


def run_rl(config: str, workdir: str, params: list[str] = ()) -> float:
    """`python -m launch.rl --gin_file=config --workdir=workdir --gin_param=...` in this process;
    returns its wall seconds."""
    import gin

    from jaxrl.infra.launcher import launch
    from launch.rl import rl_main

    flags = ["--gin_file", config, "--workdir", workdir]
    for p in params:
        flags += ["--gin_param", p]
    start = time.perf_counter()
    try:
        launch(rl_main, flags)
    finally:
        gin.clear_config()
    return time.perf_counter() - start


def gin_values(config: str, overrides: list[str], *names: str) -> dict:
    """The values `config` (with `overrides`) binds to `names` (e.g. "RLConfig.queue_size")."""
    import gin

    import launch.configs  # noqa: F401  (registers the configurables)

    gin.parse_config_files_and_bindings([config], overrides)
    try:
        return {name: gin.query_parameter(name) for name in names}
    finally:
        gin.clear_config()

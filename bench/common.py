"""Shared output format of the benchmarks: one JSON line per measurement on stdout, and
results files under bench/results/ (JSON list + markdown table) that docs/benchmarks.md quotes."""

from __future__ import annotations

import json
import os
import platform
import sys
import time

import jax

# The RL learning benchmarks' --smoke: a few steps of everything, to check the plumbing.
LEARNING_SMOKE = [
    "SFTConfig.steps = 4", "SFTConfig.eval_every_steps = 2", "SFTConfig.eval_size = 16",
    "RLConfig.total_steps = 6", "RLConfig.eval_every_steps = 2",
    "RLConfig.eval_size = 16", "RLConfig.num_prompts = 4", "RLConfig.oversample = 2",
]  # fmt: skip

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def machine() -> str:
    devices = jax.devices()
    return f"{len(devices)}x {devices[0].device_kind} ({platform.machine()}, {os.cpu_count()} cpus)"


def command() -> str:
    return (
        "python -m "
        + os.path.splitext(os.path.relpath(sys.argv[0]))[0].replace(os.sep, ".")
        + "".join(f" {a}" for a in sys.argv[1:])
    )


def write_results(name: str, rows: list[dict], columns: list[tuple[str, str]], note: str) -> str:
    """Writes bench/results/NAME.json and NAME.md; returns the markdown table.

    `columns` are (key, header) pairs; `note` (the command, the machine) heads the table.
    """
    os.makedirs(RESULTS_DIR, exist_ok=True)
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    with open(os.path.join(RESULTS_DIR, f"{name}.json"), "w") as f:
        json.dump({"date": stamp, "note": note, "rows": rows}, f, indent=1)
    lines = [
        f"<!-- {note}; {stamp} -->",
        "| " + " | ".join(h for _, h in columns) + " |",
        "|" + "|".join("---" for _ in columns) + "|",
    ]
    for row in rows:
        cells = []
        for key, _ in columns:
            value = row.get(key, "")
            if isinstance(value, float):
                cells.append(f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}")
            else:
                cells.append(str(value))
        lines.append("| " + " | ".join(cells) + " |")
    table = "\n".join(lines)
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

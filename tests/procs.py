"""Launchers in subprocesses, for the end-to-end tests that kill and resume runs.

A launch runs `python -m <module> --gin_file CONFIG --workdir WORKDIR --gin_param ...` from the
checkout, with the checkout and tests/ on PYTHONPATH (configs may name test helpers such as
`rewards_for_tests:even_length`). The runs of one test share a persistent XLA compilation cache:
only the first compiles, which changes no result, only the seconds. `fault` sets JAXRL_FAULT
(`jaxrl.infra.faults`); one inherited from the caller is never passed on.
"""

from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# LLVM's optimisation level for XLA:CPU's machine code in the tests (set in tests/conftest.py).
OPT_LEVEL_FLAG = "--xla_backend_optimization_level=0"


def suite_xla_flags(devices: int | None = None) -> str:
    """XLA_FLAGS for a process a test starts with its own device count (`devices`, or none for
    `launch.local_cluster`, which sets it per process): the suite's flags, not the caller's."""
    from jaxrl.infra.xla_cpu import cpu_xla_flags

    return cpu_xla_flags(OPT_LEVEL_FLAG, devices=devices)


def launch_env(cache: str, fault: str | None = None, **extra: str) -> dict[str, str]:
    """This process's environment for a launch: PYTHONPATH, the XLA cache `cache`, the fault."""
    env = {k: v for k, v in os.environ.items() if k != "JAXRL_FAULT"}
    env["PYTHONPATH"] = os.pathsep.join([REPO, os.path.join(REPO, "tests")])
    env["JAX_COMPILATION_CACHE_DIR"] = str(cache)
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    if fault:
        env["JAXRL_FAULT"] = fault
    return env | extra


def launch_flags(config: str, workdir, params=()) -> list[str]:
    """`--gin_file config --workdir workdir` and one `--gin_param` per binding in `params`."""
    flags = ["--gin_file", config, "--workdir", str(workdir)]
    for p in params:
        flags += ["--gin_param", p]
    return flags


def run_launch(
    config: str, workdir, params, cache: str, fault: str | None = None, *, timeout: float = 600
) -> subprocess.CompletedProcess:
    """`python -m launch.rl` on `config` with `params`, to its end (or its kill)."""
    return subprocess.run(
        [sys.executable, "-m", "launch.rl", *launch_flags(config, workdir, params)],
        cwd=REPO, env=launch_env(cache, fault), capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip

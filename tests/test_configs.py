"""Every gin file in configs/ parses and binds: names, types and ranges are checked the way a
launch checks them, without running anything."""

from __future__ import annotations

import glob
import os

import gin
import pytest

from jaxrl.infra.config import parse_gin, resolve_bindings

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(REPO, "configs", "**", "*.gin"), recursive=True))


def _launch_fn(path: str):
    kind = os.path.basename(os.path.dirname(path))
    if kind == "rl":
        from launch.rl import rl_main

        return rl_main
    if kind == "sft":
        from launch.sft import sft_main

        return sft_main
    if kind == "plan":
        from launch.plan import plan_main

        return plan_main
    if kind == "msd":
        from launch.msd import msd_main

        return msd_main
    raise AssertionError(f"{path}: no launcher known for configs/{kind}/")


def test_there_are_configs():
    assert any("/rl/" in c for c in CONFIGS), CONFIGS


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: os.path.relpath(p, REPO))
def test_config_parses_and_binds(path):
    with open(path) as f:
        header = f.readline()
    assert header.startswith("#"), f"{path} must start with a comment: the command that runs it"
    assert (
        f"--gin_file=configs/{os.path.relpath(path, os.path.join(REPO, 'configs'))}"
        in open(path).read()
    ), f"{path}: the header must show its own run command"
    launch_fn = _launch_fn(path)
    try:
        parse_gin([path], [])
        kwargs = resolve_bindings(launch_fn)
    finally:
        gin.clear_config()
    assert kwargs, path

"""Every gin file in configs/ parses and binds: names, types and ranges are checked the way a
launch checks them, without running anything."""

from __future__ import annotations

import dataclasses
import glob
import os
import warnings

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


def _model_bindings(path: str) -> list[str]:
    """A config written for a pretrained model refuses to bind without `PolicySpec.init_from`
    (`PolicySpec.requires_init_from`): a directory stands in for the model here."""
    if "PolicySpec.requires_init_from" in open(path).read():
        return [f"PolicySpec.init_from = '{REPO}'"]
    return []


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
        with warnings.catch_warnings():
            # A gin string is a Python literal: "\d" parses with a warning (write "\\d").
            warnings.filterwarnings("error", message="invalid escape sequence")
            parse_gin([path], _model_bindings(path))
        kwargs = resolve_bindings(launch_fn)
    finally:
        gin.clear_config()
    assert kwargs, path


RL_CONFIGS = [c for c in CONFIGS if os.path.basename(os.path.dirname(c)) == "rl"]


@pytest.mark.parametrize("path", RL_CONFIGS, ids=lambda p: os.path.relpath(p, REPO))
def test_rl_settings_stay_out_of_the_sft_stage(path):
    """Gin applies an unscoped `OptimizerConfig.b1 = ...` inside every scope that does not bind
    the field itself, so an RL-only setting also reached the SFT warm start's sft/OptimizerConfig
    (arith_tiny_lora.gin's b1 0.98 cut its SFT start from ~20% to 10.7% greedy). The
    SFT stage's optimizer must be the defaults plus what the config binds under sft/ itself."""
    from jaxrl.train.trainer import OptimizerConfig
    from launch.rl import rl_main
    from launch.sft import sft_main

    try:
        parse_gin([path], _model_bindings(path))
        sft = resolve_bindings(rl_main).get("sft")
        own = gin.get_bindings("sft/OptimizerConfig", inherit_scopes=False)
    finally:
        gin.clear_config()
    if sft is None:
        return
    expected = dataclasses.replace(OptimizerConfig(), **own)
    assert sft.optimizer == expected, (
        f"{path}: the SFT stage's optimizer picked up RL settings: {sft.optimizer} != {expected}"
    )
    # The arithmetic configs share the SFT stage of configs/sft/arith_tiny.gin.
    if "arith_tiny" in os.path.basename(path):
        try:
            parse_gin([os.path.join(REPO, "configs", "sft", "arith_tiny.gin")], [])
            alone = resolve_bindings(sft_main)["sft"]
        finally:
            gin.clear_config()
        assert sft == alone, f"{path}: SFT stage {sft} differs from launch.sft's {alone}"

"""`bench.plan_tables` (`python -m bench plan-tables`): its rows from a tiny plan on one H100,
compiled deviceless through the CUDA plugin as `launch.plan` compiles the real ones (the
scores each attention path holds: tests/test_hand_count.py)."""

import math

import pytest

pytest.importorskip("jax_plugins.xla_cuda12", reason="AOT GPU plans need jax-cuda12-plugin")

from bench.plan_tables import (  # noqa: E402
    ATTENTION_COLUMNS,
    RATIO_COLUMNS,
    GiB,
    _scores,
    attention_row,
    ratios_row,
)
from launch.plan import PlanConfig, plan_trainer_role  # noqa: E402

# The tiny model on one H100; 64 + 32 tokens: a sequence that is none of the model's dims, so
# [96, 96] scores are looked for.
TINY = PlanConfig(
    model="rlbench_tiny",
    trainer_topology="h100:1x1",
    trainer_axis_sizes=(1, 1),
    generator_topology="h100:1x1",
    generator_axis_sizes=(1, 1),
    prompts=2,
    samples=2,
    prompt_len=64,
    completion_len=32,
    grad_accum_steps=1,
)


def test_rows_of_a_tiny_plan():
    trainer = plan_trainer_role(TINY)  # compiled once for both rows
    row = ratios_row(TINY, "tiny, 1 H100", trainer=trainer)
    assert {key for key, _ in RATIO_COLUMNS} <= set(row)
    for name in ("train", "prefill", "decode"):
        ratios = [float(x) for x in row[name].split(" / ")]
        exact = [row[f"{name}_bytes_ratio"], row[f"{name}_flops_ratio"]]
        assert ratios == [round(x, 2) for x in exact], row
        assert all(math.isfinite(x) and x > 0 for x in exact), row
    assert row["flops_s"] > 0 and row["bytes_s"] > 0
    assert row["times"].endswith(f"({row['bound']})")
    assert row["scores"] == "none"  # the Triton kernel: no [T, T] scores

    row = attention_row(TINY, "Triton kernel", trainer=trainer)
    assert {key for key, _ in ATTENTION_COLUMNS} <= set(row)
    for key in ("temp_bytes", "total_bytes", "flops_raw", "bytes_raw", "roofline_s"):
        assert math.isfinite(row[key]) and row[key] > 0, row
    assert float(row["roofline"]) > 0 and row["scores"] == "none"
    assert _scores([("f32[2,8,96,96]", GiB)]) == "f32[2,8,96,96] 1.00 GiB"
    assert _scores(None) == "not looked for"

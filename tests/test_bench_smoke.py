"""Smoke version of the generation benchmark: every system runs and the ratios are reported.

(The RL learning experiment is not smoke-tested here: its code path is `launch.rl`, which
tests/test_rl_loop.py runs end to end.)
"""

from __future__ import annotations

import json

from bench import gen


def test_bench_gen_smoke(capsys):
    gen.main(["--smoke"])
    row = json.loads(capsys.readouterr().out.splitlines()[0])
    assert row["jax_tok_s"] > 0 and row["torch_tok_s"] > 0 and row["speedup"] > 0
    assert row["engine_tok_s"] > 0 and row["engine_speedup"] > 0 and row["engine_vs_static"] > 0


def test_bench_trainer_scale_smoke(capsys):
    """The scanned step compiles to one program at two depths, and remat `full` plans less
    temporary memory than `none` (XLA's buffer assignment for the same step)."""
    from bench import trainer_scale

    trainer_scale.main(["--smoke"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line[:1] == "{"]
    compiled = [r for r in rows if r["bench"] == "trainer_compile"]
    assert len(compiled) == 2 and all(r["compile_s"] > 0 for r in compiled)
    assert compiled[0]["hlo_instructions"] == compiled[1]["hlo_instructions"]  # one layer body
    memory = {r["policy"]: r["temp_mb"] for r in rows if r["bench"] == "trainer_memory"}
    assert memory["full"] < memory["none"]


def test_bench_packing_smoke(capsys):
    """Packed and padded layouts of the same long-tailed rollouts: the same loss, fewer tokens
    and XLA FLOPs through the model."""
    from bench import packing

    rows = {r["layout"][:6]: r for r in packing.main(["--smoke"])}
    padded, packed = rows["padded"], rows["packed"]
    assert padded["step_s"] > 0 and packed["step_s"] > 0
    assert abs(packed["loss"] - padded["loss"]) <= 1e-5 * abs(padded["loss"]) + 1e-6
    assert packed["model_tokens"] < padded["model_tokens"] / 2
    assert packed["gflop"] < padded["gflop"] / 2


def test_bench_rl_step_smoke():
    """The one-core sync step runs from this tree in a pinned subprocess, and XLA's FLOPs for its
    train step agree with the hand count of forward + backward for the same tokens (within 25%:
    the count leaves out norms, softmax, the optimizer)."""
    from bench import rl_step

    (row,) = rl_step.main(["--smoke"])
    assert row["step_s"] > 0 and row["train_s"] > 0 and row["generate_s"] > 0
    assert 0.75 <= row["xla_gflop"] / row["minimal_gflop"] <= 1.25, row
    assert row["matmul_peak_gflops"] > row["achieved_gflops"] > 0


def test_bench_turns_check_times_a_short_program_on_4_devices_and_on_one():
    from bench.scale_validate import turns_check

    out = turns_check(n=128, reps=5)
    shorts = [f"{s}_{w}_s" for s in ("short", "one_device_short") for w in ("alone", "during_long")]
    assert sorted(out) == sorted(["long_alone_s", *shorts])
    assert all(v > 0 for v in out.values())

"""`python -m bench.rl_streaming --smoke`: the pinned one-core-per-role proxy (bench/
rl_streaming_pinned.py) runs end to end on the chain task (random weights, 4 prompts x 4 samples,
3 steps) and its figures are self-consistent. The test runs the two two-process rows (fixed lag
1 and streaming); the sync row is `Controller.run_sync` in one pinned process (the CLI smoke runs
it too). The full run is the measurement quoted in docs/benchmarks.md."""

import math
import os

import pytest

from bench import rl_streaming


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one core per role needs 2 cores")
def test_bench_rl_streaming_pinned_smoke():
    rows = rl_streaming.main(["--smoke", "--modes_2dev", "fixed_lag,streaming_keep"])
    assert [(r["setting"], r["mode"]) for r in rows] == [
        ("pinned", "fixed_lag"),
        ("pinned", "streaming_keep"),
    ]
    for row in rows:
        assert row["measured_steps"] == 2 and row["step_s"] > 0 and row["train_s"] > 0
        assert math.isclose(row["steps_per_hour"], 3600 / row["step_s"])
        assert 0 <= row["trainer_idle"] <= 1 and 0 <= row["generator_idle"] <= 1
        assert 2 <= row["completion_tokens"] <= 8  # the chain answer, capped at 8 new tokens
    fixed, streaming = rows
    # Fixed lag 1: batch k >= 1 is sampled whole by version k - 1, nothing dropped.
    assert fixed["token_staleness"] == fixed["token_staleness_max"] == 1.0
    assert fixed["dropped_groups"] == 0 and math.isnan(fixed["engine_util"])
    # Streaming: per-token staleness bounded by max_staleness (2) on the oldest token; the
    # engine was kept busy (kept tokens / slot-steps).
    assert 0 <= streaming["token_staleness"] <= streaming["token_staleness_max"] <= 2
    assert 0 < streaming["engine_util"] <= 1

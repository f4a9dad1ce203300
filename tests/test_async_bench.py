"""`python -m bench.rl --smoke` runs both settings end to end (8 fake devices through the
library's Controller, and the CPU proxy's pinned processes) and its figures are self-consistent;
the full run (`python -m bench.rl`) is the measurement quoted in docs/benchmarks.md."""

from bench import rl


def test_bench_rl_smoke():
    rows = rl.main(["--smoke"])
    assert [r["setting"] for r in rows] == [rl.FAKE8] * 2 + [rl.PROXY] * 2
    for row in rows:
        assert row["command"] == "python -m bench.rl --smoke"
        assert row["step_s"] > 0 and row["train_s"] > 0 and row["generate_s"] > 0
        assert 0 <= row["trainer_idle_frac"] <= 1 and 0 <= row["generator_idle_frac"] <= 1
        assert 0 <= row["overlap_frac"] <= 1
        if row["baseline"]:
            assert row["mode"].startswith("sync") and row["speedup"] == 1.0
            assert row["sync_s"] == 0 and "bound" not in row
        else:  # fixed lag 1: every batch after warm-up is one version old, none dropped
            assert row["mode"].startswith("async fixed lag 1") and row["dropped_samples"] == 0
            assert row["staleness_mean"] == 1.0 and row["sync_s"] > 0
            assert 1.0 <= row["bound"] <= 2.0 and row["speedup"] > 0


def test_bench_soak_smoke():
    """`python -m bench.soak --smoke` (8 steps of the async default on a small batch): its RSS,
    queue depth and drops are read back from its metrics; the queue never exceeds its bound and
    fixed lag drops nothing."""
    from bench import soak

    row = soak.main(["--smoke"])
    assert row["steps"] == 8 and row["rss_after_warmup_mb"] > 0 and row["rss_end_mb"] > 0
    assert len(row["rss_median_by_eighth"]) == 8 and row["rss_max_mb"] >= row["rss_end_mb"]
    assert 0 <= row["queue_depth_max"] <= row["queue_size"]
    assert row["dropped_samples"] == 0 and row["staleness_mean"] > 0

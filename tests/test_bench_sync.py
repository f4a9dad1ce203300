"""`python -m bench.sync --smoke` runs end to end and its figures are self-consistent (the full
run, `python -m bench.sync`, is the ~100M-parameter measurement quoted in docs/benchmarks.md)."""

from bench import sync


def test_bench_sync_smoke():
    rows = sync.main(["--smoke"])
    assert len(rows) == 5 and {row["transport"] for row in rows} == {"assemble", "reshard"}
    for row in rows:
        assert row["command"] == "python -m bench.sync --smoke"
        assert row["gbps"] > 0 and row["memcpy_gbps"] > 0 and row["device_put_gbps"] > 0
        assert row["moved_mb"] >= row["params_mb"] > 0
        # The probe saw at most the planned one-chunk bound (pause-and-swap).
        assert 0 < row["peak_extra_mb"] <= row["bound_mb"] < row["gen_device_mb"]
        # A bare device_put goes through the host exactly when the layout changes.
        assert row["bare_via_host"] == ("same layout" not in row["pair"])

"""`python -m bench.sync --cross_process --smoke` runs end to end (the in-process figure in this
process's 8 devices, then a 2-process job with both cross-process transports, trainer on
process 0, generator on process 1) and its figures add up. The full run (also with both roles
spanning both processes) is what bench/results/sync_xproc.md quotes."""

from bench import sync


def test_bench_sync_cross_process_smoke():
    rows = sync.main(["--cross_process", "--smoke"])
    assert [(r["processes"], r["transport"]) for r in rows] == [
        (1, "assemble"),
        (2, "device_put"),
        (2, "ppermute"),
    ]
    for row in rows:
        assert row["command"] == "python -m bench.sync --cross_process --smoke"
        assert row["gbps"] > 0 and row["push_s"] > 0 and row["memcpy_gbps"] > 0
        assert row["moved_mb"] == rows[0]["moved_mb"]
    split_put, split_ppermute = rows[1:]
    assert split_put["cross_mb"] == split_put["params_mb"]  # each block crosses once
    assert split_ppermute["cross_mb"] == split_ppermute["moved_mb"]  # every replica crosses

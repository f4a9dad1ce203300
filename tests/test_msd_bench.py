"""bench.msd runs end to end (smoke sizes) and writes its JSON and markdown results."""

import json

import bench.common
from bench import msd


def test_bench_msd_smoke(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench.common, "RESULTS_DIR", str(tmp_path))
    rows = msd.main(["--smoke"])
    assert [row["step"] for row in rows] == ["kd", "msd/uniform"]
    for row in rows:
        assert row["median_ms"] > 0 and row["compile_s"] > 0 and row["devices"] == 8
    assert rows[0]["ratio_to_kd"] == 1.0
    assert rows[1]["ratio_to_kd"] == round(rows[1]["median_ms"] / rows[0]["median_ms"], 3)
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert [x["step"] for x in lines] == ["kd", "msd/uniform"]
    saved = json.loads((tmp_path / "msd_step_smoke.json").read_text())
    assert saved["rows"] == rows
    table = (tmp_path / "msd_step_smoke.md").read_text()
    assert "| msd/uniform |" in table and "time / KD" in table

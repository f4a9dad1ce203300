"""Metrics writer: parseable jsonl lines, TensorBoard events, scalar conversion, progress bar."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.infra import metrics as metrics_lib


def test_jsonl_and_tensorboard(tmp_path):
    with metrics_lib.MetricsWriter(tmp_path) as writer:
        writer.write(1, {"reward/mean": jnp.float32(0.25), "loss": {"aipo": np.float64(1.5)}})
        writer.write(2, {"reward/mean": 0.5, "queue/dropped": jnp.int32(3), "ok": np.bool_(True)})
        writer.write_histogram(2, "staleness", jnp.array([0, 1, 1, 2]))

    lines = (tmp_path / metrics_lib.METRICS_FILE).read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == [1, 2]
    assert records[0]["reward/mean"] == 0.25 and records[0]["loss/aipo"] == 1.5
    assert records[1]["queue/dropped"] == 3 and isinstance(records[1]["queue/dropped"], int)
    assert records[1]["ok"] is True
    assert all(isinstance(r["wall_time_s"], float) for r in records)
    (events,) = (tmp_path / metrics_lib.TENSORBOARD_DIR).glob("events.out.tfevents.*")
    summaries = [metrics_lib.event_of(r) for r in metrics_lib.read_event_records(events)]
    summaries = [e for e in summaries if e.HasField("summary")]
    scalars = {
        (e.step, v.tag): v.simple_value
        for e in summaries
        for v in e.summary.value
        if v.tag != "staleness"
    }
    assert scalars == {
        (1, "reward/mean"): 0.25, (1, "loss/aipo"): 1.5,
        (2, "reward/mean"): 0.5, (2, "queue/dropped"): 3.0, (2, "ok"): 1.0,
    }  # fmt: skip
    (hist,) = [v.histo for e in summaries for v in e.summary.value if v.tag == "staleness"]
    assert hist.num == 4 and hist.min == 0 and hist.max == 2


def test_resumed_run_appends_and_reader_keeps_last(tmp_path):
    with metrics_lib.MetricsWriter(tmp_path, tensorboard=False) as writer:
        writer.write(1, {"x": 1.0})
        writer.write(2, {"x": 2.0})
    with metrics_lib.MetricsWriter(tmp_path, tensorboard=False) as writer:  # resumed from step 1
        writer.write(2, {"x": 20.0})
    assert [r["x"] for r in metrics_lib.read_metrics(tmp_path / "metrics.jsonl")] == [1.0, 20.0]


def test_rejects_non_scalars_and_reserved_names(tmp_path):
    with metrics_lib.MetricsWriter(tmp_path, tensorboard=False) as writer:
        with pytest.raises(ValueError, match=r"'loss/per_token' has shape \(3,\)"):
            writer.write(1, {"loss": {"per_token": jnp.ones(3)}})
        with pytest.raises(ValueError, match="reserved"):
            writer.write(1, {"step": 3})
    assert metrics_lib.non_finite_metrics({"a": float("nan"), "b": 1.0}) == ["a"]


def test_progress_bar_disabled_is_a_no_op():
    with metrics_lib.progress_bar(10, enabled=False) as bar:
        bar.update(1)
        bar.set_postfix(loss=1.0)
    bar = metrics_lib.progress_bar(10, initial_step=3, enabled=True)
    bar.update(2)
    assert bar.n == 5
    bar.close()


def test_two_launches_in_one_second_keep_both_event_files(tmp_path, monkeypatch):
    """Regression: tensorboardX names an event file by the whole second and opens it 'wb', so a
    run relaunched within the second of the last launch truncated that launch's events (CI: a
    resumed run lost its steps 3 and 4 from TensorBoard)."""
    from types import SimpleNamespace

    from tensorboardX import event_file_writer

    # tensorboardX's module alone sees a frozen clock (its file names; its flush thread waits)
    monkeypatch.setattr(event_file_writer, "time", SimpleNamespace(time=lambda: 1_700_000_000.25))
    with metrics_lib.MetricsWriter(tmp_path) as writer:
        writer.write(3, {"loss": 3.0})
    with metrics_lib.MetricsWriter(tmp_path) as writer:
        writer.discard_after(3)
        writer.write(4, {"loss": 4.0})
    files = sorted((tmp_path / metrics_lib.TENSORBOARD_DIR).glob("events.out.tfevents.*"))
    assert len(files) == 2
    steps = [
        e.step
        for path in files
        for e in map(metrics_lib.event_of, metrics_lib.read_event_records(path))
        if e.HasField("summary")
    ]
    assert sorted(steps) == [3, 4]

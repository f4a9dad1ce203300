"""Learning experiments' rows from finished runs' metrics.jsonl: `python -m bench learning moe`
(curve, gain, router auxiliary loss, seconds per step; a bad `--runs` or `--init_from` refused
before any run starts) and `rl-lora` tabulating finished runs into its result file."""

from __future__ import annotations

import argparse
import json

import pytest

from bench.learning import moe, rl_lora


def _metrics(path, accuracies, aux=2.0, every=100, pushed=None):
    """One record per step, as the loop writes them: RL steps 1..N, evaluations every `every`."""
    records = []
    for step in range((len(accuracies) - 1) * every + 1):
        record = {"step": step}
        if step:
            record |= {"reward/mean": 0.1, "router_aux_loss": aux, "time/step_s": 0.5}
            if pushed:
                record["sync/bytes_pushed"] = pushed
        if step % every == 0:
            acc = accuracies[step // every]
            record |= {"eval/accuracy": acc, "eval/accuracy_t1": acc / 2}
        records.append(record)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_row_is_read_from_the_runs_metrics(tmp_path):
    _metrics(tmp_path / "metrics.jsonl", [0.06, 0.10, 0.20, 0.25, 0.30])
    row = moe.summarise("async", str(tmp_path))
    assert row["steps"] == 400 and row["greedy_start"] == 0.06 and row["greedy_end"] == 0.3
    assert row["greedy_last3"] == 0.25 and row["greedy_gain_pts"] == 19.0
    assert row["t1_end"] == 0.15 and row["aux"] == 2.0 and row["s_per_step"] == 0.5
    assert row["curve"] == "0.060 0.100 0.200 0.250 0.300"


def test_a_run_without_evaluations_is_refused(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.0}) + "\n")
    with pytest.raises(SystemExit, match="no evaluation"):
        moe.summarise("sync", str(tmp_path))


@pytest.mark.parametrize(
    "runs, init_from, message",
    [("async,snyc", "", "name runs of async, sync"), ("async", "/nonexistent", "no such")],
)
def test_bad_options_are_refused_before_a_run(tmp_path, runs, init_from, message):
    args = argparse.Namespace(
        runs=runs, init_from=init_from, smoke=True, rl_steps=0, eval_every=0,
        workdir=str(tmp_path),
    )  # fmt: skip
    with pytest.raises(SystemExit, match=message):
        moe.run(args)
    assert not list(tmp_path.iterdir())  # nothing started


def test_lora_tabulates_finished_runs_into_its_result_file(tmp_path):
    """`--full_dir W/full --lora_dir NAME=DIR`: rows of runs already made, written through the
    result schema (JAXRL_BENCH_RESULTS_DIR is the test run's temporary directory)."""
    import os

    for name, accs, pushed in (
        ("full", [0.2, 0.3, 0.4, 0.45], 1000),
        ("lora", [0.2, 0.25, 0.3, 0.36], 18),
    ):
        (tmp_path / name).mkdir()
        _metrics(tmp_path / name / "metrics.jsonl", accs, every=50, pushed=pushed)
    args = argparse.Namespace(
        smoke=False, full_steps=500, lora_steps=0, eval_every=50, out="lora_rows_test",
        full_dir=str(tmp_path / "full"), lora_param=[], lora_name="LoRA",
        lora_dir=[f"LoRA r=4={tmp_path / 'lora'}"], workdir=str(tmp_path / "w"),
    )  # fmt: skip
    full, lora = rl_lora.run(args)
    assert (full["steps_to_gain"], lora["steps_to_gain"]) == (100, 150)
    assert lora["run"] == "LoRA r=4" and lora["push_share"] == "1.80%"
    assert lora["gain_cell"] == "+0.103" and full["seconds_cell"] == ""
    result = json.load(
        open(os.path.join(os.environ["JAXRL_BENCH_RESULTS_DIR"], "lora_rows_test.json"))
    )
    assert [r["run"] for r in result["rows"]] == ["full fine-tuning", "LoRA r=4"]
    assert "lora_steps_le_2x_full': True" in result["note"]


def test_quantized_rows_read_the_mismatch(tmp_path):
    """`python -m bench learning quantized`: gain, reward, mean mismatch KL and truncated
    fraction from a run's records; a full-precision run has no mismatch column value."""
    from bench.learning import quantized

    _metrics(tmp_path / "metrics.jsonl", [0.30, 0.40, 0.45], every=2)  # steps 0-4
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    for r in records:
        r["wall_time_s"] = 10.0 * r["step"]
        if r["step"]:
            r |= {"gen/mismatch_kl": 0.01 * r["step"], "truncated_fraction": 0.5}
    (tmp_path / "q.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "q").mkdir()
    (tmp_path / "q.jsonl").rename(tmp_path / "q" / "metrics.jsonl")
    row = quantized.summarise("int8", "int8", str(tmp_path / "q"))
    assert row["steps"] == 4 and row["greedy_start"] == 0.3 and row["greedy_end"] == 0.45
    assert row["gain_pts"] == 15.0 and row["mismatch_kl"] == 0.025
    assert row["truncated_fraction"] == 0.5 and row["reward_last10"] == 0.1
    (tmp_path / "f").mkdir()
    for r in records:
        r.pop("gen/mismatch_kl", None)
    (tmp_path / "f" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert quantized.summarise("fp32", "fp32", str(tmp_path / "f"))["mismatch_kl"] is None

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
    assert row["eval_curve"] == [[0, 0.3], [2, 0.4], [4, 0.45]]
    (tmp_path / "f").mkdir()
    for r in records:
        r.pop("gen/mismatch_kl", None)
    (tmp_path / "f" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert quantized.summarise("fp32", "fp32", str(tmp_path / "f"))["mismatch_kl"] is None


def _episode_run(path, accuracies, tool_rates, every=2, step_s=60.0):
    """An episodes run's records: evaluations with the tool-call rate, steps with status
    fractions (a quarter of episodes truncated, a tenth of steps malformed)."""
    path.mkdir()
    records = []
    for step in range((len(accuracies) - 1) * every + 1):
        record = {"step": step, "wall_time_s": step_s * step}
        if step:
            # a step that also evaluated takes longer; the median RL step leaves it out
            record |= {"reward/mean": 0.2, "time/step_s": step_s + 100.0 * (step % every == 0)}
            record |= {"episode/done_fraction": 0.75, "episode/truncated_fraction": 0.25}
            record |= {"episode/tool_error_fraction": 0.0, "episode/timeout_fraction": 0.0}
            record["episode/malformed_step_fraction"] = 0.1
        if step % every == 0:
            record["eval/accuracy"] = accuracies[step // every]
            if tool_rates:
                record["eval/tool_call_rate"] = tool_rates[step // every]
        records.append(record)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_tool_use_rows_read_tool_rate_statuses_and_the_verdicts(tmp_path):
    """`python -m bench learning calc-smollm2`: tool-call rate and accuracy at the start and
    the end (last 2 evaluations), how episodes ended, and issue 55's verdicts."""
    from bench.learning import calc_smollm2 as calc

    _episode_run(tmp_path / "rl", [0.10, 0.30, 0.40, 0.44], [0.5, 0.8, 0.9, 0.9])
    _episode_run(tmp_path / "single_turn", [0.02, 0.02, 0.03, 0.03], None)
    _episode_run(tmp_path / "fixed_lag", [0.10, 0.25, 0.30, 0.34], [0.5, 0.7, 0.8, 0.85],
                 step_s=45.0)  # fmt: skip
    _episode_run(tmp_path / "streaming", [0.10, 0.30, 0.38, 0.42], [0.5, 0.8, 0.9, 0.9])
    names = ("rl", "single_turn", "fixed_lag", "streaming")
    rows = {n: calc.summarise(n, n, str(tmp_path / n)) for n in names}
    rl = rows["rl"]
    assert (rl["steps"], rl["acc_start"], rl["acc_end"], rl["gain_pts"]) == (6, 0.1, 0.42, 32.0)
    assert (rl["tool_start"], rl["tool_end"], rl["tool_2h"]) == (0.5, 0.9, 0.9)
    assert (rl["done"], rl["truncated"], rl["malformed_step"]) == (0.75, 0.25, 0.1)
    assert "tool_start" not in rows["single_turn"] and rows["single_turn"]["gain_pts"] == 1.0
    verdict = calc.verdicts(rows)
    assert verdict["rl_tool_rate_ge_80_within_2h"] and verdict["rl_gain_ge_25_within_2h"]
    assert verdict["single_turn_gains_less"]
    assert verdict["fixed_lag_within_5_pts_of_sync"] is False  # 32% against 42%
    assert verdict["streaming_within_5_pts_of_sync"] is True  # 40% against 42%
    assert (rl["step_s_median"], rows["fixed_lag"]["step_s_median"]) == (60.0, 45.0)
    assert verdict["fixed_lag_step_s_over_sync"] == 0.75
    assert "tool_disabled_gains_less" not in verdict  # no such run: no verdict


def test_the_mismatch_kl_is_compared_paired_by_step(tmp_path):
    """`bench learning quantized`: the control's mismatch KL minus the corrected run's, step by
    step (the prompts' variance cancels): a control whose KL grows shows in the second half."""
    from bench.learning import quantized

    for name, extra in (("int8", lambda s: 0.0), ("uncorrected", lambda s: 0.001 * s)):
        (tmp_path / name).mkdir()
        records = [{"step": s, "gen/mismatch_kl": 0.04 + 0.01 * (s % 3) + extra(s)}
                   for s in range(1, 9)]  # fmt: skip
        text = "".join(json.dumps(r) + "\n" for r in records)
        (tmp_path / name / "metrics.jsonl").write_text(text)
    out = quantized.paired_kl(str(tmp_path / "int8"), str(tmp_path / "uncorrected"))
    assert out["paired_steps"] == 8
    assert out["all"]["mean_diff"] == pytest.approx(0.0045)  # mean of 0.001 * (1..8)
    assert out["second_half"]["mean_diff"] == pytest.approx(0.0065)  # steps 5..8
    assert out["b_second_half"] - out["a_second_half"] == pytest.approx(0.0065, abs=1e-6)
    assert out["a_first_half"] == pytest.approx((0.05 + 0.06 + 0.04 + 0.05) / 4)
    same = quantized.paired_kl(str(tmp_path / "int8"), str(tmp_path / "int8"))
    assert same["all"] == {"mean_diff": 0.0, "se": 0.0, "t": None}  # no spread: no t, no crash
    (tmp_path / "short").mkdir()  # fewer than 4 steps in common: no comparison
    (tmp_path / "short" / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "gen/mismatch_kl": 0.1}) + "\n" for s in (1, 2, 3))
    )
    assert quantized.paired_kl(str(tmp_path / "int8"), str(tmp_path / "short")) == {}


def test_a_run_keeps_its_colour_in_panels_where_an_earlier_run_is_missing(tmp_path, monkeypatch):
    """`runner.plot_curves`: a single-turn run has no tool-call rate; the runs after it keep
    the colour they have in the other panels (one colour per run, not per panel's cycle)."""
    import matplotlib.figure

    from bench.learning import runner

    _episode_run(tmp_path / "single_turn", [0.02, 0.03], None)
    _episode_run(tmp_path / "rl", [0.1, 0.4], [0.5, 0.9])
    figures = []
    monkeypatch.setattr(
        matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: figures.append(fig)
    )
    runs = {"single": str(tmp_path / "single_turn"), "rl": str(tmp_path / "rl")}
    panels = [("eval/accuracy", "accuracy"), ("eval/tool_call_rate", "tool-call rate")]
    runner.plot_curves(runs, str(tmp_path / "p.png"), panels)
    accuracy, tool_rate = figures[0].axes[:2]
    colours = {line.get_label(): line.get_color() for line in accuracy.lines}
    assert [line.get_label() for line in tool_rate.lines] == ["rl"]
    assert tool_rate.lines[0].get_color() == colours["rl"] != colours["single"]


def test_pairs_pool_over_seeds(tmp_path, monkeypatch):
    """`bench learning quantized --pool`: per seed the control's gain, mean held-out accuracy
    after step 0 and mean mismatch KL minus the corrected run's; pooled, mean, se and t over
    the seeds; a results file without evaluation curves is refused with the fix."""
    from bench.learning import quantized

    monkeypatch.setattr("bench.common.RESULTS_DIR", str(tmp_path))

    def results(name, corrected, control, kls):
        rows = [{"name": n, "steps": 100, "gain_pts": round(100 * (c[-1] - c[0]), 1),
                 "mismatch_kl": kl, "reward_last10": c[-1],
                 "eval_curve": [[25 * i, a] for i, a in enumerate(c)]}
                for n, c, kl in (("int5", corrected, kls[0]),
                                 ("int5_uncorrected", control, kls[1]))]  # fmt: skip
        (tmp_path / f"{name}.json").write_text(json.dumps({"rows": rows}))

    results("s0", [0.3, 0.5, 0.6], [0.3, 0.46, 0.56], (0.28, 0.27))  # control 4 pts below
    results("s1", [0.3, 0.5, 0.6], [0.3, 0.48, 0.58], (0.30, 0.31))  # 2 below
    rows = quantized.pool(["s0", "s1"])
    assert [r["results"] for r in rows] == ["s0", "s1", "pooled over 2 seeds"]
    assert rows[0]["gain_diff_pts"] == -4.0 and rows[0]["eval_diff_pts"] == pytest.approx(-4.0)
    assert rows[1]["eval_diff_pts"] == pytest.approx(-2.0)
    assert rows[0]["kl_diff"] == pytest.approx(-0.01) and rows[0]["evals_after_0"] == 2
    pooled = rows[2]
    assert pooled["pair"] == "int5_uncorrected - int5"
    assert pooled["eval_diff_pts"] == pytest.approx(-3.0)
    assert pooled["eval_diff_pts_se"] == pytest.approx(1.0)  # stdev(-4, -2) / sqrt(2)
    assert pooled["eval_diff_pts_t"] == pytest.approx(-3.0)
    assert pooled["kl_diff"] == pytest.approx(0.0, abs=1e-9)
    assert rows[0]["reward_last10_diff"] == pytest.approx(-0.04)
    assert pooled["reward_last10_diff"] == pytest.approx(-0.03)
    (tmp_path / "old.json").write_text(
        json.dumps(
            {
                "rows": [
                    {"name": "int5", "gain_pts": 1.0},
                    {"name": "int5_uncorrected", "gain_pts": 0.0},
                ]
            }
        )
    )
    with pytest.raises(SystemExit, match="old.json has no eval_curve.*--no_launch"):
        quantized.pool(["old"])

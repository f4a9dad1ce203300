"""The speed-up model's arithmetic (`bench.scale`): roofline and the sync / async step."""

import pytest

from bench.scale import StepPrediction, predict_bench_rl, roofline


def test_roofline_takes_the_slower_bound():
    assert roofline(2e9, 1e6, 1e9, 1e9) == pytest.approx(2.0)  # compute bound
    assert roofline(1e6, 3e9, 1e9, 1e9) == pytest.approx(3.0)  # memory bound


def test_step_prediction_sync_and_async():
    costs = {
        "train": (4e9, 1.0),
        "prefill": (1e9, 1.0),
        "decode": (1e8, 1.0),
        "new_tokens": (11, 11),
    }
    pred, parts = predict_bench_rl(costs, peak_flops=1e9, bandwidth=1e12, sync_s=0.5)
    assert parts == pytest.approx({"train": 4.0, "prefill": 1.0, "decode": 0.1})
    assert pred.generate_s == pytest.approx(1.0 + 10 * 0.1)  # first token from the prefill
    assert pred.sync_step_s == pytest.approx(6.0)
    assert pred.async_step_s == pytest.approx(4.5)  # max(Tg, Tt + Ts)
    assert StepPrediction(3.0, 1.0).speedup == pytest.approx(4.0 / 3.0)

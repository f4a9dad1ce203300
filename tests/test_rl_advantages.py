"""Group-baseline advantages vs a per-group NumPy loop."""

import numpy as np
import pytest

from jaxrl.rl.advantages import group_advantages, make_advantage_estimator

EPS = 1e-6


def numpy_advantages(rewards, groups, valid, baseline, scale_by_std):
    out = np.zeros(len(rewards), np.float64)
    for g in set(groups[valid].tolist()):
        members = np.flatnonzero((groups == g) & valid)
        r = rewards[members].astype(np.float64)
        n = len(r)
        for i, row in enumerate(members):
            if baseline == "mean":
                a = r[i] - r.mean()
            else:
                a = r[i] - np.delete(r, i).mean() if n > 1 else 0.0
            if scale_by_std:
                a = a / (r.std() + EPS)
            out[row] = a
    return out


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(1)
    # Non-contiguous, large group ids; groups of 4, 3, 1 and an all-equal group of 2; two
    # invalid (bucket-filling) rows, one of which shares an id with a real group.
    groups = np.array([1000, 7, 1000, 7, 42, 1000, 7, 1000, 5, 5, -1, 42], np.int32)
    valid = np.array([True] * 10 + [False, False])
    rewards = rng.normal(size=groups.shape).astype(np.float32)
    rewards[8:10] = 0.5
    rewards[10:] = 100.0  # must not leak into any baseline
    return rewards, groups, valid


@pytest.mark.parametrize("baseline", ["mean", "leave_one_out"])
@pytest.mark.parametrize("scale_by_std", [False, True])
def test_group_advantages_match_numpy(batch, baseline, scale_by_std):
    rewards, groups, valid = batch
    got = group_advantages(
        rewards, groups, valid_b=valid, baseline=baseline, scale_by_std=scale_by_std, eps=EPS
    )
    want = numpy_advantages(rewards, groups, valid, baseline, scale_by_std)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert np.all(np.asarray(got)[~valid] == 0.0)
    assert np.all(np.asarray(got)[8:10] == 0.0)  # equal rewards: no signal
    assert got[4] == 0.0  # a singleton group has no baseline to compare with


def test_binary_rewards_known_values():
    # Two groups of 4 with 0/1 rewards, the arithmetic-task case; values worked out by hand.
    rewards = np.array([1, 0, 0, 0, 1, 1, 0, 1], np.float32)
    groups = np.array([0, 0, 0, 0, 1, 1, 1, 1], np.int32)
    np.testing.assert_allclose(
        group_advantages(rewards, groups), [0.75, -0.25, -0.25, -0.25, 0.25, 0.25, -0.75, 0.25]
    )
    np.testing.assert_allclose(
        group_advantages(rewards, groups, baseline="leave_one_out"),
        [1.0, -1 / 3, -1 / 3, -1 / 3, 1 / 3, 1 / 3, -1.0, 1 / 3],
        rtol=1e-6,
    )
    std = np.sqrt(3) / 4  # std of {1, 0, 0, 0}
    np.testing.assert_allclose(
        group_advantages(rewards, groups, scale_by_std=True, eps=EPS)[:2],
        [0.75 / (std + EPS), -0.25 / (std + EPS)],
        rtol=1e-6,
    )


def test_registry(batch):
    rewards, groups, valid = batch
    grpo = make_advantage_estimator("group_mean_std", eps=EPS)
    np.testing.assert_allclose(
        grpo(rewards, groups, valid),
        numpy_advantages(rewards, groups, valid, "mean", True),
        rtol=1e-6,
        atol=1e-6,
    )
    rloo = make_advantage_estimator("leave_one_out")
    np.testing.assert_allclose(
        rloo(rewards, groups, valid),
        numpy_advantages(rewards, groups, valid, "leave_one_out", False),
        rtol=1e-6,
        atol=1e-6,
    )
    assert make_advantage_estimator("group_mean").scale_by_std is False
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        make_advantage_estimator("gae")
    with pytest.raises(ValueError, match="eps"):
        make_advantage_estimator("group_mean_std", eps=0.0)
    with pytest.raises(TypeError, match="group_mean"):
        make_advantage_estimator("group_mean", rho=4.0)
    with pytest.raises(ValueError, match="baseline"):
        group_advantages(rewards, groups, baseline="median")

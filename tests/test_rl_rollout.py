"""Rollout records: collation into fixed shapes, teacher-forcing layout, pytree behaviour."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.rl.advantages import group_advantages
from jaxrl.rl.rollout import Rollout, RolloutBatch, collate_rollouts, select_groups

PAD = 0


def make_rollouts():
    return [
        Rollout(np.array([5, 6, 7]), np.array([8, 9, 2]), np.array([-0.1, -0.2, -0.3]), 3, 1.0, 11),
        Rollout(np.array([5]), np.array([2]), np.array([-0.5]), 2, 0.0, 11),
        Rollout(np.array([6, 6]), np.array([7, 7, 7, 2]), np.full(4, -1.0), 3, 1.0, 4),
    ]


def test_collate_layout():
    batch = collate_rollouts(
        make_rollouts(), prompt_len=4, completion_len=5, pad_id=PAD, batch_size=4
    )
    assert (batch.batch_size, batch.prompt_len, batch.completion_len) == (4, 4, 5)
    np.testing.assert_array_equal(
        batch.prompt_ids_bp, [[0, 5, 6, 7], [0, 0, 0, 5], [0, 0, 6, 6], [0, 0, 0, 0]]
    )
    np.testing.assert_array_equal(batch.prompt_mask_bp, np.asarray(batch.prompt_ids_bp) != 0)
    np.testing.assert_array_equal(
        batch.completion_ids_bt,
        [[8, 9, 2, 0, 0], [2, 0, 0, 0, 0], [7, 7, 7, 2, 0], [0, 0, 0, 0, 0]],
    )
    np.testing.assert_array_equal(batch.completion_mask_bt.sum(1), [3, 1, 4, 0])
    np.testing.assert_allclose(batch.behaviour_logprobs_bt[0], [-0.1, -0.2, -0.3, 0, 0], rtol=1e-7)
    np.testing.assert_array_equal(batch.group_id_b, [11, 11, 4, -1])
    np.testing.assert_array_equal(batch.valid_b, [True, True, True, False])
    np.testing.assert_array_equal(batch.policy_version_b, [3, 2, 3, 0])
    assert batch.reward_b.dtype == np.float32 and batch.behaviour_logprobs_bt.dtype == np.float32


def test_sequence_and_completion_hidden_alignment():
    batch = collate_rollouts(make_rollouts(), prompt_len=4, completion_len=5, pad_id=PAD)
    tokens_bs, mask_bs, positions_bs = batch.sequence()
    assert tokens_bs.shape == mask_bs.shape == positions_bs.shape == (3, 9)
    np.testing.assert_array_equal(tokens_bs[0], [0, 5, 6, 7, 8, 9, 2, 0, 0])
    # Real tokens are numbered from 0 whatever the left padding.
    np.testing.assert_array_equal(positions_bs[1][mask_bs[1]], [0, 1])
    np.testing.assert_array_equal(positions_bs[2][mask_bs[2]], np.arange(6))
    # With "hidden state" = the input token, the state predicting completion token t is the
    # token just before it: the last prompt token, then the completion shifted by one.
    hidden_bsd = tokens_bs[..., None]
    prev_bt = batch.completion_hidden(hidden_bsd)[..., 0]
    np.testing.assert_array_equal(prev_bt[:, 0], [7, 5, 6])
    np.testing.assert_array_equal(prev_bt[:, 1:], np.asarray(batch.completion_ids_bt)[:, :-1])


def test_batch_is_a_pytree_usable_under_jit():
    batch = collate_rollouts(
        make_rollouts(), prompt_len=4, completion_len=5, pad_id=PAD, batch_size=4
    )
    assert len(jax.tree.leaves(batch)) == 10

    @jax.jit
    def advantages(b: RolloutBatch):
        return group_advantages(b.reward_b, b.group_id_b, valid_b=b.valid_b)

    np.testing.assert_allclose(advantages(jax.tree.map(jnp.asarray, batch)), [0.5, -0.5, 0.0, 0.0])


def test_collate_rejects_what_does_not_fit():
    rollouts = make_rollouts()
    with pytest.raises(ValueError, match="larger bucket"):
        collate_rollouts(rollouts, prompt_len=2, completion_len=5, pad_id=PAD)
    with pytest.raises(ValueError, match="larger bucket"):
        collate_rollouts(rollouts, prompt_len=4, completion_len=3, pad_id=PAD)
    with pytest.raises(ValueError, match="batch_size"):
        collate_rollouts(rollouts, prompt_len=4, completion_len=5, pad_id=PAD, batch_size=2)
    with pytest.raises(ValueError, match="behaviour log-probs"):
        Rollout(np.array([1]), np.array([2, 3]), np.array([-1.0]), 0, 0.0, 0)


def _group(group_id, rewards):
    return [
        Rollout(np.array([group_id + 3]), np.array([2]), np.array([-0.5]), 0, r, group_id)
        for r in rewards
    ]


def test_select_groups_keeps_groups_with_a_reward_spread_first_in_sampling_order():
    groups = {
        0: [0.0, 0.0],  # all wrong: zero advantage
        1: [1.0, 0.0],
        2: [1.0, 1.0],  # all right: zero advantage
        3: [0.0, 1.0],
        4: [0.0, 0.0],
    }
    rollouts = [r for g, rewards in groups.items() for r in _group(g, rewards)]
    kept, metrics = select_groups(rollouts, 2)
    assert [r.group_id for r in kept] == [1, 1, 3, 3]
    assert metrics == {"data/informative_groups": 2 / 5, "data/informative_trained": 1.0}
    # Too few informative groups: the batch is filled with the first uninformative ones, and
    # the order of the rows stays the sampling order.
    kept, metrics = select_groups(rollouts, 3)
    assert [r.group_id for r in kept] == [0, 0, 1, 1, 3, 3]
    assert metrics["data/informative_trained"] == pytest.approx(2 / 3)
    # Group-relative advantages of the kept informative groups are non-zero on every row.
    kept, _ = select_groups(rollouts, 2)
    advantages = group_advantages(
        jnp.array([r.reward for r in kept]), jnp.array([r.group_id for r in kept])
    )
    assert np.all(np.abs(np.asarray(advantages)) > 0.1)
    with pytest.raises(ValueError, match="asked for 6 groups out of 5"):
        select_groups(rollouts, 6)

"""Routing replay's record (issue 53 point 3): a mixture-of-experts generator's top-k expert ids,
per position and layer, travel with each rollout (`Rollout.routing`) wherever rollouts travel,
into the trainer's batch (`RolloutBatch.routing_bslk`, `PackedRolloutBatch.routing_rllk`).

Synthetic records (no engine): every expectation is computed here from the rollouts themselves
(positions found through the batch's own masks / the packed batch's predict indices), so a record
put in the wrong column, dropped or altered on the way fails.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import zlib
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from jaxrl.generation.engine_requests import GroupResult
from jaxrl.generation.sampler import SampleOutput
from jaxrl.infra.checkpoint import CheckpointConfig, Checkpointer
from jaxrl.loop.config import RLConfig
from jaxrl.loop.feeds.lagged import LaggedFeed, restore_queue
from jaxrl.loop.feeds.remote import _Fetcher
from jaxrl.loop.feeds.streaming import PromptGroups
from jaxrl.loop.reward import RewardExecutor
from jaxrl.loop.rollout_channel import RolloutChannel
from jaxrl.loop.rollout_queue import (
    GroupQueue,
    RolloutQueue,
    ScoredBatch,
    decode_routing,
    encode_routing,
)
from jaxrl.rl import Rollout, collate_rollouts, rollouts_from_samples, select_groups
from jaxrl.rl.packing import pack_rollout_batch
from jaxrl.tasks import PromptItem

LAYERS, TOP_K, EXPERTS = 3, 2, 8


def _record(rng, n: int, experts: int = EXPERTS) -> np.ndarray:
    """A synthetic routing record `[n, LAYERS, TOP_K]`: distinct-looking ids, a few -1."""
    record = rng.integers(0, experts, size=(n, LAYERS, TOP_K)).astype(np.int16)
    record[rng.random(record.shape) < 0.1] = -1
    return record


def _rollout(rng, prompt, t: int, group: int, routing=True, prompt_record=None, **kw) -> Rollout:
    prompt = np.asarray(prompt, np.int32)
    record = _record(rng, len(prompt) + t)
    if prompt_record is not None:  # the group's shared prefill
        record[: len(prompt)] = prompt_record
    return Rollout(
        prompt_ids=prompt,
        completion_ids=rng.integers(3, 50, size=t).astype(np.int32),
        behaviour_logprobs=-rng.random(t).astype(np.float32),
        policy_version=kw.pop("policy_version", 0),
        reward=float(rng.integers(0, 2)),
        group_id=group,
        routing=record if routing else None,
        **kw,
    )


def _group(rng, prompt, lengths, group: int) -> list[Rollout]:
    """G samples of one prompt, sharing its prompt's record (the engine prefills it once)."""
    shared = _record(rng, len(prompt))
    return [_rollout(rng, prompt, t, group, prompt_record=shared) for t in lengths]


def _assert_same_rollouts(got: list[Rollout], want: list[Rollout]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        for name in ("prompt_ids", "completion_ids", "behaviour_logprobs", "routing"):
            x, y = getattr(a, name), getattr(b, name)
            assert x.dtype == y.dtype, name
            np.testing.assert_array_equal(x, y, err_msg=name)
        assert (a.reward, a.group_id, a.policy_version) == (b.reward, b.group_id, b.policy_version)


# --- Rollout and the padded batch ---------------------------------------------------------------


def test_collate_places_each_record_at_its_token_column():
    rng = np.random.default_rng(0)
    rollouts = [
        _rollout(rng, [5, 6, 7], 4, 0),
        _rollout(rng, [8], 6, 0),
        _rollout(rng, [9, 10, 11, 12, 13], 1, 1),
    ]
    # A marker value at prompt position j = 1 / completion position t = 2 of rollout 0.
    rollouts[0].routing[1, 2, 1] = 1001
    rollouts[0].routing[3 + 2, 0, 0] = 2002
    p_len, t_len = 6, 7
    batch = collate_rollouts(
        rollouts, prompt_len=p_len, completion_len=t_len, pad_id=0, batch_size=4
    )
    routing = batch.routing_bslk
    assert routing.dtype == np.int16 and routing.shape == (4, p_len + t_len, LAYERS, TOP_K)
    # Left-padded prompt of 3 in 6 columns: position 1 is column 6 - 3 + 1; completion t = 2 is
    # column 6 + 2.
    assert routing[0, p_len - 3 + 1, 2, 1] == 1001 and routing[0, p_len + 2, 0, 0] == 2002
    # Every present column of `sequence()` (in order) holds the rollout's record, position by
    # position, and the token there is the one the record belongs to; the rest is -1.
    tokens_bs, mask_bs, positions_bs = (np.asarray(x) for x in batch.sequence())
    for i, r in enumerate(rollouts):
        columns = np.flatnonzero(mask_bs[i])
        np.testing.assert_array_equal(routing[i, columns], r.routing)
        np.testing.assert_array_equal(positions_bs[i, columns], np.arange(len(r.routing)))
        np.testing.assert_array_equal(
            tokens_bs[i, columns], np.concatenate([r.prompt_ids, r.completion_ids])
        )
    assert (routing[~mask_bs] == -1).all()
    assert (routing[3] == -1).all()  # the row that only fills the bucket


def test_rollout_refuses_a_record_of_the_wrong_length_and_converts_to_int16():
    rng = np.random.default_rng(1)
    good = _rollout(rng, [1, 2], 3, 0)
    with pytest.raises(ValueError, match=r"expected integers \[5, num_layers, top_k\]"):
        dataclasses.replace(good, routing=good.routing[:4])
    with pytest.raises(ValueError, match="routing_b"):
        dataclasses.replace(good, routing=good.routing[:, 0])
    widened = dataclasses.replace(good, routing=good.routing.astype(np.int64))
    assert widened.routing.dtype == np.int16
    np.testing.assert_array_equal(widened.routing, good.routing)


def test_a_batch_mixing_routed_and_unrouted_rollouts_is_refused():
    rng = np.random.default_rng(2)
    rollouts = [_rollout(rng, [1, 2], 3, 0), _rollout(rng, [1, 2], 2, 0, routing=False)]
    with pytest.raises(ValueError, match=r"1 of 2 rollouts carry a routing record \(rollout 1"):
        collate_rollouts(rollouts, prompt_len=4, completion_len=4, pad_id=0)


def test_dense_rollouts_make_the_batches_they_always_made():
    """No record: the field is None, so the pytrees (and the programs traced from them) have
    the leaves they had before routing existed."""
    rng = np.random.default_rng(3)
    rollouts = [_rollout(rng, [4, 5, 6], t, 0, routing=False) for t in (2, 3, 1)]
    batch = collate_rollouts(rollouts, prompt_len=4, completion_len=4, pad_id=0, batch_size=4)
    assert batch.routing_bslk is None and len(jax.tree.leaves(batch)) == 10
    for share in (False, True):
        packed = pack_rollout_batch(batch, 16, groups=2, share_prompts=share)
        assert packed.routing_rllk is None and len(jax.tree.leaves(packed)) == 12


def test_rollouts_from_samples_and_the_reward_executor_carry_the_records():
    rng = np.random.default_rng(4)
    prompts = [[1, 2, 3], [4, 5]]
    lengths = np.array([2, 4])
    mask = np.arange(5)[None] < lengths[:, None]
    records = tuple(_record(rng, len(p) + n) for p, n in zip(prompts, lengths, strict=True))
    samples = SampleOutput(
        tokens_bn=rng.integers(3, 50, size=(2, 5)).astype(np.int32),
        logprobs_bn=np.where(mask, -0.5, 0.0).astype(np.float32),
        mask_bn=mask,
        routing_b=records,
    )
    rollouts = rollouts_from_samples(prompts, samples, [1.0, 0.0], [0, 0])
    for r, record in zip(rollouts, records, strict=True):
        np.testing.assert_array_equal(r.routing, record)
    # The reward executor reads a generated batch's `routing` (one record per row).
    tokenizer = SimpleNamespace(
        batch_decode=lambda ids, skip_special_tokens: [" ".join(map(str, x)) for x in ids]
    )
    generated = SimpleNamespace(
        items=[PromptItem("q", "a")] * 2,
        prompt_ids=prompts,
        completion_ids=[r.completion_ids for r in rollouts],
        behaviour_logprobs=[r.behaviour_logprobs for r in rollouts],
        group_ids=np.array([0, 0]),
        policy_version=3,
        batch_index=0,
        routing=records,
        metrics={},
    )
    scored, _ = RewardExecutor(lambda p, c, r: [1.0] * len(c), tokenizer).score(generated)
    for r, record in zip(scored, records, strict=True):
        np.testing.assert_array_equal(r.routing, record)
    kept, _ = select_groups(scored + [_rollout(rng, [7], 2, 1)], 1)  # dynamic sampling
    assert kept[0].routing is scored[0].routing


# --- packing ----------------------------------------------------------------------------------


def _expected_packed(batch, packed, rollouts, groups: int, shared: bool) -> np.ndarray:
    """The packed record built from the rollouts and the packed batch's predict indices: a
    rollout's completion token t sits at flat index `predict[t + 1]` (t + 1 < T) or
    `predict[t] + 1` (t > 0), its prompt ends at `predict[0]`."""
    tokens = np.asarray(packed.tokens_rl)
    rows, length = tokens.shape
    per_group_rows, per_group_b = rows // groups, len(batch.valid_b) // groups
    want = np.full((rows, length, LAYERS, TOP_K), -1, np.int16)
    flat_want = want.reshape(groups, per_group_rows * length, LAYERS, TOP_K)
    flat_tokens = tokens.reshape(groups, per_group_rows * length)
    predict = np.asarray(packed.predict_index_bt)
    for i, r in enumerate(rollouts):
        g, p, t = i // per_group_b, len(r.prompt_ids), len(r.completion_ids)
        index = predict[i]
        if shared:
            assert t >= 2, "a shared completion's first column is read from predict[1]"
            completion_at = np.concatenate([[index[1]], index[1:t] + 1])
        else:
            completion_at = index[:t] + 1
        prompt_at = index[0] - p + 1 + np.arange(p)
        np.testing.assert_array_equal(flat_tokens[g, completion_at], r.completion_ids)
        np.testing.assert_array_equal(flat_tokens[g, prompt_at], r.prompt_ids)
        flat_want[g, completion_at] = r.routing[p:]
        flat_want[g, prompt_at] = r.routing[:p]
    return want


def test_plain_packing_carries_each_record_to_its_packed_column():
    rng = np.random.default_rng(5)
    rollouts = [
        _rollout(rng, [1, 2, 3], 4, 0),
        _rollout(rng, [4, 5], 2, 0),
        _rollout(rng, [6], 5, 1),
        _rollout(rng, [7, 8, 9, 10], 1, 1),
        _rollout(rng, [11, 12], 3, 2),
        _rollout(rng, [13, 14, 15], 2, 2),
    ]
    batch = collate_rollouts(rollouts, prompt_len=4, completion_len=5, pad_id=0, batch_size=8)
    packed = pack_rollout_batch(batch, 12, groups=2)
    want = _expected_packed(batch, packed, rollouts, groups=2, shared=False)
    assert packed.routing_rllk.dtype == np.int16
    np.testing.assert_array_equal(packed.routing_rllk, want)
    assert (packed.routing_rllk[np.asarray(packed.segment_rl) == 0] == -1).all()


def test_shared_prompt_packing_lays_each_prompt_record_once_per_unit():
    rng = np.random.default_rng(6)
    prompt = [21, 22, 23]
    group_a = _group(rng, prompt, [4, 2, 3], 0)  # split over two units by the row length
    group_b = _group(rng, prompt, [2, 3], 1)  # the same prompt, another request's record
    group_c = _group(rng, [31, 32], [4, 2, 2], 2)  # 2 + 4 + 2 + 2: one row
    rollouts = group_a + group_b + group_c
    batch = collate_rollouts(rollouts, prompt_len=4, completion_len=5, pad_id=0, batch_size=8)
    packed = pack_rollout_batch(batch, 10, groups=1, share_prompts=True)
    want = _expected_packed(batch, packed, rollouts, groups=1, shared=True)
    np.testing.assert_array_equal(packed.routing_rllk, want)
    # Prompt copies: group a twice (3 + 4 + 2 then 3 + 3 in rows of 10), b once, c once.
    starts = np.asarray(packed.positions_rl) == 0
    segment, prefix = np.asarray(packed.segment_rl), np.asarray(packed.prefix_rl)
    assert int((starts & (segment > 0) & (segment == prefix)).sum()) == 4
    # Without records the layout is the one a dense batch always had; with records that agree
    # per prompt it is the same layout (only the different record of group b splits it off).
    same_prompt_records = [dataclasses.replace(r, routing=None) for r in group_a + group_c]
    dense = collate_rollouts(same_prompt_records, prompt_len=4, completion_len=5, pad_id=0)
    routed = collate_rollouts(group_a + group_c, prompt_len=4, completion_len=5, pad_id=0)
    a = pack_rollout_batch(dense, 10, share_prompts=True)
    b = pack_rollout_batch(routed, 10, share_prompts=True)
    for name in ("tokens_rl", "segment_rl", "prefix_rl", "positions_rl", "predict_index_bt"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)


# --- the queue, its JSON, the channel, the checkpoint -------------------------------------------


def _scored_batch(seed: int, index: int = 0, experts: int = EXPERTS) -> ScoredBatch:
    rng = np.random.default_rng(seed)
    rollouts = _group(rng, [1, 2, 3], [3, 1], 0) + _group(rng, [4, 5], [2, 4], 1)
    if experts > 255:  # ids that need int16 in the JSON
        rollouts = [
            dataclasses.replace(r, routing=_record(rng, len(r.routing), experts)) for r in rollouts
        ]
    versions = [np.full(len(r.completion_ids), 2, np.int32) for r in rollouts]
    rollouts = [
        dataclasses.replace(r, token_versions=v, policy_version=2)
        for r, v in zip(rollouts, versions, strict=True)
    ]
    return ScoredBatch(index, 2, rollouts, {"reward/mean": 0.5})


@pytest.mark.parametrize("experts", [EXPERTS, 300])
def test_queue_json_round_trip_is_bit_exact_and_compact(experts):
    batch = _scored_batch(7, experts=experts)
    text = json.dumps(batch.to_json())
    back = ScoredBatch.from_json(json.loads(text))
    _assert_same_rollouts(back.rollouts, batch.rollouts)
    for a, b in zip(back.rollouts, batch.rollouts, strict=True):
        np.testing.assert_array_equal(a.token_versions, b.token_versions)
    stored = json.loads(text)["rollouts"][0]["routing"]
    assert stored["encoding"] == ("uint8+1" if experts <= 255 else "int16le")
    assert isinstance(stored["data"], str)
    # Under 2 bytes of JSON per record entry even with int16 ids (a list takes ~3 or more).
    entries = sum(r.routing.size for r in batch.rollouts)
    routing_chars = sum(len(r["routing"]["data"]) for r in json.loads(text)["rollouts"])
    assert routing_chars < (2 if experts <= 255 else 3) * entries
    edge = np.array([[[-1, 0]], [[254, 7]]], np.int16)
    np.testing.assert_array_equal(decode_routing(encode_routing(edge)), edge)


class _FakeKeyValueStore:
    """The coordination service's key-value calls `RolloutChannel` makes."""

    def __init__(self):
        self.values, self.lock = {}, threading.Lock()

    def key_value_set_bytes(self, key, value):
        with self.lock:
            self.values[key] = bytes(value)

    def key_value_try_get_bytes(self, key):
        with self.lock:
            return self.values.get(key)

    def blocking_key_value_get_bytes(self, key, timeout_ms):
        with self.lock:
            if key in self.values:
                return self.values[key]
        raise jax.errors.JaxRuntimeError("DEADLINE_EXCEEDED")

    def key_value_delete(self, key):
        with self.lock:
            self.values.pop(key, None)


def test_remote_feed_carries_records_from_the_generator_to_the_trainer_queue():
    channel = RolloutChannel.__new__(RolloutChannel)
    channel.client, channel.timeout_s = _FakeKeyValueStore(), 5.0
    sent = [_scored_batch(8, index=0), _scored_batch(9, index=1)]
    for batch in sent:  # the generator side (`roles.serve_batches`) sends each batch
        channel.send(batch)
    blob = json.loads(zlib.decompress(channel.client.values["jaxrl_roles/batch/0"]))
    assert "routing" in blob["rollouts"][0]
    queue = RolloutQueue(capacity=2, max_staleness=10)
    feed = SimpleNamespace(
        config=SimpleNamespace(total_steps=2, stall_timeout_s=5.0), lead=True, channel=channel
    )
    fetcher = _Fetcher(feed, queue, first_index=0)  # the trainer's side of the role split
    fetcher.start()
    for want in sent:
        got, _ = queue.get(timeout=5.0)
        assert got.batch_index == want.batch_index
        _assert_same_rollouts(got.rollouts, want.rollouts)
    fetcher.stop()


def test_streaming_turns_an_engine_group_result_into_routed_rollouts():
    rng = np.random.default_rng(10)
    prompt, lengths = (3, 4, 5), np.array([2, 4, 1])
    n = 5
    mask = np.arange(n)[None] < lengths[:, None]
    records = tuple(_record(rng, len(prompt) + t) for t in lengths)
    group = GroupResult(  # the engine's result of a request of 3 samples
        request_id=17,
        prompt=prompt,
        tokens_gn=rng.integers(3, 50, size=(3, n)).astype(np.int32),
        logprobs_gn=np.where(mask, -0.25, 0.0).astype(np.float32),
        mask_gn=mask,
        versions_gn=np.where(mask, 4, -1).astype(np.int32),
        routing_g=records,
    )
    tokenizer = SimpleNamespace(
        batch_decode=lambda ids, skip_special_tokens: [" ".join(map(str, x)) for x in ids]
    )
    controller = SimpleNamespace(
        source=SimpleNamespace(item=lambda i: PromptItem(f"q{i}", "a")),
        rewarder=RewardExecutor(lambda p, c, r: [0.0] * len(c), tokenizer),
        generator=SimpleNamespace(scorer=None),  # native weights: no mismatch to score
    )
    scored = PromptGroups(controller, engine=None)._score(group)
    assert scored.batch_index == 17 and scored.policy_version == 4
    for g, r in enumerate(scored.rollouts):
        np.testing.assert_array_equal(r.routing, records[g])
        np.testing.assert_array_equal(r.completion_ids, group.tokens_gn[g, : lengths[g]])
    dense = dataclasses.replace(group, routing_g=None)
    assert all(r.routing is None for r in PromptGroups(controller, None)._score(dense).rollouts)


def test_checkpoint_keeps_the_records_of_queued_batches_and_groups(tmp_path):
    config = RLConfig(mode="async", schedule="free_running", queue_size=2, max_staleness=4)
    queued = [_scored_batch(11, index=3), _scored_batch(12, index=4)]
    queue = RolloutQueue(2, 4, trainer_version=2, next_index=3)
    for batch in queued:
        queue.put(batch)
    feed = SimpleNamespace(config=config, queue=queue, source=SimpleNamespace(version=2))
    groups = GroupQueue(4, 4, trainer_version=2, next_prompt=0)
    streamed = [_scored_batch(13 + i, index=i) for i in range(2)]
    for g in streamed:
        groups.issue()
        groups.put(g)
    extra = {"lagged": LaggedFeed.snapshot(feed, 2), "streaming": groups.snapshot()}
    with Checkpointer(
        tmp_path / "ckpt", CheckpointConfig(save_every_steps=1, async_save=False)
    ) as ckpt:
        ckpt.save(2, {"x": np.zeros(1, np.float32)}, extra=extra)
    with Checkpointer(tmp_path / "ckpt", read_only=True) as ckpt:
        restored = ckpt.read_extra(2)
    resumed = restore_queue(config, 2, restored["lagged"])
    for want in queued:
        got, _ = resumed.get(timeout=1.0)
        _assert_same_rollouts(got.rollouts, want.rollouts)
    resumed_groups = GroupQueue.restore(4, 4, 2, restored["streaming"])
    for got, want in zip(resumed_groups.take(2, timeout=1.0), streamed, strict=True):
        _assert_same_rollouts(got.rollouts, want.rollouts)

"""`jaxrl.loop.rollout_queue.GroupQueue`: the oldest token bounds a group's staleness (dropped and
counted on admission or consumption); a prompt is issued only while the queued and in-flight
groups leave room, and a finished group never waits; every issued prompt is in flight, queued,
consumed, dropped or filtered (dynamic sampling, within its budget); a snapshot restores to the
same ledger (in-flight prompts re-issued first)."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest

from jaxrl.infra.closable import QueueClosed
from jaxrl.loop.feeds.streaming import token_staleness_metrics
from jaxrl.loop.rollout_queue import (
    GroupQueue,
    ScoredBatch,
    ledger_bitmap,
    ledger_indices,
    prompt_ledger,
)
from jaxrl.rl import Rollout


def _group(index: int, versions_per_row: list[list[int]]) -> ScoredBatch:
    rollouts = [
        Rollout(
            prompt_ids=np.array([1, 5], np.int32),
            completion_ids=np.arange(len(v), dtype=np.int32),
            behaviour_logprobs=np.full(len(v), -0.5, np.float32),
            policy_version=min(v),
            reward=1.0,
            group_id=index,
            token_versions=np.asarray(v, np.int32),
        )
        for v in versions_per_row
    ]
    return ScoredBatch(index, min(min(v) for v in versions_per_row), rollouts)


def test_oldest_token_bounds_staleness_and_every_prompt_is_accounted_for():
    queue = GroupQueue(capacity=4, max_staleness=1, max_in_flight=2)
    issued = [queue.issue() for _ in range(6)]
    assert issued == list(range(6))
    queue.advance(3)
    # Prompt 0: one row's first token is version 1 (3 - 1 = 2 > 1): dropped on admission.
    assert not queue.put(_group(0, [[2, 3], [1, 2, 3]]))
    assert queue.put(_group(1, [[2, 2, 3]]))
    assert queue.put(_group(2, [[3]]))
    queue.advance(4)  # prompt 1's oldest token is now 2 versions old: dropped on consumption
    assert queue.put(_group(3, [[3, 4]]))
    taken = queue.take(2, timeout=1.0)
    assert [g.batch_index for g in taken] == [2, 3]
    s = queue.stats
    assert (s.dropped_on_admission, s.dropped_on_consumption, s.consumed_batches) == (1, 1, 2)
    assert s.staleness_counts == {1: 2}
    snap = queue.snapshot()
    assert snap["in_flight_prompts"] == [4, 5] and snap["next_prompt"] == 6
    with pytest.raises(ValueError, match="never issued"):
        queue.put(_group(9, [[4]]))

    # The ledger names each prompt's fate: 0 dropped on admission, 1 on consumption.
    assert prompt_ledger(snap) == {
        "queued": [],
        "in_flight": [4, 5],
        "dropped": [0, 1],
        "filtered": [],
        "trained": [2, 3],
    }

    restored = GroupQueue.restore(4, 1, 4, snap)
    assert [restored.issue() for _ in range(3)] == [4, 5, 6]  # re-issued first, then new
    assert restored.stats.to_json() == s.to_json()
    assert restored.put(_group(5, [[4]]))
    assert not restored.put(_group(6, [[2]]))  # dropped after the resume: named with 0 and 1
    after = restored.snapshot()
    assert prompt_ledger(after) == {
        "queued": [5],
        "in_flight": [4],
        "dropped": [0, 1, 6],
        "filtered": [],
        "trained": [2, 3],
    }


def test_ledger_bitmap_round_trips_and_stays_small():
    rng = np.random.default_rng(0)
    for size in (0, 1, 9, 1000):
        picked = sorted(set(rng.integers(0, max(size, 1), size // 3).tolist()) if size else [])
        assert ledger_indices(ledger_bitmap(picked, size)) == picked
    # 100k prompts, every fourth filtered: far under a list of the indices.
    assert len(ledger_bitmap(range(0, 100_000, 4), 100_000)) < 200


def test_take_waits_for_enough_groups_and_close_wakes_it():
    queue = GroupQueue(capacity=2, max_staleness=0, max_in_flight=1)
    for _ in range(3):
        queue.issue()
    out = {}

    def trainer():
        try:
            out["taken"] = queue.take(2, timeout=30.0)
        except QueueClosed as e:
            out["closed"] = e

    thread = threading.Thread(target=trainer)
    thread.start()
    queue.put(_group(0, [[0]]))
    assert thread.is_alive()
    queue.put(_group(1, [[0]]))
    thread.join(timeout=30.0)
    assert [g.batch_index for g in out["taken"]] == [0, 1]
    # A full queue stops new prompts (until the trainer takes or the run closes it), never a
    # finished group: put does not wait.
    queue.put(_group(2, [[0]]))
    queue.issue()
    queue.issue()
    queue.put(_group(3, [[0]]))
    assert queue.issue(block=False) is None  # 2 queued: full
    blocked = threading.Thread(target=lambda: pytest.raises(QueueClosed, queue.issue))
    blocked.start()
    blocked.join(timeout=0.2)
    assert blocked.is_alive()
    queue.close()
    blocked.join(timeout=30.0)
    assert not blocked.is_alive()


def test_issue_bounds_queued_plus_in_flight_and_put_never_waits():
    queue = GroupQueue(capacity=2, max_staleness=4, max_in_flight=2)
    assert [queue.issue() for _ in range(4)] == [0, 1, 2, 3]
    assert queue.issue(block=False) is None  # 0 queued + 4 in flight = 2 + 2
    assert queue.put(_group(0, [[0]]))  # 1 queued + 3 in flight: still no room
    assert queue.issue(block=False) is None
    assert queue.put(_group(1, [[0]])) and queue.put(_group(2, [[0]]))  # over capacity: queued
    assert queue.depth == 3 and queue.issue(block=False) is None  # full: no new prompt
    queue.take(2, timeout=1.0)  # 1 queued + 1 in flight
    assert [queue.issue(block=False) for _ in range(3)] == [4, 5, None]


def test_stream_in_flight_sets_the_groups_issued_beyond_the_queue():
    """RLConfig.stream_in_flight is GroupQueue.max_in_flight: -1 the engine's groups (slots /
    samples_per_prompt), else the count given; below -1 is refused by name."""
    from types import SimpleNamespace

    from flax import nnx

    from jaxrl.generation.engine_sampler import EngineSampler
    from jaxrl.loop.config import RLConfig
    from jaxrl.loop.feeds.streaming import groups_in_flight
    from jaxrl.models.config import ModelConfig
    from jaxrl.models.transformer import Transformer

    with pytest.raises(ValueError, match="stream_in_flight=-2"):
        RLConfig(mode="async", schedule="streaming", stream_in_flight=-2).validate()
    model = Transformer(ModelConfig("llama", 16, 8, 16, 1, 2, 2, 4), rngs=nnx.Rngs(0))
    sampler, _ = EngineSampler.for_model(model, num_slots=32)
    for lead, expected in ((-1, 32 // 4), (0, 0), (3, 3)):
        config = RLConfig(mode="async", schedule="streaming", samples_per_prompt=4,
                          stream_in_flight=lead)  # fmt: skip
        config.validate()
        ctl = SimpleNamespace(config=config, generator=SimpleNamespace(sampler=sampler))
        assert groups_in_flight(ctl) == expected


def test_token_staleness_metrics_count_every_token():
    rollouts = _group(0, [[3, 4, 4], [4]]).rollouts
    metrics, staleness = token_staleness_metrics(rollouts, 5)
    assert sorted(staleness.tolist()) == [1, 1, 1, 2]
    assert metrics["stream/tokens_at_staleness/1"] == 3
    assert metrics["stream/tokens_at_staleness/2"] == 1
    assert metrics["stream/token_staleness_max"] == 2
    assert metrics["stream/token_staleness_mean"] == pytest.approx(1.25)
    assert metrics["stream/mixed_version_rows"] == 0.5


def test_dropping_stale_groups_on_take_wakes_a_generator_waiting_for_room():
    """A full queue whose groups all turn over-stale: `take` drops them, and the generator
    blocked in `issue` (waiting for room) must be woken, else both wait forever (a lost wake-up
    seen as a hung streaming run when the trainer outran the generator)."""
    queue = GroupQueue(capacity=2, max_staleness=0, max_in_flight=1)
    for _ in range(3):
        queue.issue()
    assert queue.put(_group(0, [[0]])) and queue.put(_group(1, [[0]]))
    queue.advance(1)  # groups 0 and 1 are now over-stale, still queued; group 2 will be fresh
    out = {}
    producer = threading.Thread(target=lambda: out.setdefault("issued", queue.issue()))
    producer.start()
    producer.join(timeout=0.2)
    assert producer.is_alive()  # full (of stale groups): waiting for room
    assert queue.put(_group(2, [[1]]))
    taken = queue.take(1, timeout=10.0)
    assert [g.batch_index for g in taken] == [2]
    producer.join(timeout=10.0)
    assert out["issued"] == 3 and queue.stats.dropped_on_consumption == 2


def test_filter_leaves_out_one_reward_groups_within_the_oversample_budget():
    queue = GroupQueue(capacity=8, max_staleness=4)
    for _ in range(7):
        queue.issue()

    def scored(index: int, rewards: list[float]) -> ScoredBatch:
        group = _group(index, [[0]] * len(rewards))
        rollouts = [
            dataclasses.replace(r, reward=reward)
            for r, reward in zip(group.rollouts, rewards, strict=True)
        ]
        return dataclasses.replace(group, rollouts=rollouts)

    assert not queue.filter(scored(0, [0.0, 1.0]), oversample=2)  # a spread: queued as is
    assert not queue.filter(scored(0, [1.0, 1.0]), oversample=1)  # no dynamic sampling
    # oversample 2: one group left out per group put (plus one before the first).
    assert queue.filter(scored(0, [1.0, 1.0]), oversample=2)
    assert not queue.filter(scored(1, [0.0, 0.0]), oversample=2)  # over the budget: queue it
    assert queue.put(scored(1, [0.0, 0.0]))
    assert queue.filter(scored(2, [0.0, 0.0]), oversample=2)  # one group put: room for one more
    assert not queue.filter(scored(3, [1.0, 1.0]), oversample=2)
    assert queue.filter(scored(3, [1.0, 1.0]), oversample=4)  # a larger budget
    assert queue.stats.filtered_batches == 3
    with pytest.raises(ValueError, match="never issued"):
        queue.filter(scored(0, [1.0, 1.0]), oversample=4)  # already left out
    # The ledger: issued = in flight + queued + filtered.
    snap = queue.snapshot()
    assert snap["in_flight_prompts"] == [4, 5, 6] and len(snap["pending_groups"]) == 1
    assert prompt_ledger(snap)["filtered"] == [0, 2, 3]
    restored = GroupQueue.restore(8, 4, 0, snap)
    assert restored.stats.filtered_batches == 3
    assert restored.filtered == {0, 2, 3}

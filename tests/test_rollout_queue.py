"""The rollout queue's staleness contract on random schedules (a NumPy-RNG property test), its
blocking / closing behaviour across threads, and the exact JSON round trip of queued batches."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

from jaxrl.infra.closable import QueueClosed
from jaxrl.loop.rollout_queue import QueueStats, RolloutQueue, ScoredBatch
from jaxrl.rl import Rollout


def _batch(index: int, version: int, samples: int, rng=None) -> ScoredBatch:
    rng = rng or np.random.default_rng(index)
    rollouts = []
    for g in range(samples):
        n = int(rng.integers(1, 5))
        rollouts.append(
            Rollout(
                prompt_ids=rng.integers(3, 50, size=int(rng.integers(1, 6))).astype(np.int32),
                completion_ids=rng.integers(3, 50, size=n).astype(np.int32),
                behaviour_logprobs=(-rng.exponential(size=n)).astype(np.float32),
                policy_version=version,
                reward=float(rng.normal()),
                group_id=index * samples + g,
            )
        )
    return ScoredBatch(index, version, rollouts, {"reward/mean": 0.5})


def test_random_schedules_never_hand_out_stale_batches_and_count_every_drop():
    """Random interleavings of put / get / version bumps (one thread, zero timeouts): every
    consumed batch has staleness <= max_staleness at consumption, comes out in FIFO order, and
    every batch put is exactly one of consumed, dropped (counted, in batches and samples, and
    stale at the moment it was dropped) or still queued. A reference model of the queue predicts
    each outcome."""
    rng = np.random.default_rng(0)
    for trial in range(300):
        capacity = int(rng.integers(1, 5))
        max_staleness = int(rng.integers(0, 4))
        queue = RolloutQueue(capacity, max_staleness)
        model: list[ScoredBatch] = []  # the reference queue
        v_t, next_index = 0, 0
        consumed, dropped, sizes = [], [], {}
        for _ in range(int(rng.integers(5, 60))):
            op = rng.choice(["put", "get", "advance"], p=[0.45, 0.35, 0.2])
            if op == "put":
                # The generator's version trails the trainer's by a random amount.
                version = max(v_t - int(rng.integers(0, max_staleness + 3)), 0)
                batch = _batch(next_index, version, int(rng.integers(1, 4)), rng)
                sizes[next_index] = batch.num_samples
                stale = v_t - version > max_staleness
                if not stale and len(model) == capacity:
                    with pytest.raises(TimeoutError):
                        queue.put(batch, timeout=0)
                    continue  # a full queue: the producer would wait; it retries later
                assert queue.put(batch, timeout=0) is (not stale)
                if stale:
                    dropped.append(next_index)
                else:
                    model.append(batch)
                next_index += 1
            elif op == "get":
                expected = None
                while model:
                    head = model.pop(0)
                    if v_t - head.policy_version > max_staleness:
                        dropped.append(head.batch_index)
                    else:
                        expected = head
                        break
                if expected is None:
                    with pytest.raises(TimeoutError):
                        queue.get(timeout=0)
                    continue
                batch, staleness = queue.get(timeout=0)
                assert batch is expected and staleness == v_t - batch.policy_version
                assert 0 <= staleness <= max_staleness, (trial, staleness)
                consumed.append((batch.batch_index, staleness))
            else:
                v_t += int(rng.integers(1, 3))
                queue.advance(v_t)
            assert queue.depth == len(model) <= capacity
            assert queue.next_index == next_index
        queued = [b.batch_index for b in model]
        indices = [i for i, _ in consumed]
        assert indices == sorted(indices)  # FIFO
        assert sorted(indices + dropped + queued) == list(range(next_index))  # conservation
        stats = queue.stats
        assert stats.dropped_batches == len(dropped)
        assert stats.dropped_samples == sum(sizes[i] for i in dropped)
        assert stats.consumed_batches == len(consumed)
        assert stats.consumed_samples == sum(sizes[i] for i in indices)
        histogram = {}
        for _, s in consumed:
            histogram[s] = histogram.get(s, 0) + 1
        assert stats.staleness_counts == histogram
        pending, position, snap = queue.snapshot()
        assert [b.batch_index for b in pending] == queued and position == next_index
        assert snap == stats and snap is not stats


def test_threads_block_wake_and_close_with_the_producers_error():
    """A producer thread and a consumer on a queue of capacity 1 with version bumps: every batch
    arrives in order or is counted as dropped; a producer failure reaches a waiting consumer at
    once, as the original exception."""
    queue = RolloutQueue(1, max_staleness=1)
    produced = 40

    def producer():
        rng = np.random.default_rng(1)
        for k in range(produced):
            time.sleep(float(rng.uniform(0, 0.002)))
            version = max(k // 2 - int(rng.integers(0, 3)), 0)
            queue.put(_batch(k, version, 2))

    thread = threading.Thread(target=producer)
    thread.start()
    got, step = [], 0
    while thread.is_alive() or queue.depth:
        try:
            batch, staleness = queue.get(timeout=0.05)
        except TimeoutError:
            continue
        assert staleness <= 1
        got.append(batch.batch_index)
        step += 1
        queue.advance(step // 2)
    thread.join()
    assert got == sorted(got)
    assert len(got) + queue.stats.dropped_batches + queue.depth == produced

    error = ValueError("boom")
    empty = RolloutQueue(2, 0)
    waiter_result = {}

    def waiter():
        start = time.monotonic()
        try:
            empty.get(timeout=30)
        except QueueClosed as closed:
            waiter_result["error"] = closed.error
            waiter_result["seconds"] = time.monotonic() - start

    waiting = threading.Event()
    wait = empty._wait
    empty._wait = lambda *args: (waiting.set(), wait(*args))
    thread = threading.Thread(target=waiter)
    thread.start()
    assert waiting.wait(5)  # the waiter is blocked in get(): close must wake it
    empty.close(error)
    thread.join(5)
    assert waiter_result["error"] is error and waiter_result["seconds"] < 1.0
    with pytest.raises(QueueClosed):
        empty.put(_batch(0, 0, 1))


def test_wait_for_position_and_out_of_order_puts():
    queue = RolloutQueue(3, 0, next_index=5)
    with pytest.raises(TimeoutError):
        queue.wait_for_position(6, timeout=0.01)
    queue.put(_batch(5, 0, 1))
    queue.wait_for_position(6, timeout=0.01)
    with pytest.raises(ValueError, match="index order"):
        queue.put(_batch(4, 0, 1))


def test_scored_batch_and_stats_survive_json_bit_for_bit():
    batch = _batch(7, 3, 4)
    blob = json.loads(json.dumps(batch.to_json()))
    back = ScoredBatch.from_json(blob)
    assert (back.batch_index, back.policy_version, back.metrics) == (7, 3, batch.metrics)
    for a, b in zip(batch.rollouts, back.rollouts, strict=True):
        for field in ("prompt_ids", "completion_ids", "behaviour_logprobs"):
            x, y = getattr(a, field), getattr(b, field)
            assert x.dtype == y.dtype and x.tobytes() == y.tobytes()
        assert (a.reward, a.group_id, a.policy_version) == (b.reward, b.group_id, b.policy_version)
    stats = QueueStats(3, 12, 1, 2, 9, {0: 1, 2: 2})
    assert QueueStats.from_json(json.loads(json.dumps(stats.to_json()))) == stats
    assert stats.mean_staleness == pytest.approx(4 / 3)

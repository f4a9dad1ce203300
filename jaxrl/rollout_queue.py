"""The bounded rollout queue between the generator and the trainer (async mode).

Items are `ScoredBatch`es: the scored rollouts of one generate call (one train batch), stamped
with the policy version `v_g` whose weights sampled them and with their batch index. The queue
also holds the trainer's policy version `v_t` (the trainer calls `advance(v_t)` after every
optimizer step); a batch's staleness is `v_t - v_g`, and no batch with staleness above
`max_staleness` is ever handed to the trainer:

- `put(batch)` (admission): a batch already too stale is dropped and counted (returns False);
  otherwise the producer waits while the queue is full, then the batch is appended (FIFO).
- `get()` (consumption): pops the oldest batch; one that went stale while it waited (the trainer
  moved on) is dropped and counted, and the next one is tried. Waits while the queue is empty.
- `close(error)` wakes every waiter: a blocked or later `put` / `get` raises `QueueClosed`,
  carrying the error of the side that failed (None for a normal shutdown).

Every batch put is exactly one of: consumed (staleness <= max_staleness at that moment), dropped
(counted, in batches and in samples), or still queued (tests/test_rollout_queue.py checks this on
random schedules).

Position: `next_index` is one past the batch index of the newest batch the queue has settled
(admitted or dropped). `snapshot()` returns the queued batches and `next_index` together, which
is what a checkpoint needs: a resumed producer starts at `next_index`, the queued batches come
back from the checkpoint, so no batch is lost or trained twice.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Any

import numpy as np

from jaxrl.rl import Rollout


class QueueClosed(RuntimeError):
    """The queue was closed: by the other side's failure (`error`) or a normal shutdown."""

    def __init__(self, error: BaseException | None = None):
        super().__init__("rollout queue closed" + (f" after {error!r}" if error else ""))
        self.error = error


@dataclasses.dataclass
class ScoredBatch:
    """The scored rollouts of one generate call: one train batch.

    metrics: the generator and reward executors' own figures for this batch (reward/mean,
      time/generate_s, time/reward_s, ...), logged with the step that trains on it.
    """

    batch_index: int
    policy_version: int
    rollouts: list[Rollout]
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def num_samples(self) -> int:
        return len(self.rollouts)

    def to_json(self) -> dict[str, Any]:
        """Plain lists and numbers; float32 log-probs survive the JSON round trip bit for bit
        (a float32 is exactly representable as the float64 that JSON writes)."""
        return {
            "batch_index": self.batch_index,
            "policy_version": self.policy_version,
            "metrics": dict(self.metrics),
            "rollouts": [
                {
                    "prompt_ids": r.prompt_ids.tolist(),
                    "completion_ids": r.completion_ids.tolist(),
                    "behaviour_logprobs": r.behaviour_logprobs.tolist(),
                    "reward": r.reward,
                    "group_id": r.group_id,
                }
                | (
                    {}
                    if r.token_versions is None
                    else {"token_versions": np.asarray(r.token_versions).tolist()}
                )
                for r in self.rollouts
            ],
        }

    @classmethod
    def from_json(cls, blob: dict[str, Any]) -> ScoredBatch:
        version = int(blob["policy_version"])
        rollouts = [
            Rollout(
                prompt_ids=np.asarray(r["prompt_ids"], np.int32),
                completion_ids=np.asarray(r["completion_ids"], np.int32),
                behaviour_logprobs=np.asarray(r["behaviour_logprobs"], np.float32),
                policy_version=version,
                reward=float(r["reward"]),
                group_id=int(r["group_id"]),
                token_versions=(
                    np.asarray(r["token_versions"], np.int32) if "token_versions" in r else None
                ),
            )
            for r in blob["rollouts"]
        ]
        return cls(int(blob["batch_index"]), version, rollouts, dict(blob["metrics"]))


@dataclasses.dataclass
class QueueStats:
    """Cumulative counts of a run (checkpointed, so a resumed run continues them).

    staleness_counts: consumed batches by staleness `v_t - v_g`.
    filtered_batches: groups a streaming run's dynamic sampling left out (`GroupQueue.filter`).
    """

    consumed_batches: int = 0
    consumed_samples: int = 0
    dropped_on_admission: int = 0  # batches
    dropped_on_consumption: int = 0  # batches
    dropped_samples: int = 0
    staleness_counts: dict[int, int] = dataclasses.field(default_factory=dict)
    filtered_batches: int = 0  # streaming dynamic sampling: one reward for the whole group

    @property
    def dropped_batches(self) -> int:
        return self.dropped_on_admission + self.dropped_on_consumption

    @property
    def mean_staleness(self) -> float:
        total = sum(self.staleness_counts.values())
        return sum(s * n for s, n in self.staleness_counts.items()) / max(total, 1)

    def to_json(self) -> dict[str, Any]:
        blob = dataclasses.asdict(self)
        blob["staleness_counts"] = {str(k): v for k, v in self.staleness_counts.items()}
        return blob

    @classmethod
    def from_json(cls, blob: dict[str, Any]) -> QueueStats:
        blob = dict(blob)
        blob["staleness_counts"] = {int(k): v for k, v in blob["staleness_counts"].items()}
        return cls(**blob)


class _ClosableQueue:
    """What both bounded queues share (`RolloutQueue`, `streaming.GroupQueue`): the queued
    `_items`, one condition for every waiter, and closing, which wakes them all."""

    def __init__(self, items) -> None:
        self._items: collections.deque[ScoredBatch] = collections.deque(items)
        self._closed: QueueClosed | None = None
        self._cond = threading.Condition()

    def close(self, error: BaseException | None = None) -> None:
        """Wakes every waiter; later calls raise QueueClosed(error). The first close wins."""
        with self._cond:
            if self._closed is None:
                self._closed = QueueClosed(error)
            self._cond.notify_all()

    @property
    def depth(self) -> int:
        with self._cond:
            return len(self._items)

    @property
    def closed(self) -> bool:
        return self._closed is not None


class RolloutQueue(_ClosableQueue):
    """A bounded FIFO of `ScoredBatch`es with staleness checks (see the module docstring).

    Args:
      capacity: most batches held at once (the producer waits in `put` beyond it).
      max_staleness: largest `v_t - v_g` a consumed batch may have, in policy versions.
      trainer_version: the trainer's version now (a resumed run's step).
      next_index: the batch index the producer generates next (a resumed run's data position).
      pending: queued batches restored from a checkpoint (admitted before; checked again when
        consumed).
      stats: cumulative counts restored from a checkpoint.
    """

    def __init__(
        self,
        capacity: int,
        max_staleness: int,
        *,
        trainer_version: int = 0,
        next_index: int = 0,
        pending: list[ScoredBatch] = (),
        stats: QueueStats | None = None,
    ):
        if capacity < 1:
            raise ValueError(f"capacity={capacity} must be >= 1")
        if max_staleness < 0:
            raise ValueError(f"max_staleness={max_staleness} must be >= 0")
        if len(pending) > capacity:
            raise ValueError(f"{len(pending)} pending batches exceed capacity {capacity}")
        super().__init__(pending)
        self.capacity, self.max_staleness = capacity, max_staleness
        self._trainer_version = trainer_version
        self._next_index = next_index
        self.stats = stats or QueueStats()

    # --- trainer side ----------------------------------------------------------------------

    def advance(self, trainer_version: int) -> None:
        """The trainer finished an optimizer step: its policy version is now `trainer_version`."""
        with self._cond:
            if trainer_version < self._trainer_version:
                raise ValueError(
                    f"trainer version went back from {self._trainer_version} to {trainer_version}"
                )
            self._trainer_version = trainer_version
            self._cond.notify_all()

    def get(self, timeout: float | None = None) -> tuple[ScoredBatch, int]:
        """The oldest batch fresh enough to train on now, and its staleness; waits while empty.

        Raises QueueClosed once closed, TimeoutError after `timeout` seconds without a batch.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                self._raise_if_closed()
                while self._items:
                    batch = self._items.popleft()
                    self._cond.notify_all()  # room for the producer
                    staleness = self._trainer_version - batch.policy_version
                    if staleness > self.max_staleness:
                        self.stats.dropped_on_consumption += 1
                        self.stats.dropped_samples += batch.num_samples
                        continue
                    self.stats.consumed_batches += 1
                    self.stats.consumed_samples += batch.num_samples
                    counts = self.stats.staleness_counts
                    counts[staleness] = counts.get(staleness, 0) + 1
                    return batch, staleness
                self._wait(deadline, "a scored batch")

    def wait_for_position(self, index: int, timeout: float | None = None) -> None:
        """Waits until every batch before `index` is settled (queued, consumed or dropped)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._next_index < index:
                self._raise_if_closed()
                self._wait(deadline, f"the generator to reach batch {index}")

    def snapshot(self) -> tuple[list[ScoredBatch], int, QueueStats]:
        """(queued batches, next_index, a copy of the stats), taken together: the async part of
        a checkpoint."""
        with self._cond:
            stats = QueueStats.from_json(self.stats.to_json())
            return list(self._items), self._next_index, stats

    # --- producer side ---------------------------------------------------------------------

    def wait_for_room(self, timeout: float | None = None) -> None:
        """Waits until `put` would not wait for room (a producer that must ask for its next
        batch before it has it: the trainer's side of a role-split job, `jaxrl.roles`)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                self._raise_if_closed()
                if len(self._items) < self.capacity:
                    return
                self._wait(deadline, "room in the rollout queue")

    def put(self, batch: ScoredBatch, timeout: float | None = None) -> bool:
        """Admits `batch` (True) or drops it as too stale (False); waits while the queue is full.

        Raises QueueClosed once closed, TimeoutError after `timeout` seconds without room.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            if batch.batch_index < self._next_index:
                raise ValueError(
                    f"batch {batch.batch_index} put after batch {self._next_index - 1}: the "
                    "producer must put batches in index order"
                )
            while True:
                self._raise_if_closed()
                if self._trainer_version - batch.policy_version > self.max_staleness:
                    self.stats.dropped_on_admission += 1
                    self.stats.dropped_samples += batch.num_samples
                    self._settle(batch)
                    return False
                if len(self._items) < self.capacity:
                    self._items.append(batch)
                    self._settle(batch)
                    return True
                self._wait(deadline, "room in the rollout queue")

    # --- both --------------------------------------------------------------------------------

    @property
    def next_index(self) -> int:
        with self._cond:
            return self._next_index

    def _settle(self, batch: ScoredBatch) -> None:
        self._next_index = batch.batch_index + 1
        self._cond.notify_all()

    def _raise_if_closed(self) -> None:
        if self._closed is not None:
            raise QueueClosed(self._closed.error)

    def _wait(self, deadline: float | None, what: str) -> None:
        wait_until(self._cond, deadline, what)


def wait_until(cond: threading.Condition, deadline: float | None, what: str) -> None:
    """One `cond.wait` (held by the caller) until `deadline` (time.monotonic; None: forever);
    raises TimeoutError naming `what` once the deadline has passed."""
    if deadline is None:
        cond.wait()
        return
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError(f"timed out waiting for {what}")
    cond.wait(remaining)

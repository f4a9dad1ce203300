"""The bounded rollout queues between the generator and the trainer (async mode).

`RolloutQueue` holds whole batches (fixed lag, free running, role split); `GroupQueue` holds
one prompt's group per item and the ledger of the prompts in flight (streaming, see
`jaxrl.loop.feeds.streaming`). What follows describes `RolloutQueue`; `GroupQueue`'s docstring its
differences.

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

import base64
import collections
import dataclasses
import threading
import time
import zlib
from typing import Any

import numpy as np

from jaxrl.infra.closable import QueueClosed, wait_until
from jaxrl.rl import Rollout


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
        (a float32 is exactly representable as the float64 that JSON writes). A routing record
        (mixture-of-experts generators) is bytes in base64 (`encode_routing`), not a list."""
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
                | ({} if r.loss_mask is None else {"loss_mask": np.asarray(r.loss_mask).tolist()})
                | ({} if r.routing is None else {"routing": encode_routing(r.routing)})
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
                loss_mask=np.asarray(r["loss_mask"], bool) if "loss_mask" in r else None,
                routing=decode_routing(r["routing"]) if "routing" in r else None,
            )
            for r in blob["rollouts"]
        ]
        return cls(int(blob["batch_index"]), version, rollouts, dict(blob["metrics"]))


def encode_routing(routing: np.ndarray) -> dict[str, Any]:
    """A routing record (`Rollout.routing`, int16 `[n, layers, k]`, -1 = none) as JSON: its
    shape and its bytes in base64, one byte per entry (`id + 1`) when every expert id is below
    255 (models of up to 255 experts), else little-endian int16. Exact both ways
    (`decode_routing`); a list of numbers would be several times the size."""
    routing = np.asarray(routing, np.int16)
    if not routing.size or (routing.min() >= -1 and routing.max() < 255):
        data, kind = (routing + 1).astype(np.uint8), "uint8+1"
    else:
        data, kind = routing.astype("<i2"), "int16le"
    return {
        "shape": list(routing.shape),
        "encoding": kind,
        "data": base64.b64encode(data.tobytes()).decode(),
    }


def decode_routing(blob: dict[str, Any]) -> np.ndarray:
    """The int16 record `encode_routing` wrote."""
    raw = base64.b64decode(blob["data"])
    if blob["encoding"] == "uint8+1":
        values = np.frombuffer(raw, np.uint8).astype(np.int16) - 1
    elif blob["encoding"] == "int16le":
        values = np.frombuffer(raw, "<i2").astype(np.int16)
    else:
        raise ValueError(f"unknown routing record encoding {blob['encoding']!r}")
    return values.reshape([int(n) for n in blob["shape"]])


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
    """What both bounded queues share (`RolloutQueue`, `GroupQueue`): the queued
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

    def _raise_if_closed(self) -> None:
        if self._closed is not None:
            raise QueueClosed(self._closed.error)


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
        batch before it has it: the trainer's side of a role-split job, `jaxrl.loop.roles`)."""
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

    def _wait(self, deadline: float | None, what: str) -> None:
        wait_until(self._cond, deadline, what)


# --- streaming: one group per item ---------------------------------------------------------


def leave_out(group: ScoredBatch, oversample: int, filtered: int, put: int) -> bool:
    """Streaming's dynamic sampling rule: a group whose samples all got one reward (zero
    advantage, no gradient) is left out while the groups left out (`filtered`) stay within
    `oversample - 1` per group put into the queue so far (`put`), plus one."""
    if oversample <= 1 or len({r.reward for r in group.rollouts}) > 1:
        return False
    return filtered < (oversample - 1) * (put + 1)


def ledger_bitmap(indices, size: int) -> str:
    """Prompt indices in [0, size) as a checkpoint string: bit i of `np.packbits` order set for
    prompt i, zlib-compressed, base64 (a few bytes for runs, size / 8 at most for any set)."""
    bits = np.zeros(size, np.uint8)
    bits[np.fromiter(indices, np.int64)] = 1
    return base64.b64encode(zlib.compress(np.packbits(bits).tobytes(), 9)).decode()


def ledger_indices(bitmap: str) -> list[int]:
    """The prompt indices of a `ledger_bitmap` string, ascending."""
    packed = np.frombuffer(zlib.decompress(base64.b64decode(bitmap)), np.uint8)
    return np.flatnonzero(np.unpackbits(packed)).tolist()


def prompt_ledger(blob: dict) -> dict[str, list[int]]:
    """Each issued prompt's fate in a streaming checkpoint (`GroupQueue.snapshot`): the prompt
    indices queued, in flight, dropped, filtered, and trained (the rest of [0, next_prompt))."""
    ledger = {
        "queued": sorted(int(g["batch_index"]) for g in blob["pending_groups"]),
        "in_flight": sorted(int(i) for i in blob["in_flight_prompts"]),
        "dropped": ledger_indices(blob["dropped_prompts"]),
        "filtered": ledger_indices(blob["filtered_prompts"]),
    }
    elsewhere = {i for indices in ledger.values() for i in indices}
    return ledger | {"trained": [i for i in range(blob["next_prompt"]) if i not in elsewhere]}


class GroupQueue(_ClosableQueue):
    """Scored groups between the streaming generator and the trainer, and the ledger of the
    prompts in flight. Items are `ScoredBatch`es of one group each: `batch_index` is the prompt
    index, `policy_version` the version of the group's oldest token.

    Every issued prompt is exactly one of: in flight, queued, consumed, dropped (by admission
    or consumption) or filtered (dynamic sampling), each dropped and filtered one counted in
    `stats` and named in `dropped` / `filtered`. `snapshot()` takes all of it at once, under
    one lock.

    Args:
      capacity: queued groups beyond which no prompt is issued (`issue` waits).
      max_staleness: largest `v_t - v_oldest_token` a consumed group may have.
      max_in_flight: the most groups in flight once the queue is empty: a prompt is issued only
        while queued + in flight < capacity + max_in_flight (0: capacity alone bounds it).
      trainer_version, next_prompt, pending, reissue, stats, dropped, filtered: a resumed
        run's state (`reissue`: the prompts that were in flight, issued again first).
    """

    def __init__(
        self,
        capacity: int,
        max_staleness: int,
        *,
        max_in_flight: int = 0,
        trainer_version: int = 0,
        next_prompt: int = 0,
        pending: list[ScoredBatch] = (),
        reissue: list[int] = (),
        stats: QueueStats | None = None,
        dropped: set[int] = frozenset(),
        filtered: set[int] = frozenset(),
    ):
        if capacity < 1 or max_staleness < 0 or max_in_flight < 0:
            raise ValueError(
                f"need capacity={capacity} >= 1, max_staleness={max_staleness} >= 0 and "
                f"max_in_flight={max_in_flight} >= 0"
            )
        super().__init__(pending)
        self.capacity, self.max_staleness = capacity, max_staleness
        self.max_in_flight = max_in_flight
        self._reissue = collections.deque(reissue)
        self._in_flight: set[int] = set()
        self._trainer_version, self._next_prompt = trainer_version, next_prompt
        self.stats = stats or QueueStats()
        self.dropped, self.filtered = set(dropped), set(filtered)

    # --- generator side -----------------------------------------------------------------------

    def issue(self, block: bool = True, timeout: float | None = None) -> int | None:
        """The next prompt index to submit (re-issued ones first), now in flight. Waits while
        the queue holds `capacity` groups or queued + in flight reach `capacity + max_in_flight`
        (`block=False`: None at once)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                self._raise_if_closed()
                held = len(self._items)
                if held < self.capacity and (
                    held + len(self._in_flight) < self.capacity + self.max_in_flight
                ):
                    break
                if not block:
                    return None
                wait_until(self._cond, deadline, "room to issue a prompt")
            if self._reissue:
                index = self._reissue.popleft()
            else:
                index, self._next_prompt = self._next_prompt, self._next_prompt + 1
            self._in_flight.add(index)
            return index

    def put(self, group: ScoredBatch) -> bool:
        """Queues a scored group (True), or drops it as too stale (False). Never waits: room
        was taken when its prompt was issued."""
        with self._cond:
            self._raise_if_closed()
            if group.batch_index not in self._in_flight:
                raise ValueError(f"group of prompt {group.batch_index} was never issued")
            self._in_flight.discard(group.batch_index)
            self._cond.notify_all()  # room to issue, or a group to take
            if self._stale(group):
                self.stats.dropped_on_admission += 1
                self.stats.dropped_samples += group.num_samples
                self.dropped.add(group.batch_index)
                return False
            self._items.append(group)
            return True

    def filter(self, group: ScoredBatch, oversample: int) -> bool:
        """Dynamic sampling (`leave_out`): True when the group is left out of the queue
        (counted in `stats.filtered_batches`, no longer in flight); False: queue it."""
        with self._cond:
            if group.batch_index not in self._in_flight:
                raise ValueError(f"group of prompt {group.batch_index} was never issued")
            s = self.stats
            put = s.consumed_batches + len(self._items) + s.dropped_batches
            if not leave_out(group, oversample, s.filtered_batches, put):
                return False
            s.filtered_batches += 1
            self.filtered.add(group.batch_index)
            self._in_flight.discard(group.batch_index)
            self._cond.notify_all()
            return True

    # --- trainer side -------------------------------------------------------------------------

    def advance(self, trainer_version: int) -> None:
        with self._cond:
            self._trainer_version = trainer_version
            self._cond.notify_all()

    def take(self, count: int, timeout: float | None = None) -> list[ScoredBatch]:
        """The next `count` groups fresh enough to train on now (in the order they finished);
        staler ones are dropped and counted. Waits until `count` are there."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                self._raise_if_closed()
                stale = [g for g in self._items if self._stale(g)]
                for group in stale:
                    self._items.remove(group)
                    self.stats.dropped_on_consumption += 1
                    self.stats.dropped_samples += group.num_samples
                    self.dropped.add(group.batch_index)
                if stale:  # room freed: a generator waiting in `put` must see it
                    self._cond.notify_all()
                if len(self._items) >= count:
                    taken = [self._items.popleft() for _ in range(count)]
                    self._cond.notify_all()
                    for group in taken:
                        staleness = self._trainer_version - group.policy_version
                        self.stats.consumed_batches += 1
                        self.stats.consumed_samples += group.num_samples
                        counts = self.stats.staleness_counts
                        counts[staleness] = counts.get(staleness, 0) + 1
                    return taken
                wait_until(self._cond, deadline, f"{count} scored groups")

    def snapshot(self) -> dict[str, Any]:
        """The queue's part of a checkpoint (JSON): queued groups, prompts in flight (to
        re-issue), the next prompt index, the cumulative counts, the prompts dropped and
        filtered (`ledger_bitmap`s; `prompt_ledger` reads it all back by prompt)."""
        with self._cond:
            return {
                "pending_groups": [g.to_json() for g in self._items],
                "in_flight_prompts": sorted(self._in_flight | set(self._reissue)),
                "next_prompt": self._next_prompt,
                "queue_stats": self.stats.to_json(),
                "dropped_prompts": ledger_bitmap(self.dropped, self._next_prompt),
                "filtered_prompts": ledger_bitmap(self.filtered, self._next_prompt),
            }

    @classmethod
    def restore(
        cls, capacity: int, max_staleness: int, step: int, blob: dict, max_in_flight: int = 0
    ) -> GroupQueue:
        # A checkpoint written before the ledger named its prompts has counts only.
        named = {k: set(ledger_indices(blob[k])) if k in blob else set() for k in _NAMED}
        return cls(
            capacity,
            max_staleness,
            max_in_flight=max_in_flight,
            trainer_version=step,
            next_prompt=int(blob["next_prompt"]),
            pending=[ScoredBatch.from_json(g) for g in blob["pending_groups"]],
            reissue=[int(i) for i in blob["in_flight_prompts"]],
            stats=QueueStats.from_json(blob["queue_stats"]),
            dropped=named["dropped_prompts"],
            filtered=named["filtered_prompts"],
        )

    # --- both ---------------------------------------------------------------------------------

    def _stale(self, group: ScoredBatch) -> bool:
        return self._trainer_version - group.policy_version > self.max_staleness


_NAMED = ("dropped_prompts", "filtered_prompts")

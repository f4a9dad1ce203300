"""The generator's weight store: the trainer's pushed versions, double-buffered on the generator.

`GeneratorWeights` sits between a weight transport (`jaxrl.sync.in_process.WeightSync` or
`jaxrl.sync.cross_process.CrossProcessWeightSync`) and the generator thread: the trainer
publishes each version, the generator acquires the one each batch samples with (or, streaming,
asks for the newest between decode steps).
"""

from __future__ import annotations

import threading
import time

from jaxrl.infra.closable import QueueClosed, wait_until


class GeneratorWeights:
    """The generator's copies of the policy, by version: the trainer thread publishes each new
    version (a `WeightSync` push into fresh generator buffers), the generator thread acquires the
    version each batch is sampled with.

    No rollout is sampled from half-updated weights: a push never writes into buffers a batch
    samples from (the version in use stays whole until the generator, between two batches,
    acquires a newer one and frees it), and a version is visible only once its push returned.

    Memory on the generator devices: at most two copies of the params (the one in use and one
    newer) -- a double buffer. Before pushing, `publish` waits until the generator holds at most
    one copy (fixed lag: every version is used, so it waits for the generator to take the
    pending one) or, with `latest_only` (free-running: the generator always takes the newest),
    frees the pending version that the new one supersedes and never waits. Why not WeightSync's
    pause-and-swap (peak params + one chunk): a swap must wait for the batch being sampled to
    finish, so the trainer would idle up to one generate call per step, the very overlap async
    mode exists for; one extra copy of the params on the generator buys it back.

    Args:
      sync: the trainer -> generator transport (built for the trainer's and generator's
        shardings); pushes run with `previous=None`, so its strategy does not matter here.
      latest_only: free-running schedule (see above).
    """

    def __init__(self, sync, *, latest_only: bool):
        self.sync, self.latest_only = sync, latest_only
        self._held: dict[int, object] = {}  # version -> GeneratorParams
        self.published_at: dict[int, float] = {}  # version -> time.perf_counter() of its push
        self._in_use: int | None = None
        self._closed: QueueClosed | None = None
        self._cond = threading.Condition()

    def publish(self, trainer_params, version: int, timeout: float | None = None):
        """Pushes `trainer_params` as `version` (trainer thread; before the next step donates
        them). Returns (SyncMetrics, seconds spent waiting for the generator to free a slot)."""
        start = time.perf_counter()
        with self._cond:
            if self.latest_only:
                for v in [v for v in self._held if v != self._in_use]:
                    self._held.pop(v).delete()
            deadline = None if timeout is None else time.monotonic() + timeout
            while len(self._held) >= 2:
                self._wait(deadline, f"the generator to take version {min(self._held)}")
        waited = time.perf_counter() - start
        params, metrics = self.sync.push(trainer_params, version)
        with self._cond:
            self._held[version] = params
            self.published_at[version] = time.perf_counter()
            self._cond.notify_all()
        return metrics, waited

    def newest(self, after: int):
        """The `GeneratorParams` of the newest published version above `after`, or None at once
        (streaming: the engine asks between decode steps and never waits). Frees the older
        versions, as `acquire` does."""
        with self._cond:  # one lock: a concurrent publish may free a pending version
            if self._closed is not None:
                raise QueueClosed(self._closed.error)
            newer = [v for v in self._held if v > after]
            if not newer:
                return None
            version = max(newer)
            for v in [v for v in self._held if v < version]:
                self._held.pop(v).delete()
            self._in_use = version
            self._cond.notify_all()
            return self._held[version]

    def acquire(self, version: int | None, timeout: float | None = None):
        """The `GeneratorParams` of `version` (None: the newest published), waiting until it is
        published (generator thread, between batches). Frees every older version: the schedules
        never ask for an older version than the last one acquired."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            if None not in (version, self._in_use) and version < self._in_use:
                raise ValueError(f"version {version} asked for after version {self._in_use}")
            while True:
                if self._closed is not None:
                    raise QueueClosed(self._closed.error)
                if version is None and self._held:
                    version = max(self._held)
                if version in self._held:
                    break
                self._wait(deadline, f"policy version {version}")
            for v in [v for v in self._held if v < version]:
                self._held.pop(v).delete()
            self._in_use = version
            self._cond.notify_all()
            return self._held[version]

    def close(self, error: BaseException | None = None) -> None:
        """Wakes every waiter (they raise QueueClosed(error)); the first close wins."""
        with self._cond:
            if self._closed is None:
                self._closed = QueueClosed(error)
            self._cond.notify_all()

    def free(self) -> None:
        """Deletes every held copy (end of run; the generator thread has stopped)."""
        with self._cond:
            for params in self._held.values():
                params.delete()
            self._held.clear()

    @property
    def held_versions(self) -> list[int]:
        with self._cond:
            return sorted(self._held)

    def _wait(self, deadline: float | None, what: str) -> None:
        if self._closed is not None:
            raise QueueClosed(self._closed.error)
        wait_until(self._cond, deadline, what)

"""What every RL loop reports per step: wall time and how it splits, and the queue's counts.

`StepClock.tick` measures `time/step_s` tick to tick (everything between two steps' ends:
waiting for rollouts, training, publishing, evaluating, logging and saving) and the generator's
idle time and overlap with training from a `BusyTimeline` of the generator thread.
`queue_metrics`: the cumulative staleness histogram and drop counts of a rollout queue.
"""

from __future__ import annotations

import collections
import threading
import time

from jaxrl.loop.rollout_queue import QueueStats


def queue_metrics(stats: QueueStats) -> dict[str, float]:
    """Cumulative staleness histogram (and its mean) and drop counts of the run."""
    metrics = {
        "async/staleness_mean": stats.mean_staleness,
        "async/dropped_batches": float(stats.dropped_batches),
        "async/dropped_samples": float(stats.dropped_samples),
    }
    if stats.filtered_batches:
        metrics["data/filtered_groups"] = float(stats.filtered_batches)
    for staleness, count in sorted(stats.staleness_counts.items()):
        metrics[f"async/staleness_count/{staleness}"] = float(count)
    return metrics


class StepClock:
    """Wall time per step and how it splits: generator idle seconds and the overlap of
    generation with training, per step and as a fraction of the run's wall time since its first
    step (which compiles, and is left out)."""

    def __init__(self, timeline: BusyTimeline):
        self.timeline = timeline
        self.last = time.perf_counter()
        self.warm_start: float | None = None
        self.overlap_total = 0.0

    def tick(self, train_start: float, train_end: float) -> dict[str, float]:
        now = time.perf_counter()
        wall = now - self.last
        generator_busy = self.timeline.busy(self.last, now)  # before busy(train...): a rises
        overlap = self.timeline.busy(train_start, train_end)
        if self.warm_start is None:
            self.warm_start, fraction = now, overlap / wall
        else:
            self.overlap_total += overlap
            fraction = self.overlap_total / (now - self.warm_start)
        self.last = now
        return {
            "time/step_s": wall,
            "time/generator_idle_s": wall - generator_busy,
            "async/overlap_fraction": fraction,
            "async/overlap_fraction_step": overlap / wall,
        }


class BusyTimeline:
    """The generator thread's busy intervals (sampling + scoring a batch), for the overlap and
    idle metrics.

    `busy(a, b)`: seconds within [a, b] during which the generator was busy. Callers pass
    non-decreasing `a` (the trainer, once per step), so intervals that ended before `a` are
    dropped as they go.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._done: collections.deque[tuple[float, float]] = collections.deque()
        self._open: float | None = None

    def begin(self, t: float) -> None:
        with self._lock:
            self._open = t

    def end(self, t: float) -> None:
        with self._lock:
            self._done.append((self._open, t))
            self._open = None

    def busy(self, a: float, b: float) -> float:
        with self._lock:
            while self._done and self._done[0][1] <= a:
                self._done.popleft()
            spans = list(self._done) + ([(self._open, b)] if self._open is not None else [])
        return sum(max(0.0, min(b, end) - max(a, start)) for start, end in spans)

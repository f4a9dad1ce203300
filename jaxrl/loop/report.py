"""What every training loop reports per step, in one order and with one meaning per metric.

`StepReport.step` is the tail of every loop's step (RL in every mode, and SFT): evaluate when
due -> the step's wall time and its split (`StepClock`) -> the progress headline -> `io.log` ->
the checkpoint when due (`snapshot` gives its JSON run state; time spent in it waiting for the
generator is the trainer's idle time, counted in the next step) -> `io.after_step`.

Timing (`StepClock.tick`): `time/step_s` is tick to tick, the whole wall time between two steps'
ends (waiting for rollouts, training, publishing, evaluating, logging, saving), in every mode;
`time/trainer_idle_s` the part spent waiting for rollouts or for the generator before a save;
`time/train_s` the train step; `throughput/tokens_per_s` trained completion tokens per
`time/step_s`; with a `BusyTimeline` of the generator (sampling + scoring, on any thread),
`time/generator_idle_s` and the overlap of generation with training.

Prompt counters (every RL mode): `data/prompts_trained` = steps x num_prompts (the groups the
optimizer saw); `data/prompts_sampled` = prompts whose completions were sampled and scored and
then used up: trained, left out by dynamic sampling, or dropped as too stale (in flight and
queued ones are not counted yet). `data/prompts_seen` is `data/prompts_sampled` (kept for
readers of older metrics files; in streaming runs before this change it counted trained
prompts).
`queue_metrics`: the cumulative staleness histogram and drop counts of a rollout queue.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any

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
    """Wall time per step, tick to tick, and how it splits (module docstring): the trainer's
    wait, the train step, and with a `timeline` the generator's idle seconds and the overlap of
    generation with training, per step and as a fraction of the run's wall time since its first
    step (which compiles, and is left out). Without a timeline (the generator runs in other
    processes, which report their own idle time) only the trainer's side."""

    def __init__(self, timeline: BusyTimeline | None = None):
        self.timeline = timeline
        self.last = time.perf_counter()
        self.warm_start: float | None = None
        self.overlap_total = 0.0
        self.save_wait = 0.0  # waited for the generator before the last save: idle, next step

    def restart(self) -> None:
        self.last = time.perf_counter()

    def tick(
        self, wait_start: float, train_start: float, train_end: float, tokens: int
    ) -> dict[str, float]:
        """The step that waited for rollouts from `wait_start`, trained in [train_start,
        train_end] on `tokens` completion tokens, and ends now."""
        now = time.perf_counter()
        wall = now - self.last
        metrics = {
            "time/step_s": wall,
            "time/trainer_idle_s": train_start - wait_start + self.save_wait,
            "time/train_s": train_end - train_start,
            "throughput/tokens_per_s": tokens / wall,
        }
        if self.timeline is not None:
            generator_busy = self.timeline.busy(self.last, now)  # before busy(train...): a rises
            overlap = self.timeline.busy(train_start, train_end)
            if self.warm_start is None:
                self.warm_start, fraction = now, overlap / wall
            else:
                self.overlap_total += overlap
                fraction = self.overlap_total / (now - self.warm_start)
            metrics |= {
                "time/generator_idle_s": wall - generator_busy,
                "async/overlap_fraction": fraction,
                "async/overlap_fraction_step": overlap / wall,
            }
        self.last = now
        return metrics


class StepReport:
    """The tail of one training step, the same in every loop (module docstring).

    Args:
      io: the run's `ControllerIO` (`jaxrl.infra.run_io.RunIO`, or a script's own).
      total_steps, eval_every_steps: evaluation runs at every `eval_every_steps`-th step and the
        last one; the last step's checkpoint is forced.
      evaluate: params -> metrics (`{}` when the run does not evaluate).
      clock: the RL loops' `StepClock` (None: no timing, e.g. SFT).
    """

    def __init__(
        self,
        io,
        *,
        total_steps: int,
        eval_every_steps: int,
        evaluate: Callable[[Any], dict],
        clock: StepClock | None = None,
    ):
        self.io, self.total_steps, self.eval_every_steps = io, total_steps, eval_every_steps
        self.evaluate, self.clock = evaluate, clock

    def start(self, step: int, params=None) -> None:
        """Evaluates the initial params (a fresh run, `params` given) and starts the io."""
        if step == 0 and params is not None:
            self.io.log(0, self.evaluate(params), {})
        self.io.start(step)
        if self.clock is not None:
            self.clock.restart()

    def step(
        self,
        step: int,
        state,
        metrics: dict,
        headline: dict[str, str],
        snapshot: Callable[[int], dict],
        *,
        timing: tuple[float, float, float, int] | None = None,
        histogram: tuple[str, Any] | None = None,
    ) -> None:
        """Reports step `step` (just trained into `state`). `timing`: (wait_start, train_start,
        train_end, tokens) for the clock; `snapshot(step)`: the checkpoint's JSON run state
        (called only when a save is due; it may wait for the generator); `histogram`: (name,
        values) for writers that draw distributions."""
        force = step == self.total_steps
        if step % self.eval_every_steps == 0 or force:
            metrics |= self.evaluate(state.params)
        if self.clock is not None and timing is not None:
            metrics |= self.clock.tick(*timing)
        if "eval/accuracy" in metrics:
            headline = headline | {"acc": f"{metrics['eval/accuracy']:.3f}"}
        if histogram is not None:
            write = getattr(self.io, "histogram", None)
            if write is not None:
                write(step, *histogram)
        self.io.log(step, metrics, headline)
        start = time.perf_counter()
        if self.io.save_due(step, force):
            blob = snapshot(step)
            waited = time.perf_counter() - start
            self.io.save(state, blob, force=force)
        else:
            waited = 0.0
        if self.clock is not None:
            self.clock.save_wait = waited
        self.io.after_step(step)


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

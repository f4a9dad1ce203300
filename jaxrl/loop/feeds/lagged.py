"""Async mode's batch feed (LlamaRL): a generator thread samples whole batches on its own mesh
while the trainer trains; a bounded `RolloutQueue` between them enforces `max_staleness` on
admission and on consumption, and after every optimizer step the trainer pushes its weights to the
generator device to device (`GeneratorWeights`: a double buffer, so a batch never samples from
half-updated weights). A thread rather than overlapped dispatch alone, because the host must
wait for each batch's tokens to score them (decode + reward are Python): on one thread that wait
and the reward would sit between the trainer's dispatches; on its own thread it overlaps them (JAX
releases the GIL while devices run, and jitted calls on disjoint device sets run concurrently).
Each role traces under its own mesh and rules table (both are thread-local).

Schedules (`RLConfig.schedule`):
- "fixed_lag": batch k is sampled with policy version max(k - lag, 0) under key
  f(seed, version, k), and the trainer consumes batches in index order, so the run is a pure
  function of its config whatever the timing (bit for bit), with staleness exactly `lag` once
  k >= lag. lag=0 is on-policy on disjoint meshes, with nothing to overlap (a control).
- "free_running": the generator samples batch k with the newest version it holds, as far ahead
  as the queue allows; staleness follows the timing, batches over `max_staleness` are dropped and
  counted. Not reproducible bit for bit.

In a job of several processes every process runs the same loop on the same data (fixed lag
only), and the device work of the two threads takes turns in the same order everywhere: batch
k + lag is sampled before step k + 1 trains (`in_turns`; host work still overlaps). Programs the
two threads put on the devices concurrently, in orders that differ between processes, hung
2-process CPU jobs over gloo.

The checkpoint of an async run holds, besides the train state, the scored rollouts still queued
(sampled by versions older than the checkpointed weights, so they could not be regenerated),
the data position (next batch index to generate), the generator's version and the queue's
cumulative counts. Under fixed lag a save first waits until every batch that needs a version
older than the trainer's is generated, so the resumed run continues exactly.

What the generator thread does for one batch is pluggable (`LaggedFeed(sample=...)`, a
`SampleBatch`): `sample_batch` (one generate call, then the reward) by default; multi-turn
episodes plug in `jaxrl.loop.feeds.episodes.EpisodeBatches` (the batch's prompts as episodes on
the generator's engine, with the batch's version and key). The queue, the schedule, the pushes
and the checkpoint are the same.

The role-split trainer (`remote.RemoteFeed`) is this feed with its generator in other processes;
the generator processes (`jaxrl.loop.roles.run_generator`) sample with `sample_batch` too.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import jax

from jaxrl.infra.closable import QueueClosed, unwrap, wait_until
from jaxrl.loop.config import RLConfig
from jaxrl.loop.feeds.base import (
    ControllerView,
    GeneratorThread,
    Taken,
    check_resumable,
    default_engine_slots,
    publish,
)
from jaxrl.loop.report import BusyTimeline, queue_metrics
from jaxrl.loop.rollout_queue import QueueStats, RolloutQueue, ScoredBatch


def version_for(config: RLConfig, batch_index: int) -> int | None:
    """The policy version batch `batch_index` is sampled with (None: the newest held)."""
    if config.schedule == "fixed_lag":
        return max(batch_index - config.lag, 0)
    return None


def push_needed(config: RLConfig, version: int, first_index: int) -> bool:
    """Whether a batch still to generate (from `first_index` on) is sampled with `version`, so
    the trainer pushes it. Under fixed lag the generator knows the same, which a role-split job
    needs: both sides issue each cross-process push (`jaxrl.loop.roles`)."""
    if config.schedule == "fixed_lag":
        lowest = max(first_index - config.lag, 0)
        return lowest <= version <= max(config.total_steps - 1 - config.lag, 0)
    return version < config.total_steps


# What the generator does for batch k: (controller, k, `GeneratorParams`) -> the scored batch.
SampleBatch = Callable[[ControllerView, int, object], ScoredBatch]


def sample_batch(ctl: ControllerView, batch_index: int, params) -> ScoredBatch:
    """Batch `batch_index` sampled with the `GeneratorParams` `params` and scored."""
    items, prompt_ids = ctl.prompts(batch_index)
    generated = ctl.generator.generate(
        params.params, items, prompt_ids, params.version, batch_index
    )
    rollouts, metrics = ctl.score(generated)
    metrics["time/generate_s"] = generated.seconds
    return ScoredBatch(batch_index, params.version, rollouts, metrics)


class LaggedFeed:
    """Fixed lag and free running (module docstring): batches from a `BatchProducer` thread,
    each made by `sample` (default `sample_batch`)."""

    engine_slots = staticmethod(default_engine_slots)
    generator_here = True  # the generator thread runs in this process (`in_turns`)

    @staticmethod
    def latest_only(config: RLConfig) -> bool:
        """Free running samples with the newest version only: the store drops superseded ones."""
        return config.schedule == "free_running"

    def __init__(self, controller: ControllerView, sample: SampleBatch = sample_batch):
        self.controller, self.config, self.sample = controller, controller.config, sample
        self.in_turns = self.generator_here and jax.process_count() > 1
        # The generator's busy spans, when it runs here (else it reports its own idle time).
        self.timeline = BusyTimeline() if self.generator_here else None
        self.queue: RolloutQueue | None = None
        self.first_index = 0
        self.source = None  # the generator side: `BatchProducer` (its `version` is saved)

    def start(self, step: int, params, extra: dict | None) -> None:
        ctl = self.controller
        self.queue = restore_queue(self.config, step, extra)
        self.first_index = self.queue.next_index
        self.push(step, params)  # the first version; the generator side starts with it
        self.source = BatchProducer(ctl, self.queue, self.first_index, self.timeline, self.sample)
        self.source.start()

    def take(self, step: int, params) -> Taken:
        c = self.config
        depth = self.queue.depth
        self.wait_turn(step)
        batch, staleness = unwrap(self.queue.get, c.stall_timeout_s)
        metrics = dict(batch.metrics) | {
            "data/batch_index": float(batch.batch_index),
            "async/generator_version": float(batch.policy_version),
            "async/staleness": float(staleness),
            "async/queue_depth": float(depth),
        }
        return Taken(batch.rollouts, metrics, {"stale": f"{staleness}"})

    def wait_turn(self, step: int) -> None:
        """A job of several processes, each running both roles: batch step + lag is sampled
        before this step trains (module docstring)."""
        c = self.config
        if self.in_turns:
            position = min(step + c.lag + 1, c.total_steps)
            unwrap(self.source.wait_sampled, position, c.stall_timeout_s)

    def push(self, version: int, params) -> dict[str, float]:
        c = self.config
        needed = push_needed(c, version, self.first_index)
        return publish(self.controller.weights, params, version, c.stall_timeout_s, needed)

    def trained(self, step: int, params) -> dict[str, float]:
        c = self.config
        self.queue.advance(step)
        metrics = self.push(step, params)
        stats = self.queue.stats
        sampled = (stats.consumed_batches + stats.dropped_batches) * c.num_prompts * c.oversample
        return metrics | queue_metrics(stats) | {"data/prompts_sampled": float(sampled)}

    def snapshot(self, step: int) -> dict:
        """The async run state (module docstring); fixed lag first waits until every batch that
        needs a version older than `step` is generated and queued, since the saved weights
        cannot regenerate them."""
        c = self.config
        if c.schedule == "fixed_lag":
            position = min(step + c.lag, c.total_steps)
            unwrap(self.queue.wait_for_position, position, c.stall_timeout_s)
        pending, next_index, stats = self.queue.snapshot()
        return {
            "mode": "async",
            "schedule": c.schedule,
            "lag": c.lag,
            "generator_version": self.source.version,
            "data_position": next_index,
            "pending_rollouts": [batch.to_json() for batch in pending],
            "queue_stats": stats.to_json(),
        }

    def stop(self, failed: bool) -> None:
        if self.source is not None:
            self.source.stop(timeout_s=10.0 if failed else self.config.stall_timeout_s)


def restore_queue(config: RLConfig, step: int, extra: dict | None) -> RolloutQueue:
    """A fresh queue at step 0, else the checkpoint's (refused when another schedule wrote it)."""
    c = config
    if step == 0:
        return RolloutQueue(c.queue_size, c.max_staleness)
    check_resumable(step, extra, {"mode": "async", "schedule": c.schedule, "lag": c.lag})
    return RolloutQueue(
        c.queue_size,
        c.max_staleness,
        trainer_version=step,
        next_index=int(extra["data_position"]),
        pending=[ScoredBatch.from_json(b) for b in extra["pending_rollouts"]],
        stats=QueueStats.from_json(extra["queue_stats"]),
    )


class BatchProducer(GeneratorThread):
    """The generator thread (`GeneratorThread`'s life cycle): acquire the batch's weights ->
    sample and score (`sample`) -> queue, in batch index order."""

    def __init__(
        self,
        controller: ControllerView,
        queue: RolloutQueue,
        first_index: int,
        timeline: BusyTimeline | None = None,
        sample: SampleBatch = sample_batch,
    ):
        super().__init__(controller, queue, timeline)
        self.index, self.sample = first_index, sample
        self._sampled = threading.Condition()  # notified as `index` grows, or on failure
        self._error: QueueClosed | None = None

    def wait_sampled(self, count: int, timeout: float | None = None) -> None:
        """Waits until batches [0, count) are sampled and scored (queued or not)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._sampled:
            while self.index < count:
                if self._error is not None:
                    raise self._error
                wait_until(self._sampled, deadline, f"the generator to sample batch {count - 1}")

    def produce(self) -> None:
        c = self.controller.config
        while c.schedule == "free_running" or self.index < c.total_steps:
            self.queue.put(self._sample_next())

    def _sample_next(self) -> ScoredBatch:
        """Samples and scores batch `self.index`."""
        ctl, k = self.controller, self.index
        params = ctl.weights.acquire(version_for(ctl.config, k))
        self.version = params.version
        self.timeline.begin(time.perf_counter())
        batch = self.sample(ctl, k, params)
        self.timeline.end(time.perf_counter())
        with self._sampled:
            self.index += 1
            self._sampled.notify_all()
        return batch

    def where(self) -> str:
        return f"the generator thread at batch {self.index} (policy version {self.version})"

    def failed(self, error: BaseException) -> None:
        with self._sampled:
            self._error = QueueClosed(error)
            self._sampled.notify_all()

"""The single controller: one Python loop that drives the generator, reward and trainer executors.

Sync mode (the colocated "DeepSpeed-Chat-like" baseline): for step k, generate batch k with the
current weights (policy version k), score it, train on it, repeat. Generation and training share
the trainer mesh; every sample is exactly on-policy (in fp32, log pi == log mu up to rounding).

Data and randomness are functions of the step: batch k holds prompts
`[k * num_prompts, (k + 1) * num_prompts)` of the task's stream, and its sampling key is
`f(seed, version, k)`. A checkpoint therefore needs only the train state and the step to continue
bit for bit.

Async mode (LlamaRL): the generator samples on its own mesh in a producer thread while the
trainer trains on the main thread; a bounded `RolloutQueue` between them enforces `max_staleness`
on admission and on consumption, and after every optimizer step the trainer pushes its weights to
the generator device to device (`GeneratorWeights`: a double buffer, so a batch never samples
from half-updated weights). A thread rather than overlapped dispatch alone, because the host must
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

Dynamic sampling (`RLConfig.oversample`): a batch samples `oversample x num_prompts` prompts and
the trainer gets the `num_prompts` groups whose rewards differ first (`select_groups`).

In a job of several processes every process runs this controller on the same data (fixed lag
only), and the device work of the two threads takes turns in the same order everywhere: batch
k + lag is sampled before step k + 1 trains (`in_turns`; host work still overlaps). Programs the
two threads put on the devices concurrently, in orders that differ between processes, hung
2-process CPU jobs over gloo.

The checkpoint of an async run holds, besides the train state, the scored rollouts still queued
(sampled by versions older than the checkpointed weights, so they could not be regenerated),
the data position (next batch index to generate), the generator's version and the queue's
cumulative counts. Under fixed lag a save first waits until every batch that needs a version
older than the trainer's is generated, so the resumed run continues exactly.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import jax

from jaxrl.evaluation import evaluate
from jaxrl.generation.executor import GeneratorExecutor
from jaxrl.generation.sampling import Sampler
from jaxrl.infra.closable import QueueClosed, unwrap, wait_until
from jaxrl.loop.config import ControllerIO, RLConfig, check_controller_inputs
from jaxrl.loop.report import BusyTimeline, StepClock, StepReport, queue_metrics
from jaxrl.loop.reward import RewardExecutor
from jaxrl.loop.rollout_queue import QueueStats, RolloutQueue, ScoredBatch
from jaxrl.rl import collate_rollouts, select_groups
from jaxrl.run_io import to_host
from jaxrl.sync.store import GeneratorWeights
from jaxrl.tasks.source import PromptSource, encode_prompts
from jaxrl.trainer import Params, Trainer, TrainState

logger = logging.getLogger(__name__)


class Controller:
    """Drives generator, reward and trainer executors for `config.total_steps` steps.

    Args:
      config: the run (validated here; a misconfigured one raises ValueError naming the field).
      trainer: the `Trainer` (its `loss.temperature` must be `config.temperature`).
      generator: a `GeneratorExecutor` built with `sampling_config(config)` and
        `config.samples_per_prompt`.
      rewarder: a `RewardExecutor` (decodes without special tokens, scores with `reward`).
      source: a `jaxrl.tasks.source.PromptSource`; batch k samples items
        [k * m, (k + 1) * m) with m = num_prompts * oversample.
      tokenizer: encodes prompts (`tokenizer.encode(text)`) and gives `pad_token_id`.
      io: a `ControllerIO` (`jaxrl.run_io.RunIO` for checkpoints and metrics).
      reward: the reward name or function evaluations use.
      ref_params: a frozen reference policy for the KL term (`LossConfig.kl_coef > 0`).
      weights (async mode): the generator's weight store, fed by the trainer's pushes.
      eval_sampler: samples from the trainer's params (default: the generator's sampler, which in
        sync mode is on the trainer mesh).
    """

    def __init__(
        self,
        config: RLConfig,
        trainer: Trainer,
        generator: GeneratorExecutor,
        rewarder: RewardExecutor,
        source: PromptSource,
        tokenizer,
        io: ControllerIO,
        *,
        reward,
        ref_params: Params | None = None,
        weights: GeneratorWeights | None = None,
        eval_sampler: Sampler | None = None,
        learning_rate: Callable[[int], float] | None = None,
    ):
        """`weights` (async mode): the generator's weight store, fed by the trainer's pushes.
        `eval_sampler`: samples from the trainer's params (default: the generator's sampler,
        which in sync mode is on the trainer mesh). `learning_rate`: the optimizer's schedule
        (update index -> rate), logged as `learning_rate` every step."""
        check_controller_inputs(config, trainer, generator, source, io)
        if config.mode == "async" and weights is None:
            raise ValueError("async mode needs `weights`: the generator's own mesh and WeightSync")
        self.config, self.trainer, self.generator, self.rewarder = (
            config,
            trainer,
            generator,
            rewarder,
        )
        self.source, self.tokenizer, self.io, self.reward = source, tokenizer, io, reward
        self.ref_params, self.weights = ref_params, weights
        self.learning_rate = learning_rate
        self.eval_sampler = eval_sampler or generator.sampler
        # Async mode in a job of several processes: the two threads' device work takes turns.
        self.in_turns = config.mode == "async" and jax.process_count() > 1
        self.eval_items = source.eval_items(config.eval_size) if config.eval_size else []
        # Chat-formatted prompts (math_jsonl) carry their special tokens already.
        self.chat_formatted = getattr(source, "chat_formatted", False)
        self.eval_ids = encode_prompts(tokenizer, self.eval_items, self.chat_formatted)

    def evaluate(self, params) -> dict:
        c = self.config
        if not self.eval_items:
            return {}
        return evaluate(
            self.eval_sampler,
            params,
            self.tokenizer,
            self.reward,
            self.eval_items,
            self.eval_ids,
            max_new_tokens=c.max_new_tokens,
            samples=c.eval_samples,
            temperature=c.temperature,
            seed=c.seed,
        )

    def prompts(self, batch_index: int):
        """The prompts batch `batch_index` samples: the next `num_prompts * oversample` of the
        task's stream."""
        n = self.config.num_prompts * self.config.oversample
        items = [self.source.item(batch_index * n + j) for j in range(n)]
        return items, encode_prompts(self.tokenizer, items, self.chat_formatted)

    def score(self, generated) -> tuple[list, dict]:
        """Rewards of a generated batch, and the `num_prompts` groups the trainer gets."""
        rollouts, metrics = self.rewarder.score(generated)
        if self.config.oversample > 1:
            rollouts, selected = select_groups(rollouts, self.config.num_prompts)
            metrics |= selected
        return rollouts, metrics

    def prompt_bucket(self, prompt_ids) -> int:
        """Padded prompt length of a train batch: the sampler's bucket (one compile each)."""
        longest = max(len(p) for p in prompt_ids)
        return next(b for b in self.generator.sampler.prompt_buckets if b >= longest)

    def run(self, state: TrainState, extra: dict | None = None) -> TrainState:
        """Trains to `total_steps`; `extra` is the restored checkpoint's run state (or None)."""
        if self.config.mode == "sync":
            return self.run_sync(state)
        if self.config.schedule == "streaming":
            from jaxrl.loop.streaming import run_streaming  # it builds on this module's helpers

            return run_streaming(self, state, extra)
        return self.run_async(state, extra)

    def run_sync(self, state: TrainState) -> TrainState:
        c = self.config
        step = int(state.step)
        timeline = BusyTimeline()  # generation and scoring, here on the trainer's thread
        report = self.step_report(StepClock(timeline))
        report.start(step, state.params)
        while step < c.total_steps:
            t0 = time.perf_counter()
            timeline.begin(t0)
            items, prompt_ids = self.prompts(step)
            generated = self.generator.generate(state.params, items, prompt_ids, step, step)
            rollouts, metrics = self.score(generated)
            timeline.end(time.perf_counter())
            batch = collate_rollouts(
                rollouts,
                prompt_len=self.prompt_bucket(prompt_ids),
                completion_len=c.max_new_tokens,
                pad_id=self.tokenizer.pad_token_id,
                batch_size=c.batch_size,
            )
            t1 = time.perf_counter()
            state, train_metrics = self.trainer.rl_step(state, batch, self.ref_params)
            train_metrics = to_host(train_metrics)
            t2 = time.perf_counter()
            step += 1
            metrics |= train_metrics | {"time/generate_s": generated.seconds}
            metrics |= self.step_metrics(step, sampled=step * c.num_prompts * c.oversample)
            report.step(
                step,
                state,
                metrics,
                {"reward": f"{metrics['reward/mean']:.3f}"},
                self.extra,
                timing=(t0, t1, t2, int(batch.completion_mask_bt.sum())),
            )
        jax.block_until_ready(state.params)
        return state

    def step_report(self, clock: StepClock | None) -> StepReport:
        c = self.config
        return StepReport(
            self.io,
            total_steps=c.total_steps,
            eval_every_steps=c.eval_every_steps,
            evaluate=self.evaluate,
            clock=clock,
        )

    def step_metrics(self, step: int, sampled: float) -> dict[str, float]:
        """What every mode logs of step `step` besides its batch, train and timing figures:
        the policy version, the prompt counters (`jaxrl.loop.report`) and the learning rate."""
        trained = float(step * self.config.num_prompts)
        counts = {"data/prompts_trained": trained, "data/prompts_sampled": float(sampled)}
        counts["data/prompts_seen"] = counts["data/prompts_sampled"]
        return {"policy_version": float(step)} | counts | self.learning_rate_metrics(step)

    def learning_rate_metrics(self, step: int) -> dict[str, float]:
        """The rate of the update that made `step` (updates count from 0)."""
        if self.learning_rate is None:
            return {}
        return {"learning_rate": float(self.learning_rate(step - 1))}

    def extra(self, step: int) -> dict:
        return {
            "stage": "rl",
            "policy_version": step,
            "generator_version": step,
            "data_position": step,
            "prompts_trained": step * self.config.num_prompts,
            "seed": self.config.seed,
        }

    # --- async mode ------------------------------------------------------------------------------

    def run_async(self, state: TrainState, extra: dict | None = None) -> TrainState:
        c = self.config
        step = int(state.step)
        queue = self.restore_queue(step, extra)
        first_index = queue.next_index
        report = self.step_report(None)
        if step == 0:
            self.io.log(0, self.evaluate(state.params), {})
        self.publish(state.params, step, first_index)
        producer = BatchProducer(self, queue, first_index)
        report.clock = StepClock(producer.timeline)
        report.start(step)
        producer.start()
        n = c.num_prompts * c.oversample
        try:
            while step < c.total_steps:
                depth = queue.depth
                t0 = time.perf_counter()
                if self.in_turns:  # batch step + lag is sampled before this step trains
                    position = min(step + c.lag + 1, c.total_steps)
                    unwrap(producer.wait_sampled, position, c.stall_timeout_s)
                batch, staleness = unwrap(queue.get, c.stall_timeout_s)
                t1 = time.perf_counter()
                train_batch = self.collate(batch.rollouts)
                state, train_metrics = self.trainer.rl_step(state, train_batch, self.ref_params)
                train_metrics = to_host(train_metrics)
                t2 = time.perf_counter()
                step += 1
                queue.advance(step)
                metrics = dict(batch.metrics) | train_metrics
                metrics |= self.publish(state.params, step, first_index)
                stats = queue.stats
                metrics |= self.step_metrics(
                    step, sampled=(stats.consumed_batches + stats.dropped_batches) * n
                )
                metrics |= {
                    "data/batch_index": float(batch.batch_index),
                    "async/generator_version": float(batch.policy_version),
                    "async/staleness": float(staleness),
                    "async/queue_depth": float(depth),
                } | queue_metrics(stats)
                # Under fixed lag a save waits for the generator: idle time, counted next step.
                report.step(
                    step,
                    state,
                    metrics,
                    {"reward": f"{metrics['reward/mean']:.3f}", "stale": f"{staleness}"},
                    lambda step: self.async_snapshot(step, queue, producer),
                    timing=(t0, t1, t2, int(train_batch.completion_mask_bt.sum())),
                )
        except BaseException:
            producer.stop(timeout_s=10.0)
            raise
        producer.stop(timeout_s=c.stall_timeout_s)
        jax.block_until_ready(state.params)
        return state

    def version_for(self, batch_index: int) -> int | None:
        """The policy version batch `batch_index` is sampled with (None: the newest held)."""
        if self.config.schedule == "fixed_lag":
            return max(batch_index - self.config.lag, 0)
        return None

    def push_needed(self, version: int, first_index: int) -> bool:
        """Whether a batch still to generate (from `first_index` on) is sampled with `version`,
        so the trainer pushes it. Under fixed lag the generator knows the same, which a
        role-split job needs: both sides issue each cross-process push (`jaxrl.loop.roles`)."""
        c = self.config
        if c.schedule == "fixed_lag":
            lowest = max(first_index - c.lag, 0)
            return lowest <= version <= max(c.total_steps - 1 - c.lag, 0)
        return version < c.total_steps

    def publish(self, params: Params, version: int, first_index: int) -> dict:
        """Pushes `params` to the generator as `version` if some batch still to generate (from
        `first_index` on) will be sampled with it."""
        c = self.config
        if not self.push_needed(version, first_index):
            return {"time/sync_s": 0.0}
        sync, waited = unwrap(self.weights.publish, params, version, c.stall_timeout_s)
        return {
            "time/sync_s": sync.seconds,
            "time/sync_wait_s": waited,
            "sync/gbps": sync.gbps,
            # one copy of what was pushed (LoRA: the adapters only), in the generator dtype
            "sync/bytes_pushed": float(sync.params_bytes),
        }

    def collate(self, rollouts):
        c = self.config
        return collate_rollouts(
            rollouts,
            prompt_len=self.prompt_bucket([r.prompt_ids for r in rollouts]),
            completion_len=c.max_new_tokens,
            pad_id=self.tokenizer.pad_token_id,
            batch_size=c.batch_size,
        )

    def async_snapshot(self, step: int, queue: RolloutQueue, producer) -> dict:
        """The checkpoint's run state of an async run at `step`: first (fixed lag) waits until
        every batch that needs a version older than `step` is generated and queued, since the
        saved weights cannot regenerate them."""
        c = self.config
        if c.schedule == "fixed_lag":
            position = min(step + c.lag, c.total_steps)
            unwrap(queue.wait_for_position, position, c.stall_timeout_s)
        pending, next_index, stats = queue.snapshot()
        return self.extra(step) | {
            "mode": "async",
            "schedule": c.schedule,
            "lag": c.lag,
            "generator_version": producer.version,
            "data_position": next_index,
            "pending_rollouts": [batch.to_json() for batch in pending],
            "queue_stats": stats.to_json(),
        }

    def restore_queue(self, step: int, extra: dict | None) -> RolloutQueue:
        c = self.config
        if step == 0:
            return RolloutQueue(c.queue_size, c.max_staleness)
        saved = {k: (extra or {}).get(k) for k in ("mode", "schedule", "lag")}
        if saved != {"mode": "async", "schedule": c.schedule, "lag": c.lag}:
            raise ValueError(
                f"the checkpoint at step {step} was written by a run with {saved}, not "
                f"mode='async', schedule={c.schedule!r}, lag={c.lag}; continue it with its own "
                "config, or start a fresh workdir"
            )
        return RolloutQueue(
            c.queue_size,
            c.max_staleness,
            trainer_version=step,
            next_index=int(extra["data_position"]),
            pending=[ScoredBatch.from_json(b) for b in extra["pending_rollouts"]],
            stats=QueueStats.from_json(extra["queue_stats"]),
        )


class BatchProducer:
    """The generator thread: acquire the batch's weights -> sample -> score -> queue, in batch
    index order. Its failure closes the queue and the weight store with the error, which the
    trainer re-raises at its next wait; the trainer's `stop()` closes them without one."""

    def __init__(self, controller: Controller, queue: RolloutQueue, first_index: int):
        self.controller, self.queue = controller, queue
        self.index = first_index
        self.version: int | None = None  # the version of the last batch sampled
        self.timeline = BusyTimeline()
        self._sampled = threading.Condition()  # notified as `index` grows, or on failure
        self._error: QueueClosed | None = None
        self._thread = threading.Thread(target=self._run, name="jaxrl-generator", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self.queue.close()
        self.controller.weights.close()
        self._thread.join(timeout_s)
        if self._thread.is_alive():  # inside a generate call; a daemon, so exit does not wait
            logger.warning("the generator thread did not stop within %.0fs", timeout_s)
        else:
            self.controller.weights.free()

    def wait_sampled(self, count: int, timeout: float | None = None) -> None:
        """Waits until batches [0, count) are sampled and scored (queued or not)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._sampled:
            while self.index < count:
                if self._error is not None:
                    raise self._error
                wait_until(self._sampled, deadline, f"the generator to sample batch {count - 1}")

    def _sample_next(self) -> ScoredBatch:
        """Samples and scores batch `self.index`."""
        ctl, k = self.controller, self.index
        params = ctl.weights.acquire(ctl.version_for(k))
        self.version = params.version
        self.timeline.begin(time.perf_counter())
        items, prompt_ids = ctl.prompts(k)
        generated = ctl.generator.generate(params.params, items, prompt_ids, params.version, k)
        rollouts, metrics = ctl.score(generated)
        self.timeline.end(time.perf_counter())
        metrics["time/generate_s"] = generated.seconds
        with self._sampled:
            self.index += 1
            self._sampled.notify_all()
        return ScoredBatch(k, params.version, rollouts, metrics)

    def _run(self) -> None:
        ctl = self.controller
        c = ctl.config
        try:
            while c.schedule == "free_running" or self.index < c.total_steps:
                self.queue.put(self._sample_next())
        except QueueClosed:
            return  # stopped by the trainer: the run ended, or failed on the trainer's side
        except BaseException as error:
            error.add_note(
                f"[jaxrl] raised in the generator thread at batch {self.index} (policy version "
                f"{self.version}); the run stops, its last checkpoint is intact"
            )
            self.queue.close(error)
            ctl.weights.close(error)
            with self._sampled:
                self._error = QueueClosed(error)
                self._sampled.notify_all()

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

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import jax

from jaxrl.evaluation import evaluate
from jaxrl.executors import GeneratorExecutor, GeneratorWeights, RewardExecutor
from jaxrl.generation.engine_sampler import EngineSampler
from jaxrl.generation.sampler import Sampler
from jaxrl.generation.sampling import SamplingConfig
from jaxrl.rl import collate_rollouts, select_groups
from jaxrl.rollout_queue import QueueClosed, QueueStats, RolloutQueue, ScoredBatch, wait_until
from jaxrl.run_io import to_host
from jaxrl.tasks.source import PromptSource, encode_prompts
from jaxrl.trainer import Params, Trainer, TrainState

logger = logging.getLogger(__name__)
SCHEDULES = ("fixed_lag", "free_running", "streaming")


@dataclasses.dataclass(frozen=True)
class RLConfig:
    """The RL run: batch shape, sampling, schedule of evals and saves.

    Each step trains on `num_prompts x samples_per_prompt` completions of at most
    `max_new_tokens` tokens, sampled at `temperature` (no top-k / top-p: the trainer's log pi
    must be the sampling distribution's). `eval_size=0` turns evaluation off.

    oversample: dynamic sampling (DAPO). Each batch samples `num_prompts * oversample` prompts
      and trains on `num_prompts` of them, those whose completions got different rewards first
      (`jaxrl.rl.select_groups`: a group with one reward for all its samples has zero advantage
      and adds no gradient). 1 trains on every sampled prompt. Under "streaming" a group with
      one reward is left out as it finishes (counted), as long as the groups left out stay
      within `oversample - 1` per group queued (`GroupQueue.filter`): the same sampling budget.

    Async mode (`mode="async"`, the generator on its own mesh):
      schedule: "fixed_lag" (reproducible: batch k sampled by version max(k - lag, 0)) or
        "free_running" (the newest weights, as fast as the queue allows).
      lag: fixed_lag's distance in policy versions; 0 = on-policy, no overlap.
      max_staleness: largest trainer-minus-generator version gap a trained sample may have;
        staler batches are dropped and counted. Fixed lag needs max_staleness >= lag.
      queue_size: scored batches the queue holds (fixed lag needs >= lag).
      stall_timeout_s: the trainer gives up (TimeoutError) after waiting this long for rollouts.
      "streaming" (`jaxrl.streaming`): the engine never drains; each step trains on the next
        `num_prompts` groups to finish, new weights are swapped into the running engine between
        decode steps (a trajectory may span versions), `max_staleness` bounds the oldest token
        of a group (staler groups are dropped and counted), `queue_size` counts batches of
        `num_prompts` groups (no prompt is issued while that many are queued; a finished group
        never waits). Not reproducible bit for bit (timing decides versions).
      stream_in_flight (streaming): how far the generator may run ahead of the queue, in
        groups: a prompt is issued only while queued + in flight < `queue_size x num_prompts`
        + this. -1: the engine's groups (slots / samples_per_prompt), the engine refilled whole
        whenever the queue is empty. Smaller values keep fewer finished groups waiting (lower
        token staleness) at the cost of a partly filled engine while a step's groups finish.
      kv_on_update (streaming): on a swap, "keep" the running rows' KV or "recompute" it with
        the new weights.

    pack_length: > 0 trains on padding-free batches: each rollout's prompt and completion packed
      into rows of this many tokens (`jaxrl.rl.packing`; at least the longest prompt plus
      `max_new_tokens`); 0 trains on padded `[prompts x (prompt bucket + max_new_tokens)]`
      rectangles.
    share_prompts: packed batches lay each group out as `[prompt, completions]`, the prompt
      trained on once (`Trainer(share_prompts)`); None: on whenever `pack_length` > 0.
    """

    mode: str = "sync"
    total_steps: int = 1000
    num_prompts: int = 16
    samples_per_prompt: int = 8
    oversample: int = 1
    max_new_tokens: int = 6
    temperature: float = 1.0
    eval_every_steps: int = 250
    eval_size: int = 512
    eval_samples: int = 4
    save_every_steps: int = 250
    keep_last_n: int = 2
    log_every_steps: int = 50
    seed: int = 0
    shuffle_rewards: bool = False
    schedule: str = "fixed_lag"
    lag: int = 1
    max_staleness: int = 1
    queue_size: int = 2
    stall_timeout_s: float = 900.0
    pack_length: int = 0
    share_prompts: bool | None = None
    kv_on_update: str = "keep"
    stream_in_flight: int = -1

    def validate(self) -> None:
        if self.mode not in ("sync", "async"):
            raise ValueError(f"mode={self.mode!r}; use 'sync' (colocated) or 'async'")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r}; use one of {SCHEDULES}")
        if self.lag < 0 or self.max_staleness < 0:
            raise ValueError(f"lag={self.lag} and max_staleness={self.max_staleness} must be >= 0")
        if self.schedule == "fixed_lag" and self.max_staleness < self.lag:
            raise ValueError(
                f"max_staleness={self.max_staleness} < lag={self.lag}: under a fixed lag every "
                "batch is `lag` versions old, so all of them would be dropped"
            )
        if self.schedule == "fixed_lag" and self.queue_size < self.lag:
            raise ValueError(
                f"queue_size={self.queue_size} < lag={self.lag}: the queue must hold the `lag` "
                "batches sampled ahead of the trainer"
            )
        if self.kv_on_update not in ("keep", "recompute"):
            raise ValueError(f"kv_on_update={self.kv_on_update!r}; use 'keep' or 'recompute'")
        if self.schedule == "streaming" and self.mode != "async":
            raise ValueError(
                f"schedule='streaming' with mode={self.mode!r}: streaming is an async schedule "
                "(mode='async')"
            )
        if self.stream_in_flight < -1:
            raise ValueError(
                f"RLConfig.stream_in_flight={self.stream_in_flight}; use -1 (the engine's "
                "groups) or a count of groups >= 0"
            )
        if self.queue_size < 1 or not self.stall_timeout_s > 0:
            raise ValueError("queue_size must be >= 1 and stall_timeout_s > 0")
        for name in (
            "total_steps",
            "num_prompts",
            "samples_per_prompt",
            "oversample",
            "max_new_tokens",
            "eval_every_steps",
            "save_every_steps",
            "keep_last_n",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"RLConfig.{name}={getattr(self, name)} must be >= 1")
        if not self.temperature > 0:
            raise ValueError(f"RLConfig.temperature={self.temperature} must be > 0")
        if self.pack_length < 0:
            raise ValueError(
                f"RLConfig.pack_length={self.pack_length}: use 0 (padded) or a row length"
            )

    @property
    def batch_size(self) -> int:
        return self.num_prompts * self.samples_per_prompt


@runtime_checkable
class ControllerIO(Protocol):
    """What the controller needs of a run's I/O. `jaxrl.run_io.RunIO` (checkpoints, metrics.jsonl,
    TensorBoard, progress) is the launchers'; a script may pass anything with these methods
    (e.g. one that keeps metrics in memory and never saves)."""

    def start(self, step: int) -> None:
        """The loop starts (or resumes) at `step`."""

    def log(self, step: int, metrics: dict[str, float], headline: dict[str, str]) -> Any:
        """Metrics of `step` (step 0: the evaluation before training); `headline`: a few
        formatted values for a progress line. May raise to stop the run (e.g. a NaN loss)."""

    def save_due(self, step: int, force: bool = False) -> bool:
        """Whether `save` would write `step` (`force`: the final step)."""

    def save(self, state: TrainState, extra: dict, *, force: bool = False) -> None:
        """Checkpoints `state` and `extra` (JSON-able run state) when due."""

    def after_step(self, step: int) -> None:
        """Called after every step's log and save (fault hooks, preemption)."""


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
        eval_sampler: EngineSampler | Sampler | None = None,
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
            from jaxrl.streaming import run_streaming  # it builds on this module's helpers

            return run_streaming(self, state, extra)
        return self.run_async(state, extra)

    def run_sync(self, state: TrainState) -> TrainState:
        c = self.config
        step = int(state.step)
        if step == 0:
            self.io.log(0, self.evaluate(state.params), {})
        self.io.start(step)
        while step < c.total_steps:
            t0 = time.perf_counter()
            items, prompt_ids = self.prompts(step)
            generated = self.generator.generate(state.params, items, prompt_ids, step, step)
            rollouts, metrics = self.score(generated)
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
            tokens = int(batch.completion_mask_bt.sum())
            metrics |= train_metrics
            metrics |= {
                "policy_version": float(step),
                "time/generate_s": generated.seconds,
                "time/train_s": t2 - t1,
                "time/step_s": t2 - t0,
                "throughput/tokens_per_s": tokens / (t2 - t0),
                "data/prompts_seen": float(step * c.num_prompts * c.oversample),
            } | self._learning_rate(step)
            if step % c.eval_every_steps == 0 or step == c.total_steps:
                metrics |= self.evaluate(state.params)
            headline = {"reward": f"{metrics['reward/mean']:.3f}"}
            if "eval/accuracy" in metrics:
                headline["acc"] = f"{metrics['eval/accuracy']:.3f}"
            self.io.log(step, metrics, headline)
            self.io.save(state, self.extra(step), force=step == c.total_steps)
            self.io.after_step(step)
        jax.block_until_ready(state.params)
        return state

    def _learning_rate(self, step: int) -> dict[str, float]:
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
        queue = self._restore_queue(step, extra)
        first_index = queue.next_index
        if step == 0:
            self.io.log(0, self.evaluate(state.params), {})
        self._publish(state.params, step, first_index)
        producer = _Producer(self, queue, first_index)
        clock = _StepClock(producer.timeline)
        self.io.start(step)
        producer.start()
        save_wait = 0.0
        try:
            while step < c.total_steps:
                depth = queue.depth
                t0 = time.perf_counter()
                if self.in_turns:  # batch step + lag is sampled before this step trains
                    position = min(step + c.lag + 1, c.total_steps)
                    _unwrap(producer.wait_sampled, position, c.stall_timeout_s)
                batch, staleness = _unwrap(queue.get, c.stall_timeout_s)
                t1 = time.perf_counter()
                train_batch = self._collate(batch.rollouts)
                state, train_metrics = self.trainer.rl_step(state, train_batch, self.ref_params)
                train_metrics = to_host(train_metrics)
                t2 = time.perf_counter()
                step += 1
                queue.advance(step)
                metrics = dict(batch.metrics) | train_metrics
                metrics |= self._publish(state.params, step, first_index)
                if step % c.eval_every_steps == 0 or step == c.total_steps:
                    metrics |= self.evaluate(state.params)
                metrics |= clock.tick(train_start=t1, train_end=t2)
                metrics |= {
                    "policy_version": float(step),
                    "time/trainer_idle_s": t1 - t0 + save_wait,
                    "time/train_s": t2 - t1,
                    "throughput/tokens_per_s": int(train_batch.completion_mask_bt.sum())
                    / metrics["time/step_s"],
                    "data/prompts_seen": float(step * c.num_prompts * c.oversample),
                    "data/batch_index": float(batch.batch_index),
                    "async/generator_version": float(batch.policy_version),
                    "async/staleness": float(staleness),
                    "async/queue_depth": float(depth),
                } | self._learning_rate(step)
                metrics |= _queue_metrics(queue.stats)
                headline = {"reward": f"{metrics['reward/mean']:.3f}", "stale": f"{staleness}"}
                if "eval/accuracy" in metrics:
                    headline["acc"] = f"{metrics['eval/accuracy']:.3f}"
                self.io.log(step, metrics, headline)
                # Under fixed lag this waits for the generator: idle time, counted next step.
                save_wait = self._save_async(state, step, queue, producer)
                self.io.after_step(step)
        except BaseException:
            producer.stop(timeout_s=10.0)
            raise
        producer.stop(timeout_s=c.stall_timeout_s)
        jax.block_until_ready(state.params)
        return state

    def _version_for(self, batch_index: int) -> int | None:
        """The policy version batch `batch_index` is sampled with (None: the newest held)."""
        if self.config.schedule == "fixed_lag":
            return max(batch_index - self.config.lag, 0)
        return None

    def push_needed(self, version: int, first_index: int) -> bool:
        """Whether a batch still to generate (from `first_index` on) is sampled with `version`,
        so the trainer pushes it. Under fixed lag the generator knows the same, which a
        role-split job needs: both sides issue each cross-process push (`jaxrl.roles`)."""
        c = self.config
        if c.schedule == "fixed_lag":
            lowest = max(first_index - c.lag, 0)
            return lowest <= version <= max(c.total_steps - 1 - c.lag, 0)
        return version < c.total_steps

    def _publish(self, params: Params, version: int, first_index: int) -> dict:
        """Pushes `params` to the generator as `version` if some batch still to generate (from
        `first_index` on) will be sampled with it."""
        c = self.config
        if not self.push_needed(version, first_index):
            return {"time/sync_s": 0.0}
        sync, waited = _unwrap(self.weights.publish, params, version, c.stall_timeout_s)
        return {
            "time/sync_s": sync.seconds,
            "time/sync_wait_s": waited,
            "sync/gbps": sync.gbps,
            # one copy of what was pushed (LoRA: the adapters only), in the generator dtype
            "sync/bytes_pushed": float(sync.params_bytes),
        }

    def _collate(self, rollouts):
        c = self.config
        return collate_rollouts(
            rollouts,
            prompt_len=self.prompt_bucket([r.prompt_ids for r in rollouts]),
            completion_len=c.max_new_tokens,
            pad_id=self.tokenizer.pad_token_id,
            batch_size=c.batch_size,
        )

    def _save_async(self, state: TrainState, step: int, queue: RolloutQueue, producer) -> float:
        """Saves (when due) the train state and the async state; returns seconds spent waiting
        for the generator first (fixed lag: until every batch that needs a version older than
        `step` is generated and queued, since the saved weights cannot regenerate them)."""
        c = self.config
        force = step == c.total_steps
        if not self.io.save_due(step, force):
            return 0.0
        start = time.perf_counter()
        if c.schedule == "fixed_lag":
            position = min(step + c.lag, c.total_steps)
            _unwrap(queue.wait_for_position, position, c.stall_timeout_s)
        waited = time.perf_counter() - start
        pending, next_index, stats = queue.snapshot()
        extra = self.extra(step) | {
            "mode": "async",
            "schedule": c.schedule,
            "lag": c.lag,
            "generator_version": producer.version,
            "data_position": next_index,
            "pending_rollouts": [batch.to_json() for batch in pending],
            "queue_stats": stats.to_json(),
        }
        self.io.save(state, extra, force=force)
        return waited

    def _restore_queue(self, step: int, extra: dict | None) -> RolloutQueue:
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


def sampling_config(config: RLConfig) -> SamplingConfig:
    """The generator's sampling settings for `config` (no top-k / top-p: see RLConfig)."""
    return SamplingConfig(max_new_tokens=config.max_new_tokens, temperature=config.temperature)


def check_controller_inputs(config: RLConfig, trainer, generator, source, io) -> None:
    """Raises ValueError / TypeError, naming the field and the fix, when the controller's parts
    do not fit together (each would otherwise fail steps later, or silently train wrongly)."""
    if not isinstance(config, RLConfig):
        raise TypeError(f"config must be an RLConfig, got {type(config).__name__}")
    try:
        config.validate()
    except ValueError as e:
        raise ValueError(f"invalid RLConfig: {e}") from None
    if generator.samples_per_prompt != config.samples_per_prompt:
        raise ValueError(
            f"the generator samples {generator.samples_per_prompt} completions per prompt but "
            f"RLConfig.samples_per_prompt={config.samples_per_prompt}; build the "
            "GeneratorExecutor with config.samples_per_prompt"
        )
    wanted = sampling_config(config)
    got = generator.sampling
    if (got.max_new_tokens, got.temperature) != (wanted.max_new_tokens, wanted.temperature):
        raise ValueError(
            f"the generator samples with max_new_tokens={got.max_new_tokens}, temperature="
            f"{got.temperature}, but RLConfig says {wanted.max_new_tokens}, "
            f"{wanted.temperature}; build the GeneratorExecutor with sampling_config(config)"
        )
    loss_temperature = getattr(getattr(trainer, "loss", None), "temperature", config.temperature)
    if loss_temperature != config.temperature:
        raise ValueError(
            f"LossConfig.temperature={loss_temperature} differs from RLConfig.temperature="
            f"{config.temperature}: the trainer must score tokens under the sampling distribution"
        )
    if not isinstance(source, PromptSource):
        raise TypeError(
            f"source {type(source).__name__} is not a PromptSource: it needs item(index) -> "
            "PromptItem and eval_items(limit) -> list[PromptItem]"
        )
    if not isinstance(io, ControllerIO):
        missing = [
            m for m in ("start", "log", "save_due", "save", "after_step") if not hasattr(io, m)
        ]
        raise TypeError(f"io {type(io).__name__} is not a ControllerIO: it lacks {missing}")


def _unwrap(fn, *args):
    """Calls `fn`; a queue or weight store closed by the generator thread's failure raises that
    thread's original exception here (its traceback intact, a note added where it was raised)."""
    try:
        return fn(*args)
    except QueueClosed as closed:
        error = closed.error
    # Raised outside the except block, so the original error is not chained to QueueClosed.
    raise error if error is not None else RuntimeError("the generator thread stopped")


def _queue_metrics(stats: QueueStats) -> dict[str, float]:
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


class _StepClock:
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


class _Producer:
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
        params = ctl.weights.acquire(ctl._version_for(k))
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

"""The single controller: one trainer loop that drives the generator, reward and trainer
executors, whatever the schedule.

Data and randomness are functions of the step: batch k holds prompts
`[k * m, (k + 1) * m)` of the task's stream (m = num_prompts x oversample), and its sampling key
is `f(seed, version, k)`. Where batches come from is the feed's business (`jaxrl.loop.feeds`):
sync mode generates each batch on the trainer's mesh (`colocated`); async mode samples on the
generator's own mesh in a thread, a fixed lag behind or free running (`lagged`), or keeps an
engine full and swaps weights in flight (`streaming`); a role-split job's trainer processes get
batches from generator processes (`remote`, see `jaxrl.loop.roles`). The loop is the same:

    take the next batch -> train -> the feed advances the queue and pushes the new weights ->
    the step report (evaluate when due, time, log, save when due, after-step hooks)

Dynamic sampling (`RLConfig.oversample`): a batch samples `oversample x num_prompts` prompts and
the trainer gets the `num_prompts` groups whose rewards differ first (`select_groups`).

A checkpoint holds the train state and JSON run state: `extra(step)` plus the feed's
`snapshot(step)` (async: the queued rollouts, the data position, the queue's counts), so a
resumed run continues exactly (fixed lag and sync: bit for bit).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import jax

from jaxrl.generation.executor import GeneratorExecutor
from jaxrl.generation.sampling import Sampler
from jaxrl.infra.run_io import to_host
from jaxrl.loop.config import ControllerIO, RLConfig, check_controller_inputs
from jaxrl.loop.feeds import feed_class
from jaxrl.loop.feeds.base import RolloutFeed
from jaxrl.loop.report import StepClock, StepReport
from jaxrl.loop.reward import RewardExecutor
from jaxrl.rl import collate_rollouts, select_groups
from jaxrl.sync.store import GeneratorWeights
from jaxrl.tasks.source import PromptSource, encode_prompts
from jaxrl.train.evaluation import evaluate
from jaxrl.train.state import Params, TrainState
from jaxrl.train.trainer import Trainer

# completion/truncated above this share at a launch's first step is warned about.
TRUNCATED_WARNING = 0.5


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
      io: a `ControllerIO` (`jaxrl.infra.run_io.RunIO` for checkpoints and metrics).
      reward: the reward name or function evaluations use.
      ref_params: a frozen reference policy for the KL term (`LossConfig.kl_coef > 0`).
      weights (async mode): the generator's weight store, fed by the trainer's pushes.
      eval_sampler: samples from the trainer's params (default: the generator's sampler, which in
        sync mode is on the trainer mesh).
      feed: where batches come from (`jaxrl.loop.feeds`; default: the config's schedule).
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
        feed: Callable[[Controller], RolloutFeed] | None = None,
    ):
        """`weights` (async mode): the generator's weight store, fed by the trainer's pushes.
        `eval_sampler`: samples from the trainer's params (default: the generator's sampler,
        which in sync mode is on the trainer mesh). `learning_rate`: the optimizer's schedule
        (update index -> rate), logged as `learning_rate` every step. `feed`: builds the
        rollout feed from this controller (default: the config's, `feeds.feed_class`)."""
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
        self.eval_items = source.eval_items(config.eval_size) if config.eval_size else []
        # Chat-formatted prompts (math_jsonl) carry their special tokens already.
        self.chat_formatted = getattr(source, "chat_formatted", False)
        self.eval_ids = encode_prompts(tokenizer, self.eval_items, self.chat_formatted)
        self.feed: RolloutFeed = (feed or feed_class(config))(self)

    def evaluate(self, params) -> dict:
        c = self.config
        if not self.eval_items:
            return {}
        if hasattr(self.feed, "evaluate"):  # multi-turn episodes: evaluated as episodes
            return self.feed.evaluate(params, self.eval_items)
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
        c, feed = self.config, self.feed
        step = int(state.step)
        report = StepReport(
            self.io,
            total_steps=c.total_steps,
            eval_every_steps=c.eval_every_steps,
            evaluate=self.evaluate,
            clock=StepClock(feed.timeline),
        )
        report.start(step, state.params)  # evaluates the initial params of a fresh run
        first = True  # this launch's first step: warned about a budget that cuts most samples
        try:
            feed.start(step, state.params, extra)
            while step < c.total_steps:
                t0 = time.perf_counter()
                taken = feed.take(step, state.params)
                t1 = time.perf_counter()
                batch = self.collate(taken.rollouts, taken.prompt_len)
                state, train_metrics = self.trainer.rl_step(state, batch, self.ref_params)
                train_metrics = to_host(train_metrics)
                t2 = time.perf_counter()
                step += 1
                metrics = taken.metrics | train_metrics | feed.trained(step, state.params)
                metrics |= self.truncation_metrics(taken.rollouts, metrics, warn=first)
                first = False
                metrics |= self.step_metrics(step, metrics["data/prompts_sampled"])
                report.step(
                    step,
                    state,
                    metrics,
                    {"reward": f"{metrics['reward/mean']:.3f}"} | taken.headline,
                    lambda step: self.extra(step) | feed.snapshot(step),
                    timing=(t0, t1, t2, int(batch.completion_mask_bt.sum())),
                    histogram=taken.histogram,
                )
        except BaseException:
            feed.stop(failed=True)
            raise
        feed.stop(failed=False)
        jax.block_until_ready(state.params)
        return state

    def truncation_metrics(self, rollouts, metrics: dict, warn: bool) -> dict[str, float]:
        """`completion/truncated`: the share of the trained single-turn samples that no stop
        token ended (cut at `RLConfig.max_new_tokens`; multi-turn episodes report theirs as
        `episode/truncated_fraction`). With `warn` (a launch's first step), a warning on
        standard error when most were cut: their rewards score answers that were never finished."""
        if any(k.startswith("episode/") for k in metrics) or not rollouts:
            return {}
        stops = set(self.generator.sampler.eos_ids) | set(self.generator.sampling.stop_ids)
        cut = [
            len(r.completion_ids) == 0 or int(r.completion_ids[-1]) not in stops for r in rollouts
        ]
        share = sum(cut) / len(cut)
        if warn and share > TRUNCATED_WARNING and jax.process_index() == 0:
            budget = self.config.max_new_tokens
            print(
                f"[rl] warning: {share:.0%} of the first step's samples reached "
                f"max_new_tokens={budget} without a stop token, so their answers are cut off "
                "(and most rewards score unfinished answers); raise RLConfig.max_new_tokens",
                file=sys.stderr,
                flush=True,
            )
        return {"completion/truncated": share}

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

    def collate(self, rollouts, prompt_len: int | None = None):
        """The train batch of `rollouts`, prompts padded to `prompt_len` (None: the sampler's
        bucket of the longest)."""
        c = self.config
        if prompt_len is None:
            prompt_len = self.prompt_bucket([r.prompt_ids for r in rollouts])
        return collate_rollouts(
            rollouts,
            prompt_len=prompt_len,
            completion_len=c.max_new_tokens,
            pad_id=self.tokenizer.pad_token_id,
            batch_size=c.batch_size,
        )

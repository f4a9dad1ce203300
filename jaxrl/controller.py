"""The single controller: one Python loop that drives the generator, reward and trainer executors.

Sync mode (the colocated "DeepSpeed-Chat-like" baseline): for step k, generate batch k with the
current weights (policy version k), score it, train on it, repeat. Generation and training share
the trainer mesh; every sample is exactly on-policy (in fp32, log pi == log mu up to rounding).

Data and randomness are functions of the step: batch k holds prompts
`[k * num_prompts, (k + 1) * num_prompts)` of the task's stream, and its sampling key is
`f(seed, version, k)`. A checkpoint therefore needs only the train state and the step to continue
bit for bit.
"""

from __future__ import annotations

import dataclasses
import time

import jax

from jaxrl.evaluation import evaluate
from jaxrl.executors import GeneratorExecutor, RewardExecutor
from jaxrl.generation.sampling import SamplingConfig
from jaxrl.rl import collate_rollouts
from jaxrl.run_io import RunIO, to_host
from jaxrl.tasks.source import encode_prompts
from jaxrl.trainer import Params, Trainer, TrainState


@dataclasses.dataclass(frozen=True)
class RLConfig:
    """The RL run: batch shape, sampling, schedule of evals and saves.

    Each step trains on `num_prompts x samples_per_prompt` completions of at most
    `max_new_tokens` tokens, sampled at `temperature` (no top-k / top-p: the trainer's log pi
    must be the sampling distribution's).
    """

    mode: str = "sync"
    total_steps: int = 1000
    num_prompts: int = 16
    samples_per_prompt: int = 8
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

    def validate(self) -> None:
        if self.mode not in ("sync",):
            raise ValueError(f"mode={self.mode!r}; supported: 'sync'")
        for name in (
            "total_steps",
            "num_prompts",
            "samples_per_prompt",
            "max_new_tokens",
            "eval_every_steps",
            "save_every_steps",
            "keep_last_n",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"RLConfig.{name}={getattr(self, name)} must be >= 1")
        if not self.temperature > 0:
            raise ValueError(f"RLConfig.temperature={self.temperature} must be > 0")

    @property
    def batch_size(self) -> int:
        return self.num_prompts * self.samples_per_prompt


class Controller:
    def __init__(
        self,
        config: RLConfig,
        trainer: Trainer,
        generator: GeneratorExecutor,
        rewarder: RewardExecutor,
        source,
        tokenizer,
        io: RunIO,
        *,
        reward,
        ref_params: Params | None = None,
    ):
        self.config, self.trainer, self.generator, self.rewarder = (
            config,
            trainer,
            generator,
            rewarder,
        )
        self.source, self.tokenizer, self.io, self.reward = source, tokenizer, io, reward
        self.ref_params = ref_params
        self.eval_items = source.eval_items(config.eval_size)
        self.eval_ids = encode_prompts(tokenizer, self.eval_items, chat_formatted=False)

    def evaluate(self, params) -> dict:
        c = self.config
        return evaluate(
            self.generator.sampler,
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
        n = self.config.num_prompts
        items = [self.source.item(batch_index * n + j) for j in range(n)]
        return items, encode_prompts(self.tokenizer, items, chat_formatted=False)

    def prompt_bucket(self, prompt_ids) -> int:
        """Padded prompt length of a train batch: the sampler's bucket (one compile each)."""
        longest = max(len(p) for p in prompt_ids)
        return next(b for b in self.generator.sampler.prompt_buckets if b >= longest)

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
            rollouts, metrics = self.rewarder.score(generated)
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
                "data/prompts_seen": float(step * c.num_prompts),
            }
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

    def extra(self, step: int) -> dict:
        return {
            "stage": "rl",
            "policy_version": step,
            "generator_version": step,
            "data_position": step,
            "prompts_trained": step * self.config.num_prompts,
            "seed": self.config.seed,
        }


def sampling_config(config: RLConfig) -> SamplingConfig:
    return SamplingConfig(max_new_tokens=config.max_new_tokens, temperature=config.temperature)

"""The generator and reward executors the controller drives.

GeneratorExecutor: samples `samples_per_prompt` completions of each prompt with the weights of
one policy version, on its mesh, and returns host-side rollouts stamped with that version. Its
sampling key is a function of (seed, policy version, batch index) only, so a resumed or re-run
job draws exactly the same samples.

RewardExecutor: decodes completions and scores them with a registered (or given) reward function;
a reward that raises or returns non-finite values stops the run with a message naming it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import jax
import numpy as np

from jaxrl.generation.sampler import Sampler
from jaxrl.generation.sampling import SamplingConfig
from jaxrl.rl import Rollout
from jaxrl.tasks.rewards import RewardError, compute_rewards
from jaxrl.tasks.source import PromptItem

_SAMPLING_STREAM = 0x5A3


def sampling_key(seed: int, policy_version: int, batch_index: int) -> jax.Array:
    """The key of one generate call: a pure function of (seed, version, batch index)."""
    key = jax.random.fold_in(jax.random.key(seed), _SAMPLING_STREAM)
    return jax.random.fold_in(jax.random.fold_in(key, policy_version), batch_index)


@dataclasses.dataclass
class GeneratedBatch:
    """Rollouts of one generate call, before scoring."""

    items: list[PromptItem]  # one per row (each prompt repeated samples_per_prompt times)
    prompt_ids: list[list[int]]
    completion_ids: list[np.ndarray]
    behaviour_logprobs: list[np.ndarray]
    group_ids: np.ndarray
    policy_version: int
    batch_index: int
    seconds: float


class GeneratorExecutor:
    def __init__(
        self,
        sampler: Sampler,
        sampling: SamplingConfig,
        samples_per_prompt: int,
        seed: int,
    ):
        if sampling.top_k or sampling.top_p < 1.0:
            raise ValueError(
                "RL sampling uses top_k=0 and top_p=1: the trainer's log pi must be computed "
                "under the distribution the behaviour log-probs come from"
            )
        self.sampler, self.sampling = sampler, sampling
        self.samples_per_prompt, self.seed = samples_per_prompt, seed

    def generate(
        self,
        params,
        items: Sequence[PromptItem],
        prompt_ids: Sequence[Sequence[int]],
        policy_version: int,
        batch_index: int,
    ) -> GeneratedBatch:
        start = time.perf_counter()
        n = self.samples_per_prompt
        rows = [list(p) for p in prompt_ids for _ in range(n)]
        out = self.sampler.generate(
            params, rows, self.sampling, sampling_key(self.seed, policy_version, batch_index)
        )
        lengths = out.lengths_b
        return GeneratedBatch(
            items=[it for it in items for _ in range(n)],
            prompt_ids=rows,
            completion_ids=[out.tokens_bn[i, : lengths[i]] for i in range(len(rows))],
            behaviour_logprobs=[out.logprobs_bn[i, : lengths[i]] for i in range(len(rows))],
            group_ids=np.repeat(np.arange(len(items)) + batch_index * len(items), n),
            policy_version=policy_version,
            batch_index=batch_index,
            seconds=time.perf_counter() - start,
        )


class RewardExecutor:
    def __init__(self, reward, tokenizer, *, shuffle_seed: int | None = None):
        """`reward`: a registered reward name or a batched callable. `shuffle_seed` (a control
        experiment) permutes the rewards within each batch, breaking their link to the
        completions."""
        self.reward, self.tokenizer, self.shuffle_seed = reward, tokenizer, shuffle_seed

    def score(self, batch: GeneratedBatch) -> tuple[list[Rollout], dict]:
        start = time.perf_counter()
        texts = self.tokenizer.batch_decode(
            [c.tolist() for c in batch.completion_ids], skip_special_tokens=False
        )
        try:
            rewards = compute_rewards(
                self.reward,
                [it.text for it in batch.items],
                texts,
                [it.reference for it in batch.items],
            )
        except RewardError:
            raise
        except Exception as e:  # a user reward's own failure: stop and say which reward
            name = self.reward if isinstance(self.reward, str) else repr(self.reward)
            raise RewardError(
                f"reward {name!r} raised {type(e).__name__}: {e} (batch {batch.batch_index})"
            ) from e
        raw_mean = float(rewards.mean())
        if self.shuffle_seed is not None:
            rng = np.random.default_rng([self.shuffle_seed, batch.batch_index])
            rewards = rewards[rng.permutation(len(rewards))]
        rollouts = [
            Rollout(
                prompt_ids=np.asarray(batch.prompt_ids[i], np.int32),
                completion_ids=np.asarray(batch.completion_ids[i], np.int32),
                behaviour_logprobs=np.asarray(batch.behaviour_logprobs[i], np.float32),
                policy_version=batch.policy_version,
                reward=float(rewards[i]),
                group_id=int(batch.group_ids[i]),
            )
            for i in range(len(texts))
        ]
        lengths = np.array([len(c) for c in batch.completion_ids])
        metrics = {
            "reward/mean": raw_mean,
            "reward/trained_mean": float(rewards.mean()),
            "completion/mean_tokens": float(lengths.mean()),
            "time/reward_s": time.perf_counter() - start,
        }
        return rollouts, metrics

"""The reward executor: decodes completions and scores them.

Decodes without special tokens (the `<eos>` that ended a completion is not part of its text) and
scores with a registered (or given) reward function; a reward that raises or returns non-finite
values stops the run with a message naming it. A mixture-of-experts generator's routing record
(`GeneratedBatch.routing`, one `[len(prompt) + len(completion), layers, k]` per row; None for a
dense model) goes into each row's `Rollout.routing`.
"""

from __future__ import annotations

import time

import numpy as np

from jaxrl.generation.executor import GeneratedBatch
from jaxrl.rl import Rollout
from jaxrl.tasks.rewards import (
    RewardError,
    compute_rewards,
    decode_completions,
    user_reward_error,
)


class RewardExecutor:
    def __init__(self, reward, tokenizer, *, shuffle_seed: int | None = None):
        """`reward`: a registered reward name or a batched callable. `shuffle_seed` (a control
        experiment) permutes the rewards within each batch, breaking their link to the
        completions."""
        self.reward, self.tokenizer, self.shuffle_seed = reward, tokenizer, shuffle_seed

    def score(self, batch: GeneratedBatch) -> tuple[list[Rollout], dict]:
        start = time.perf_counter()
        texts = decode_completions(self.tokenizer, batch.completion_ids)
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
            raise user_reward_error(self.reward, e, f"batch {batch.batch_index}") from e
        raw_mean = float(rewards.mean())
        if self.shuffle_seed is not None:
            rewards = shuffled_rewards(rewards, self.shuffle_seed, batch.batch_index)
        rollouts = [
            Rollout(
                prompt_ids=np.asarray(batch.prompt_ids[i], np.int32),
                completion_ids=np.asarray(batch.completion_ids[i], np.int32),
                behaviour_logprobs=np.asarray(batch.behaviour_logprobs[i], np.float32),
                policy_version=batch.policy_version,
                reward=float(rewards[i]),
                group_id=int(batch.group_ids[i]),
                routing=None if batch.routing is None else batch.routing[i],
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
        return rollouts, metrics | batch.metrics  # the generator's own (`gen/mismatch_*`)


def shuffled_rewards(rewards: np.ndarray, seed: int, batch_index: int) -> np.ndarray:
    """The shuffled-reward control: `rewards` permuted within their batch by a generator of
    (seed, batch index), the same reward statistics without their link to the samples."""
    return rewards[np.random.default_rng([seed, batch_index]).permutation(len(rewards))]

"""Held-out evaluation: greedy accuracy, accuracy at temperature 1, and pass@k."""

from __future__ import annotations

import time
from collections.abc import Sequence

import jax
import numpy as np

from jaxrl.generation.sampling import Sampler, SamplingConfig
from jaxrl.tasks.rewards import (
    RewardError,
    compute_rewards,
    decode_completions,
    user_reward_error,
)
from jaxrl.tasks.source import PromptItem

_EVAL_STREAM = 0xE7A1


def _score(sampler, params, tokenizer, reward, items, prompt_ids, sampling, key, batch_size):
    """Rewards `[len(items)]` of one completion per prompt."""
    scores = []
    for start in range(0, len(items), batch_size):
        rows = prompt_ids[start : start + batch_size]
        out = sampler.generate(params, rows, sampling, jax.random.fold_in(key, start))
        texts = decode_completions(
            tokenizer, [out.tokens_bn[i, : out.lengths_b[i]] for i in range(len(rows))]
        )
        chunk = items[start : start + batch_size]
        try:
            scores.append(
                compute_rewards(
                    reward, [c.text for c in chunk], texts, [c.reference for c in chunk]
                )
            )
        except RewardError:
            raise
        except Exception as e:  # a user reward's own failure: one line naming it, as in training
            raise user_reward_error(reward, e, "evaluation") from e
    return np.concatenate(scores)


class _StopCounter:
    """A sampler that counts the completions it returns and those not ended by a stop token
    (cut at `max_new_tokens`, or at the end of the sampler's context)."""

    def __init__(self, sampler: Sampler):
        self.sampler, self.rows, self.cut = sampler, 0, 0
        self.eos_ids = tuple(getattr(sampler, "eos_ids", ()))

    def generate(self, params, prompt_ids, sampling, key, *args, **kwargs):
        out = self.sampler.generate(params, prompt_ids, sampling, key, *args, **kwargs)
        stops = set(self.eos_ids) | set(sampling.stop_ids)
        lengths = np.asarray(out.lengths_b)
        for row, n in enumerate(lengths[: len(prompt_ids)]):
            self.rows += 1
            self.cut += bool(n == 0 or int(out.tokens_bn[row, n - 1]) not in stops)
        return out


def accuracy_key(temperature: float) -> str:
    """The metric name of sampled accuracy at `temperature`: "eval/accuracy_t1" at 1."""
    return f"eval/accuracy_t{temperature:g}"


def evaluate(
    sampler: Sampler,
    params,
    tokenizer,
    reward,
    items: Sequence[PromptItem],
    prompt_ids: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    samples: int = 4,
    temperature: float = 1.0,
    batch_size: int = 256,
    seed: int = 0,
) -> dict[str, float]:
    """Metrics on a fixed held-out set (a reward > 0.5 counts as correct).

    eval/accuracy: greedy decoding. eval/accuracy_t1 (`accuracy_key`: eval/accuracy_t0.7 at
    temperature 0.7): mean correctness of `samples` draws at `temperature`. eval/pass_at_k:
    fraction of prompts with at least one correct draw among `samples` (k = samples; with n = k
    draws the unbiased estimator is exactly this). eval/truncated: the share of greedy
    completions that no stop token ended (cut at `max_new_tokens`, or by the context): their
    answers may be missing, and a high share means the budget is too small.
    """
    start = time.perf_counter()
    key = jax.random.fold_in(jax.random.key(seed), _EVAL_STREAM)
    counter = _StopCounter(sampler)
    greedy = _score(
        counter,
        params,
        tokenizer,
        reward,
        items,
        prompt_ids,
        SamplingConfig(max_new_tokens, greedy=True),
        key,
        batch_size,
    )
    metrics = {"eval/accuracy": float(np.mean(greedy > 0.5))}
    if counter.rows:
        metrics["eval/truncated"] = counter.cut / counter.rows
    if samples > 0:
        repeated_items = [it for it in items for _ in range(samples)]
        repeated_ids = [p for p in prompt_ids for _ in range(samples)]
        sampled = _score(
            sampler,
            params,
            tokenizer,
            reward,
            repeated_items,
            repeated_ids,
            SamplingConfig(max_new_tokens, temperature=temperature),
            jax.random.fold_in(key, 1),
            batch_size,
        ).reshape(len(items), samples)
        correct = sampled > 0.5
        metrics[accuracy_key(temperature)] = float(correct.mean())
        # "pass_at_k", not "pass@k": TensorBoard tags allow [-/\w.] only (it would show
        # "pass_4"), and the JSON lines and TensorBoard use the same names.
        metrics[f"eval/pass_at_{samples}"] = float(correct.any(axis=1).mean())
    metrics["eval/num_prompts"] = float(len(items))
    metrics["time/eval_s"] = time.perf_counter() - start
    return metrics

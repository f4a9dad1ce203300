"""Turning next-token logits into a sampling distribution, a sample, and its log-probability.

The same `processed_logprobs` is used by the sampler (behaviour log-probs mu) and must be used by
whoever recomputes those log-probs teacher-forced (the trainer's pi in sync mode): identical
temperature and identical top-k / top-p masks, in float32, so that log pi - log mu is exactly the
policy change and nothing else.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp

_NEG_INF = -jnp.inf


@runtime_checkable
class Sampler(Protocol):
    """What the RL loop and evaluation need of a sampler: the static one
    (`jaxrl.generation.sampler.Sampler`), the engine (`engine_sampler.EngineSampler`) and their
    LoRA variants (`placement.AdapterSampler`, `AdapterEngineSampler`) all have it.

    `generate` completes each prompt `num_samples` times (rows prompt-major) and returns host
    arrays `tokens_bn`, `logprobs_bn`, `mask_bn` (`sampler.SampleOutput`); `prompt_buckets` are
    the padded prompt lengths it compiles for (train batches are padded to the same bucket).
    """

    prompt_buckets: tuple[int, ...]

    def generate(
        self,
        params: Any,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        key: jax.Array,
        *,
        num_samples: int = 1,
    ) -> Any: ...


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How tokens are drawn.

    Attributes:
      max_new_tokens: tokens generated per prompt (rows that stop early are masked after the stop).
      greedy: take the argmax. Its reported log-prob is that of the token under
        `log_softmax(logits / temperature)` with the top-k / top-p mask, as for sampling.
      temperature: divides the logits; must be > 0 (use `greedy=True` for argmax decoding).
      top_k: keep the k largest logits (ties at the k-th value are kept); 0 disables.
      top_p: keep the smallest set of tokens whose probability mass reaches top_p; 1 disables.
      stop_ids: tokens that end a row (the stop token itself is part of the completion). The
        sampler adds the model's EOS ids unless `ignore_eos`.
      ignore_eos: generate exactly max_new_tokens for every row (benchmarks).
    """

    max_new_tokens: int = 64
    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    stop_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens}; must be >= 1")
        if not self.temperature > 0:
            raise ValueError(
                f"temperature={self.temperature}; must be > 0. For argmax decoding set greedy=True "
                "(the reported log-probs then use temperature 1 unless you set another)."
            )
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k}; must be >= 0 (0 disables top-k)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p}; must be in (0, 1] (1 disables top-p)")


def mask_logits(logits_bv: jax.Array, top_k: int, top_p: float) -> jax.Array:
    """Sets logits outside the top-k / top-p set to -inf (float32 in, float32 out).

    top-k keeps every logit >= the k-th largest. top-p keeps, in descending order of probability,
    each token whose preceding cumulative mass is < top_p (so the most likely token always stays).
    Both are static: a disabled filter costs nothing.
    """
    if top_k and top_k < logits_bv.shape[-1]:
        kth_b1 = jax.lax.top_k(logits_bv, top_k)[0][..., -1:]
        logits_bv = jnp.where(logits_bv < kth_b1, _NEG_INF, logits_bv)
    if top_p < 1.0:
        order_bv = jnp.argsort(-logits_bv, axis=-1)
        sorted_bv = jnp.take_along_axis(logits_bv, order_bv, axis=-1)
        probs_bv = jax.nn.softmax(sorted_bv, axis=-1)
        mass_before_bv = jnp.cumsum(probs_bv, axis=-1) - probs_bv
        keep_sorted_bv = mass_before_bv < top_p
        # The threshold is the smallest kept logit; ties with it are kept too.
        threshold_b1 = jnp.min(
            jnp.where(keep_sorted_bv, sorted_bv, jnp.inf), axis=-1, keepdims=True
        )
        logits_bv = jnp.where(logits_bv < threshold_b1, _NEG_INF, logits_bv)
    return logits_bv


def processed_logprobs(logits_bv: jax.Array, config: SamplingConfig) -> jax.Array:
    """float32 log-probabilities of the distribution tokens are drawn from: temperature, then the
    top-k / top-p mask, then log-softmax. Works on any leading shape (`[..., V]`)."""
    scaled = logits_bv.astype(jnp.float32) / jnp.float32(config.temperature)
    return jax.nn.log_softmax(mask_logits(scaled, config.top_k, config.top_p), axis=-1)


def sample_tokens(
    logits_bv: jax.Array, config: SamplingConfig, key: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Draws one token per row; returns (tokens_b int32, logprobs_b float32 of those tokens).

    The Gumbel noise is drawn over the full `[B, V]` shape from one key, so with partitionable
    threefry the same key gives the same tokens however the logits are sharded.
    """
    logprobs_bv = processed_logprobs(logits_bv, config)
    if config.greedy:
        tokens_b = jnp.argmax(logits_bv, axis=-1)
    else:
        tokens_b = jax.random.categorical(key, logprobs_bv, axis=-1)
    tokens_b = tokens_b.astype(jnp.int32)
    logprob_b = jnp.take_along_axis(logprobs_bv, tokens_b[:, None], axis=-1)[:, 0]
    return tokens_b, logprob_b


def inverse_cdf_tokens(logprobs_bv: jax.Array, u_b: jax.Array, block: int = 128) -> jax.Array:
    """Token ids `[B]` drawn from `exp(logprobs_bv)` by inverse CDF with one uniform per row.

    Row b takes the first token whose cumulative probability exceeds `u_b * total_b`. Two levels
    keep it cheap on a large vocabulary: cumulative sums over `V / block` block masses pick the
    block, then over that block's `block` probabilities (O(V) work plus O(V / block + block)
    sums, no O(V) random bits: a Gumbel draw needs V threefry outputs per row, ~30x the cost at
    V = 32000). fp32 rounding at a block or token boundary can only move the choice to the
    nearest token of positive probability (masked tokens, probability 0, are never taken).
    """
    batch, vocab = logprobs_bv.shape
    nb = -(-vocab // block)
    p_bnk = jnp.pad(jnp.exp(logprobs_bv.astype(jnp.float32)), ((0, 0), (0, nb * block - vocab)))
    p_bnk = p_bnk.reshape(batch, nb, block)
    mass_bn = p_bnk.sum(-1)
    cum_bn = jnp.cumsum(mass_bn, -1)
    target_b = u_b.astype(jnp.float32) * cum_bn[:, -1]

    def clip_to_positive(count_b, weights_bx):
        positive = weights_bx > 0
        first = jnp.argmax(positive, -1)
        last = weights_bx.shape[-1] - 1 - jnp.argmax(positive[:, ::-1], -1)
        return jnp.clip(count_b, first, last)

    block_b = clip_to_positive(jnp.sum(cum_bn <= target_b[:, None], -1), mass_bn)
    before_b = jnp.take_along_axis(cum_bn - mass_bn, block_b[:, None], -1)[:, 0]
    inner_bk = jnp.take_along_axis(p_bnk, block_b[:, None, None], 1)[:, 0]
    inner_cum_bk = before_b[:, None] + jnp.cumsum(inner_bk, -1)
    within_b = clip_to_positive(jnp.sum(inner_cum_bk <= target_b[:, None], -1), inner_bk)
    return (block_b * block + within_b).astype(jnp.int32)

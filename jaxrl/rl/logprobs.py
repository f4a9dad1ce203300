"""Per-token log-probs (and entropies) of given tokens, in fp32, chunked over the vocabulary.

Model-agnostic: the policy supplies final hidden states `h [B, T, D]` and its unembedding matrix
`W [D, V]`; position t of `hidden_btd` must already be the state that predicts `targets_bt[:, t]`
(the caller does the usual shift by one). With temperature tau,

    z_btv          = (h_bt . W_:v) / tau                         (fp32 accumulation)
    log p(y_bt)    = z_bt[y_bt] - logsumexp_v z_btv
    H_bt           = logsumexp_v z_btv - sum_v softmax(z_bt)_v z_btv

Unchunked, the [B, T, V] fp32 logits are formed once. With `vocab_chunk_size=C` they never are: a
`lax.scan` walks the vocabulary C columns at a time and keeps an online logsumexp (running max m,
rescaled sum s), the target logit and, for the entropy, the running sum of exp(z - m) (z - m).
The scan body is rematerialised, so the backward pass recomputes each [B, T, C] chunk instead of
storing all of them: peak memory is O(B T C) in both passes. The last chunk is clamped to end at V
(its columns already seen are masked out), so V need not be a multiple of C and the unembedding is
never padded or copied.

The matmul runs in the dtype of the inputs with an fp32 result (`preferred_element_type`); for
parity tests wrap calls in `jax.default_matmul_precision("highest")`. The sampler must compute its
behaviour log-probs the same way (same temperature, no top-k / top-p mask) so that on-policy log
ratios vanish.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _check_args(hidden_btd, unembed_dv, targets_bt, temperature, vocab_chunk_size) -> None:
    if hidden_btd.ndim != 3 or unembed_dv.ndim != 2 or targets_bt.ndim != 2:
        raise ValueError(
            "expected hidden [B, T, D], unembed [D, V], targets [B, T]; got shapes "
            f"{hidden_btd.shape}, {unembed_dv.shape}, {targets_bt.shape}"
        )
    if hidden_btd.shape[-1] != unembed_dv.shape[0] or hidden_btd.shape[:2] != targets_bt.shape:
        raise ValueError(
            f"shape mismatch: hidden {hidden_btd.shape}, unembed {unembed_dv.shape}, "
            f"targets {targets_bt.shape}"
        )
    if not jnp.issubdtype(targets_bt.dtype, jnp.integer):
        raise TypeError(f"targets must be integer token ids, got {targets_bt.dtype}")
    if isinstance(temperature, int | float) and temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if vocab_chunk_size is not None and vocab_chunk_size <= 0:
        raise ValueError(f"vocab_chunk_size must be a positive int or None, got {vocab_chunk_size}")


def _logits(hidden_btd, unembed_dv, temperature):
    logits = jnp.einsum("btd,dv->btv", hidden_btd, unembed_dv, preferred_element_type=jnp.float32)
    return logits / jnp.float32(temperature)


def logprobs_from_logits(
    logits_btv: jax.Array, targets_bt: jax.Array, *, temperature: float = 1.0
) -> tuple[jax.Array, jax.Array]:
    """`(log p(targets) [B, T], entropy [B, T])`, fp32, under `softmax(logits_btv / tau)`.

    For models that already return logits; materialises `[B, T, V]` fp32.
    """
    logits_btv = logits_btv.astype(jnp.float32) / jnp.float32(temperature)
    logp_btv = jax.nn.log_softmax(logits_btv, axis=-1)
    logprobs_bt = jnp.take_along_axis(logp_btv, targets_bt[..., None], axis=-1)[..., 0]
    entropy_bt = -jnp.sum(jnp.exp(logp_btv) * logp_btv, axis=-1)
    return logprobs_bt, entropy_bt


def _chunked(hidden_btd, unembed_dv, targets_bt, temperature, chunk):
    """Online logsumexp over vocabulary chunks; returns (logprobs_bt, entropy_bt), fp32."""
    vocab = unembed_dv.shape[1]
    chunk = min(chunk, vocab)
    num_chunks = -(-vocab // chunk)
    batch_shape = targets_bt.shape

    @jax.checkpoint
    def body(carry, chunk_index):
        max_bt, sumexp_bt, shifted_bt, target_bt = carry
        # Clamp the last chunk to end at V; the columns it shares with the previous chunk are
        # masked below, which avoids padding (copying) the unembedding.
        nominal_start = chunk_index * chunk
        start = jnp.minimum(nominal_start, vocab - chunk)
        w_dc = jax.lax.dynamic_slice_in_dim(unembed_dv, start, chunk, axis=1)
        z_btc = _logits(hidden_btd, w_dc, temperature)
        column_c = start + jnp.arange(chunk)
        fresh_c = column_c >= nominal_start
        z_masked_btc = jnp.where(fresh_c, z_btc, -jnp.inf)

        # The results do not depend on the running max mathematically, so (as in
        # jax.nn.logsumexp) no gradient flows through it.
        new_max_bt = jax.lax.stop_gradient(jnp.maximum(max_bt, jnp.max(z_masked_btc, axis=-1)))
        scale_bt = jnp.exp(max_bt - new_max_bt)  # exp(-inf) = 0 on the first chunk
        # Entropy from u = sum_v e_v (z_v - m), which stays O(log V), rather than from
        # sum_v e_v z_v, whose difference with logsumexp cancels badly when logits are large.
        # Rebasing u from m to m' adds (m - m') s. On the first chunk m = -inf and s = 0: use m'
        # in place of m so that neither the value nor its gradient sees (-inf) * 0.
        finite_max_bt = jnp.where(sumexp_bt > 0, max_bt, new_max_bt)
        rebase_bt = (finite_max_bt - new_max_bt) * sumexp_bt
        shifted_btc = z_btc - new_max_bt[..., None]
        e_btc = jnp.where(fresh_c, jnp.exp(shifted_btc), 0.0)
        sumexp_bt = sumexp_bt * scale_bt + jnp.sum(e_btc, axis=-1)
        shifted_bt = (shifted_bt + rebase_bt) * scale_bt + jnp.sum(e_btc * shifted_btc, axis=-1)

        offset_bt = targets_bt - start
        in_chunk_bt = (targets_bt >= nominal_start) & (offset_bt < chunk)
        picked_bt = jnp.take_along_axis(
            z_btc, jnp.clip(offset_bt, 0, chunk - 1)[..., None], axis=-1
        )[..., 0]
        target_bt = jnp.where(in_chunk_bt, picked_bt, target_bt)
        return (new_max_bt, sumexp_bt, shifted_bt, target_bt), None

    init = (
        jnp.full(batch_shape, -jnp.inf, jnp.float32),
        jnp.zeros(batch_shape, jnp.float32),
        jnp.zeros(batch_shape, jnp.float32),
        jnp.zeros(batch_shape, jnp.float32),
    )
    (max_bt, sumexp_bt, shifted_bt, target_bt), _ = jax.lax.scan(body, init, jnp.arange(num_chunks))
    log_sumexp_bt = jnp.log(sumexp_bt)
    # H = log s - u / s, with s = sum_v exp(z_v - m) and u = sum_v exp(z_v - m) (z_v - m).
    entropy_bt = log_sumexp_bt - shifted_bt / sumexp_bt
    return target_bt - (max_bt + log_sumexp_bt), entropy_bt


def token_logprobs_and_entropy(
    hidden_btd: jax.Array,
    unembed_dv: jax.Array,
    targets_bt: jax.Array,
    *,
    temperature: float = 1.0,
    vocab_chunk_size: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """`(log p(targets) [B, T], entropy [B, T])`, fp32, of `softmax(h W / tau)`.

    Args:
      hidden_btd: final hidden states; position t predicts `targets_bt[:, t]`.
      unembed_dv: unembedding (LM head) matrix `[D, V]`.
      targets_bt: int token ids in `[0, V)`.
      temperature: tau > 0, the sampler's temperature.
      vocab_chunk_size: None forms `[B, T, V]` fp32 logits at once; an int C scans the vocabulary C
        columns at a time and never forms them (forward or backward).
    """
    _check_args(hidden_btd, unembed_dv, targets_bt, temperature, vocab_chunk_size)
    if vocab_chunk_size is None or vocab_chunk_size >= unembed_dv.shape[1]:
        logits_btv = _logits(hidden_btd, unembed_dv, temperature)
        return logprobs_from_logits(logits_btv, targets_bt)
    return _chunked(hidden_btd, unembed_dv, targets_bt, temperature, vocab_chunk_size)


def token_logprobs(
    hidden_btd: jax.Array,
    unembed_dv: jax.Array,
    targets_bt: jax.Array,
    *,
    temperature: float = 1.0,
    vocab_chunk_size: int | None = None,
) -> jax.Array:
    """`log softmax(h W / tau)[targets]`, `[B, T]` fp32; see `token_logprobs_and_entropy`.

    The entropy costs one extra multiply-add per logit when chunked; its output is dropped.
    """
    logprobs_bt, _ = token_logprobs_and_entropy(
        hidden_btd,
        unembed_dv,
        targets_bt,
        temperature=temperature,
        vocab_chunk_size=vocab_chunk_size,
    )
    return logprobs_bt

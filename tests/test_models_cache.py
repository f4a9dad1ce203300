"""Prefill + cached decode gives the same logits as one full forward pass."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl.models.config import ModelConfig
from jaxrl.models.transformer import Transformer, causal_mask, init_cache, positions_from_mask


def test_cached_decode_equals_full_forward():
    config = ModelConfig("qwen3", 61, 32, 48, 2, 4, 2, 12, qkv_bias=True, qk_norm=True)
    model = Transformer(config, rngs=nnx.Rngs(0), init_std=0.2)
    rng = np.random.default_rng(0)
    prompt_len, new_len = 6, 4
    total = prompt_len + new_len
    tokens = jnp.asarray(rng.integers(1, 61, size=(2, total)))
    valid = np.ones((2, total), bool)
    valid[1, :3] = False  # left padding in row 1
    valid = jnp.asarray(valid)

    @nnx.jit
    def step(model, tokens, positions, mask, cache, index):
        hidden, cache = model.hidden_states(tokens, positions, mask, cache, index)
        return model.logits(hidden), cache

    with jax.default_matmul_precision("highest"):
        full = np.asarray(nnx.jit(lambda m, t, v: m(t, v))(model, tokens, valid))

        positions = positions_from_mask(valid)
        mask_full = causal_mask(valid)  # [B, T, T]; rows are queries, columns cache slots
        cache = init_cache(config, batch=2, max_len=total)
        logits, cache = step(
            model,
            tokens[:, :prompt_len],
            positions[:, :prompt_len],
            mask_full[:, :prompt_len, :],
            cache,
            jnp.int32(0),
        )
        steps = [logits]
        for t in range(prompt_len, total):
            logits, cache = step(
                model,
                tokens[:, t : t + 1],
                positions[:, t : t + 1],
                mask_full[:, t : t + 1, :],
                cache,
                jnp.int32(t),
            )
            steps.append(logits)
    cached = np.asarray(jnp.concatenate(steps, axis=1))
    real = np.asarray(valid)
    np.testing.assert_allclose(cached[real], full[real], atol=1e-5, rtol=1e-5)

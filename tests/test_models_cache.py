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


def test_host_decode_attention_equals_dot_product_attention():
    """The CPU decode form (block-diagonal query matmul, fused reductions) is the maths of
    `jax.nn.dot_product_attention` for one query per row, grouped heads and per-row lengths; and
    `decode_attention_form` picks the form a decode step traces to."""
    from jaxrl.models import attention_forms, transformer

    rng = np.random.default_rng(0)
    b, s, h, kv, d = 5, 37, 6, 2, 16
    q = jnp.asarray(rng.normal(size=(b, 1, h, d)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(b, s, kv, d)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(b, s, kv, d)), jnp.float32)
    lengths = np.array([1, 9, 20, 36, 37])
    mask = jnp.asarray(np.arange(s)[None, None, :] < lengths[:, None, None])
    want = jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], implementation="xla")
    got = attention_forms.host_decode_attention(q, k, v, mask)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    # Negative control: ignoring the lengths changes the result.
    unmasked = attention_forms.host_decode_attention(q, k, v, jnp.ones_like(mask))
    assert np.abs(np.asarray(unmasked) - np.asarray(want)).max() > 1e-2

    def ops(form):
        with transformer.decode_attention_form(form):
            # A new function each time: traces are cached per function, not per form.
            jaxpr = jax.make_jaxpr(lambda *a: attention_forms.decode_step_attention(*a, "xla"))(
                q, k, v, mask
            )
        return str(jaxpr)

    assert "dot_product_attention" not in ops("host") and "dot_general" in ops("host")
    assert ops("xla") != ops("host")
    assert ops("auto") == ops("host" if jax.default_backend() == "cpu" else "xla")
    try:
        with transformer.decode_attention_form("fast"):
            raise AssertionError("an unknown form was accepted")
    except ValueError as e:
        assert "fast" in str(e)


def test_host_attention_equals_dot_product_attention_with_gradients():
    """The CPU form of many-query attention (training, prefill: grouped heads stacked along the
    query axis) is the maths of `jax.nn.dot_product_attention`, values and gradients, for T
    queries over S keys with a per-query mask (causal, ragged, a fully masked query row); and the
    attention layer traces to it under the "host" form, to the XLA kernel under "xla"."""
    from jaxrl.models import attention_forms, transformer

    rng = np.random.default_rng(1)
    b, t, s, h, kv, d = 3, 6, 11, 6, 2, 16
    q = jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(b, s, kv, d)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(b, s, kv, d)), jnp.float32)
    causal = np.arange(s)[None, None, :] <= np.arange(t)[None, :, None] + (s - t)
    mask = causal & (rng.random((b, t, s)) < 0.8)
    mask[1, 3] = False  # a query that sees nothing (padding)
    mask = jnp.asarray(mask)

    def loss(fn):
        return lambda q, k, v: (fn(q, k, v) * jnp.cos(jnp.arange(d))).sum()

    def xla(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], implementation="xla")

    def host(q, k, v):
        return attention_forms.host_attention(q, k, v, mask)

    np.testing.assert_allclose(
        np.asarray(host(q, k, v)), np.asarray(xla(q, k, v)), rtol=1e-5, atol=1e-6
    )
    want = jax.grad(loss(xla), argnums=(0, 1, 2))(q, k, v)
    got = jax.grad(loss(host), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
    # Negative control: the mask matters.
    unmasked = attention_forms.host_attention(q, k, v, jnp.ones_like(mask))
    assert np.abs(np.asarray(unmasked) - np.asarray(xla(q, k, v))).max() > 1e-2

    config = ModelConfig(
        model_type="llama", vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=1,
        num_heads=4, num_kv_heads=2, head_dim=8,
    )  # fmt: skip
    model = Transformer(config, rngs=nnx.Rngs(0))
    tokens = jnp.ones((2, 5), jnp.int32)

    def ops(form):
        with transformer.decode_attention_form(form):
            return str(jax.make_jaxpr(lambda x: model(x))(tokens))

    stacked = "f32[2,2,10,8]"  # [B, K, G*T, D]: the host form's stacked queries
    assert stacked in ops("host") and stacked not in ops("xla")
    assert ops("auto") == ops("host" if jax.default_backend() == "cpu" else "xla")

"""`attention_impl="pallas"`: the splash-attention kernel (Pallas interpret mode on the CPU)
against the XLA path, fp32, causal + left padding + grouped-query attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.infra import sharding as ax
from jaxrl.infra.mesh import MeshConfig, make_mesh
from jaxrl.models.pallas_attention import splash_self_attention
from jaxrl.models.presets import rlbench_tiny
from jaxrl.models.transformer import Transformer, causal_mask

B, T, H, K, D = 4, 128, 4, 2, 32  # GQA: 2 query heads per KV head


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, H, D), np.float32)
    k = rng.standard_normal((B, T, K, D), np.float32)
    v = rng.standard_normal((B, T, K, D), np.float32)
    pads = np.array([0, 5, 60, 127])  # left padding per row (the last: one real token)
    valid = np.arange(T)[None, :] >= pads[:, None]
    return q, k, v, valid


def _reference(q, k, v, valid):
    """NumPy softmax attention over `causal & valid key`, query head h on KV head h // 2."""
    out = np.zeros_like(q)
    for b in range(B):
        for h in range(H):
            scores = q[b, :, h] @ k[b, :, h // (H // K)].T / np.sqrt(D)
            allowed = np.tril(np.ones((T, T), bool)) & valid[b][None, :]
            scores = np.where(allowed, scores, -1e30)  # pad rows: uniform, masked out below
            weights = np.exp(scores - scores.max(-1, keepdims=True))
            weights /= weights.sum(-1, keepdims=True)
            out[b, :, h] = weights @ v[b, :, h // (H // K)]
    return out


def _max_rel(a, b, valid):
    a, b = np.asarray(a)[valid], np.asarray(b)[valid]  # padding query rows are don't-care
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def test_splash_equals_xla_and_numpy_fp32():
    q, k, v, valid = _inputs()
    pallas = jax.jit(splash_self_attention)(q, k, v, valid)
    xla = jax.nn.dot_product_attention(
        q, k, v, mask=causal_mask(jnp.asarray(valid))[:, None], implementation="xla"
    )
    ref = _reference(q, k, v, valid)
    assert _max_rel(xla, ref, valid) <= 1e-5
    assert _max_rel(pallas, ref, valid) <= 1e-5
    assert _max_rel(pallas, xla, valid) <= 1e-5
    # Negative control: the kernel without padding ids attends to the left padding.
    unmasked = jax.jit(splash_self_attention)(q, k, v, np.ones_like(valid))
    assert _max_rel(unmasked, ref, valid) > 1e-2


def test_model_logits_and_grads_match_xla_on_a_sharded_mesh():
    """The Transformer (GQA, left-padded rows) with attention inside shard_map over a
    ("fsdp", "tp") = (2, 2) mesh: logits and parameter gradients equal the XLA path's."""
    config = rlbench_tiny(num_layers=1, hidden_size=128, intermediate_size=256, num_heads=4,
                          num_kv_heads=2, head_dim=32, vocab_size=256)  # fmt: skip
    mesh = make_mesh(MeshConfig(("fsdp", "tp"), (2, 2)))
    valid = _inputs(1)[3][1:3]  # two rows (one per fsdp shard): 5 and 60 padding tokens
    tokens = np.random.default_rng(2).integers(3, 256, valid.shape).astype(np.int32)

    def loss_and_grads(impl):
        model = Transformer(config.replace(attention_impl=impl), rngs=nnx.Rngs(0))
        graphdef, params = nnx.split(model)

        def loss(p):
            logits = nnx.merge(graphdef, p)(tokens, valid)
            return jnp.sum(jnp.where(valid[..., None], logits, 0.0) ** 2) / 1e4, logits

        with ax.sharding_context(mesh, ax.TRAINER_RULES):
            (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
        return logits, grads

    logits_p, grads_p = loss_and_grads("pallas")
    logits_x, grads_x = loss_and_grads("xla")
    assert _max_rel(logits_p, logits_x, valid) <= 1e-5
    for gp, gx in zip(jax.tree.leaves(grads_p), jax.tree.leaves(grads_x), strict=True):
        gp, gx = np.asarray(gp), np.asarray(gx)
        assert np.max(np.abs(gp - gx)) <= 1e-4 * np.max(np.abs(gx)) + 1e-7


def test_rejects_lengths_the_kernel_cannot_tile():
    q, k, v, valid = _inputs()
    with pytest.raises(ValueError, match="multiple of 128"):
        splash_self_attention(q[:, :100], k[:, :100], v[:, :100], valid[:, :100])

"""The model on its GPU and TPU attention forms ("pallas_gpu": `jaxrl.models.gpu_attention`'s
fused kernel for whole-sequence self-attention, "pallas_tpu": `jaxrl.models.tpu_attention`'s, in
Pallas interpret mode on the CPU) against the CPU form, fp32, on a 2-layer GQA model: hidden
states and the gradient of every parameter within 1e-5 (relative to the largest entry) for a
padded batch, packed rows and a shared-prompt row (the negative controls, a completion allowed to
see its sibling, are the kernels': tests/test_gpu_attention.py, tests/test_tpu_attention.py).
On a sharded mesh the kernel runs per device inside `shard_map`."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.infra import sharding as ax
from jaxrl.infra.mesh import MeshConfig, make_mesh
from jaxrl.models.config import ModelConfig
from jaxrl.models.masks import SegmentMask
from jaxrl.models.transformer import Transformer, decode_attention_form, positions_from_mask

T = 32


@pytest.fixture(scope="module")
def model():
    # 4 query heads over 2 KV heads (G = 2), head dim 16, 2 unrolled layers, fp32.
    config = ModelConfig("llama", 64, 32, 64, 2, 4, 2, 16, max_position_embeddings=128)
    assert config.attention_impl is None  # the platform's own form
    return Transformer(config, rngs=nnx.Rngs(0), init_std=0.3)


def _layouts():
    """(tokens, positions, mask, real) for the three training layouts, [2, T] each."""
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(1, 64, size=(2, T)), jnp.int32)
    # Padded: row 0 left-padded (9 pads), row 1 right-padded (6 pads).
    valid = np.ones((2, T), bool)
    valid[0, :9] = False
    valid[1, T - 6 :] = False
    padded = (
        tokens, positions_from_mask(jnp.asarray(valid)), SegmentMask.from_valid(jnp.asarray(valid)),
        valid,
    )  # fmt: skip
    # Packed: three sequences in row 0, two and a tail in row 1.
    segment = np.zeros((2, T), np.int32)
    segment[0, :10], segment[0, 10:22], segment[0, 22:] = 1, 2, 3
    segment[1, :14], segment[1, 14:27] = 1, 2
    positions = np.zeros((2, T), np.int32)
    for r in range(2):
        for s in range(1, 4):
            idx = np.flatnonzero(segment[r] == s)
            positions[r, idx] = np.arange(len(idx))
    packed = (tokens, jnp.asarray(positions), SegmentMask(jnp.asarray(segment)), segment > 0)
    # Shared prompt: a prompt (segment 1) and three completions (2, 3, 4) whose prefix is 1.
    segment = np.zeros((2, T), np.int32)
    segment[:, :8], segment[:, 8:15], segment[:, 15:23], segment[:, 23:30] = 1, 2, 3, 4
    prefix = np.where(segment > 0, 1, 0).astype(np.int32)
    positions = np.zeros((2, T), np.int32)
    positions[:, :8] = np.arange(8)
    for s in (2, 3, 4):
        idx = np.flatnonzero(segment[0] == s)
        positions[:, idx] = 8 + np.arange(len(idx))
    shared_mask = SegmentMask(jnp.asarray(segment), jnp.asarray(prefix))
    shared = (tokens, jnp.asarray(positions), shared_mask, segment > 0)
    return {"padded": padded, "packed": packed, "shared": shared}


def _loss_and_grads(model, tokens, positions, mask, real, form):
    graphdef, params = nnx.split(model)
    weights = jnp.asarray(np.random.default_rng(1).normal(size=(2, T, 32)), jnp.float32)

    def loss(params):
        m = nnx.merge(graphdef, params)
        hidden, _ = m.hidden_states(tokens, positions, mask)
        return jnp.sum(jnp.where(jnp.asarray(real)[..., None], hidden * weights, 0.0)), hidden

    with decode_attention_form(form):
        (_, hidden), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return np.where(real[..., None], np.asarray(hidden), 0.0), grads


@pytest.fixture(scope="module")
def cpu_form(model):
    """The CPU form's (hidden states, gradients) per layout, each computed once for the module:
    both kernel forms and the sharded run compare against the same reference (the same model,
    inputs and program every time), which nothing writes to."""
    cache = {}

    def reference(layout):
        if layout not in cache:
            tokens, positions, mask, real = _layouts()[layout]
            cache[layout] = _loss_and_grads(model, tokens, positions, mask, real, "host")
        return cache[layout]

    return reference


def _relative(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


@pytest.mark.parametrize("form", ["pallas_gpu", "pallas_tpu"])
@pytest.mark.parametrize("layout", ["padded", "packed", "shared"])
def test_kernel_form_equals_cpu_form(model, cpu_form, layout, form):
    tokens, positions, mask, real = _layouts()[layout]
    hidden, grads = _loss_and_grads(model, tokens, positions, mask, real, form)
    ref_hidden, ref_grads = cpu_form(layout)
    assert _relative(hidden, ref_hidden) < 1e-5
    errors = jax.tree.leaves(jax.tree.map(_relative, grads, ref_grads))
    assert len(errors) >= 10 and max(errors) < 1e-5, errors


def test_gpu_form_on_a_sharded_mesh_runs_the_kernel_per_device(model, cpu_form):
    """fsdp 2 x tp 2 (batch and heads split): the kernel inside `shard_map` gives the unsharded
    result, and the traced program holds no [B, H, T, T] scores."""
    tokens, positions, mask, real = _layouts()["shared"]
    ref_hidden, _ = cpu_form("shared")
    mesh = make_mesh(MeshConfig(("fsdp", "tp"), (2, 2)), jax.devices()[:4])
    graphdef, params = nnx.split(model)

    def forward(params, tokens, positions, mask):
        hidden, _ = nnx.merge(graphdef, params).hidden_states(tokens, positions, mask)
        return hidden

    with ax.sharding_context(mesh, ax.TRAINER_RULES), decode_attention_form("pallas_gpu"):
        fn = jax.jit(forward)
        text = fn.lower(params, tokens, positions, mask).as_text()
        hidden = fn(params, tokens, positions, mask)
    assert "shard_map" in text or "sdy.manual_computation" in text
    # No [B, H, T, T] (or per-device [B/2, H/2, T, T]) scores: the kernel's tiles only.
    assert not re.search(rf"tensor<\d+x\d+x{T}x{T}xf32>", text)
    assert _relative(np.where(real[..., None], np.asarray(hidden), 0.0), ref_hidden) < 1e-5


def test_cudnn_attention_off_a_gpu_is_refused_with_the_fix():
    """attention_impl="cudnn" in a CPU program: a ValueError naming the platform and the fix,
    where cuDNN itself would fail deep inside JAX ("cuDNN not found")."""
    config = ModelConfig("llama", 64, 32, 64, 1, 4, 2, 16, attention_impl="cudnn")
    model = Transformer(config, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="needs an NVIDIA GPU .* compiled for cpu: use None"):
        model(jnp.ones((1, 8), jnp.int32))

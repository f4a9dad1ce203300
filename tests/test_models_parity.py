"""The JAX model against the `transformers` PyTorch reference, with negative controls."""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from hf_fixtures import left_padded_batch, reference_logits, save_tiny_checkpoint

from jaxrl.models import hf
from jaxrl.models.config import RopeConfig
from jaxrl.models.rope import inverse_frequencies
from jaxrl.models.transformer import Transformer, causal_mask, positions_from_mask


def _tolerance(ref: np.ndarray) -> float:
    return 2e-5 * max(1.0, float(np.abs(ref).max()))


def _jax_logits(model: Transformer, tokens, mask) -> np.ndarray:
    with jax.default_matmul_precision("highest"):
        return np.asarray(model(jnp.asarray(tokens), jnp.asarray(mask, bool)))


def _max_diff(ours, ref, mask) -> float:
    return float(np.abs(ours - ref)[mask == 1].max())


KINDS = ["llama3", "llama3_tied", "llama3_bias", "qwen2", "qwen3"]


@pytest.fixture(scope="module", params=KINDS)
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    torch_model = save_tiny_checkpoint(path, request.param)
    tokens, mask = left_padded_batch(torch_model.config.vocab_size)
    ref = reference_logits(torch_model, tokens, mask)
    return request.param, str(path), torch_model, tokens, mask, ref


def _model_with(path: str, transform=None, **config_changes) -> Transformer:
    """The checkpoint's weights in a model whose config has `config_changes` applied (a negative
    control): `transform(params, config)` first edits the loaded weights (a nested dict of NumPy
    arrays); parameters the changed config does not have are dropped."""
    config = hf.load_config(path)
    params = jax.tree.map(np.array, nnx.to_pure_dict(hf.load_params(path, config)))
    if transform is not None:
        params = transform(params, config)
    changed = config.replace(**config_changes)
    abstract = nnx.eval_shape(lambda: Transformer(changed, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)

    def keep(tree, template):
        return {
            k: keep(tree[k], v) if isinstance(v, dict) else jnp.asarray(tree[k], jnp.float32)
            for k, v in template.items()
        }

    nnx.replace_by_pure_dict(state, keep(params, nnx.to_pure_dict(state)))
    return nnx.merge(graphdef, state)


def test_logits_match_transformers(checkpoint):
    kind, path, _, tokens, mask, ref = checkpoint
    model = hf.load_model(path)
    diff = _max_diff(_jax_logits(model, tokens, mask), ref, mask)
    print(f"{kind}: max|diff|={diff:.3g} max|ref|={np.abs(ref).max():.3g}")
    assert diff <= _tolerance(ref), (kind, diff)


def test_config_features(checkpoint):
    kind, path, *_ = checkpoint
    config = hf.load_config(path)
    assert config.model_type == ("llama" if kind.startswith("llama3") else kind)
    assert config.tie_word_embeddings == (kind == "llama3_tied")
    assert config.qkv_bias == (kind in ("qwen2", "llama3_bias"))
    assert config.o_bias == config.mlp_bias == (kind == "llama3_bias")
    assert config.qk_norm == (kind == "qwen3")
    assert config.num_kv_heads < config.num_heads  # grouped-query attention is exercised
    if kind == "qwen3":
        assert config.head_dim * config.num_heads != config.hidden_size
    if kind.startswith("llama3"):
        assert config.rope.rope_type == "llama3"


# Negative controls: each feature switched off, or done the way a plausible bug would do it,
# must move the logits past 10x the parity tolerance. A control is (label, kinds, logits_fn),
# `logits_fn(path, tokens, mask) -> logits`.


def _layers(params):
    return params["layers"].values()


def _with(**config_changes):
    return lambda path, tokens, mask: _jax_logits(_model_with(path, **config_changes), tokens, mask)


def _rope_off(path, tokens, mask):
    theta = hf.load_config(path).rope.theta
    return _jax_logits(_model_with(path, rope=RopeConfig(theta=theta)), tokens, mask)


def _kv_heads_as(expand):
    """Grouped-query attention rewritten as multi-head attention: each query head gets its own
    copy of a kv head, chosen by `expand(kv [E, K, D], num_heads) -> [E, H, D]`."""

    def transform(params, config):
        for layer in _layers(params):
            attention = layer["attention"]
            for name in ("k", "v"):
                attention[f"{name}_kernel"] = expand(attention[f"{name}_kernel"], config.num_heads)
                if f"{name}_bias" in attention:
                    bias_1kd = attention[f"{name}_bias"][None]
                    attention[f"{name}_bias"] = expand(bias_1kd, config.num_heads)[0]
        return params

    return lambda path, tokens, mask: _jax_logits(
        _model_with(path, transform, num_kv_heads=hf.load_config(path).num_heads), tokens, mask
    )


# transformers' repeat_kv: query head h reads kv head h // (H / K). The wrong ways: interleaved
# (h % K), and every query head reading kv head 0 (the groups collapsed).
def _repeat(kv_ekd, h):
    return np.repeat(kv_ekd, h // kv_ekd.shape[1], axis=1)


def _interleave(kv_ekd, h):
    return np.tile(kv_ekd, (1, h // kv_ekd.shape[1], 1))


def _collapse(kv_ekd, h):
    return np.repeat(kv_ekd[:, :1], h, axis=1)


def _untied_copy(noise_std: float):
    """The tied checkpoint as an untied model whose lm_head is the embedding's transpose plus
    Gaussian noise (0: an exact copy)."""

    def transform(params, config):
        embedding_ev = params["embedding"].T
        noise = np.random.default_rng(0).standard_normal(embedding_ev.shape)
        params["lm_head"] = embedding_ev + noise_std * noise
        return params

    return lambda path, tokens, mask: _jax_logits(
        _model_with(path, transform, tie_word_embeddings=False), tokens, mask
    )


def _head_dim_from_hidden(path, tokens, mask):
    """Qwen3 read as if head_dim were hidden_size / num_heads (16, not 24): the first 16
    dimensions of each head's q/k/v/o weights and q/k norm scales, RoPE over 16 dimensions."""
    config = hf.load_config(path)
    d = config.hidden_size // config.num_heads

    def transform(params, _):
        for layer in _layers(params):
            attention = layer["attention"]
            for name in ("q", "k", "v"):
                attention[f"{name}_kernel"] = attention[f"{name}_kernel"][..., :d]
            attention["o_kernel"] = attention["o_kernel"][:, :d]
            for name in ("q_norm", "k_norm"):
                attention[name]["weight"] = attention[name]["weight"][:d]
        return params

    return _jax_logits(_model_with(path, transform, head_dim=d), tokens, mask)


def _positions_unshifted_from(column: int):
    """Left-padded rows whose positions skip the padding before `column` and count from the
    padded row's start from `column` on, as a sampler would whose prefill (the prompt) skips the
    padding and whose decode steps count from the padded width. (A row counted from its start
    throughout is a constant shift: RoPE sees only position differences, so the logits stay.)"""

    def logits_fn(path, tokens, mask):
        model = hf.load_model(path)
        valid = jnp.asarray(mask, bool)
        columns = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        positions = jnp.where(columns < column, positions_from_mask(valid), columns)
        with jax.default_matmul_precision("highest"):
            hidden, _ = model.hidden_states(jnp.asarray(tokens), positions, causal_mask(valid))
            return np.asarray(model.logits(hidden))

    return logits_fn


_CONTROLS = [
    ("llama3 rope scaling off", ("llama3", "llama3_tied"), _rope_off),
    ("kv heads repeated interleaved (h % K)", ("llama3", "qwen3"), _kv_heads_as(_interleave)),
    ("kv heads collapsed to kv head 0", ("llama3",), _kv_heads_as(_collapse)),
    ("untied lm_head = embedding.T + N(0, 1e-3)", ("llama3_tied",), _untied_copy(1e-3)),
    ("attention biases off", ("llama3_bias",), _with(qkv_bias=False, o_bias=False)),
    ("mlp biases off", ("llama3_bias",), _with(mlp_bias=False)),
    ("qkv bias off", ("qwen2",), _with(qkv_bias=False)),
    ("q/k norm off", ("qwen3",), _with(qk_norm=False)),
    ("head_dim = hidden_size / num_heads", ("qwen3",), _head_dim_from_hidden),
    (
        "left-pad positions not shifted after the prompt (8 columns)",
        ("llama3", "qwen2"),
        _positions_unshifted_from(8),
    ),
]
# Rewritings that must NOT move the logits: they show that a control changes only what it names.
_EQUIVALENTS = [
    ("kv heads repeated as transformers does", ("llama3", "qwen3"), _kv_heads_as(_repeat)),
    ("untied lm_head = embedding.T exactly", ("llama3_tied",), _untied_copy(0.0)),
    ("left-pad positions not shifted anywhere", ("llama3", "qwen2"), _positions_unshifted_from(0)),
]


def test_negative_controls_exceed_tolerance(checkpoint):
    kind, path, _, tokens, mask, ref = checkpoint
    controls = [(label, fn) for label, kinds, fn in _CONTROLS if kind in kinds]
    assert controls, kind  # every fixture has at least one
    for label, logits_fn in controls:
        diff = _max_diff(logits_fn(path, tokens, mask), ref, mask)
        print(f"{kind} with {label}: max|diff|={diff:.3g} (tolerance {_tolerance(ref):.3g})")
        assert diff > 10 * _tolerance(ref), (kind, label, diff)
    for label, logits_fn in [(label, fn) for label, kinds, fn in _EQUIVALENTS if kind in kinds]:
        diff = _max_diff(logits_fn(path, tokens, mask), ref, mask)
        print(f"{kind} with {label}: max|diff|={diff:.3g} (within tolerance)")
        assert diff <= _tolerance(ref), (kind, label, diff)


def test_bf16_params_match_a_reference_with_bf16_rounded_weights(checkpoint):
    """`load_model(..., param_dtype="bfloat16")` stores every weight in bf16 (computing in fp32):
    its logits equal transformers' with each weight rounded to bf16 by torch, to the fp32 parity
    tolerance, and differ from the unrounded model's by more than 10x that tolerance."""
    kind, path, torch_model, tokens, mask, ref = checkpoint
    model = hf.load_model(path, param_dtype="bfloat16")
    dtypes = {x.dtype for x in jax.tree.leaves(nnx.state(model, nnx.Param))}
    assert dtypes == {jnp.dtype(jnp.bfloat16)}, dtypes
    rounded = copy.deepcopy(torch_model)
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    rounded_ref = reference_logits(rounded, tokens, mask)
    ours = _jax_logits(model, tokens, mask)
    diff, unrounded = _max_diff(ours, rounded_ref, mask), _max_diff(ours, ref, mask)
    print(f"{kind} bf16 params: max|diff|={diff:.3g}; against the fp32 weights {unrounded:.3g}")
    assert diff <= _tolerance(rounded_ref), (kind, diff)
    assert unrounded > 10 * _tolerance(ref), (kind, unrounded)


def test_rope_inverse_frequencies_equal_reference(checkpoint):
    _, path, torch_model, *_ = checkpoint
    config = hf.load_config(path)
    ours = inverse_frequencies(config.head_dim, config.rope)
    theirs = torch_model.model.rotary_emb.inv_freq.numpy()
    np.testing.assert_array_equal(ours, theirs)


def test_bf16_compute_stays_close_and_logits_are_fp32(checkpoint):
    kind, path, _, tokens, mask, ref = checkpoint
    model = hf.load_model(path, dtype="bfloat16")
    logits = model(jnp.asarray(tokens), jnp.asarray(mask, bool))
    assert logits.dtype == jnp.float32
    rel = _max_diff(np.asarray(logits), ref, mask) / float(np.abs(ref).max())
    assert rel < 0.1, (kind, rel)


@pytest.mark.parametrize(
    "head_dim,rope",
    [
        (
            128,
            RopeConfig(
                theta=500000.0,
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=8192,
            ),
        ),
        (128, RopeConfig(theta=1000000.0)),
        (64, RopeConfig(theta=10000.0, rope_type="linear", factor=4.0)),
    ],
)
def test_rope_inverse_frequencies_of_released_configs(head_dim, rope):
    """Llama 3.1 8B, Qwen2.5/Qwen3 and a linear-scaled config against transformers' own RoPE
    initialisers. torch's vectorised float32 pow is not correctly rounded, so allow 1 ulp."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": rope.rope_type, "rope_theta": rope.theta}
    if rope.rope_type != "default":
        params["factor"] = rope.factor
    if rope.rope_type == "llama3":
        params.update(
            low_freq_factor=rope.low_freq_factor,
            high_freq_factor=rope.high_freq_factor,
            original_max_position_embeddings=rope.original_max_position_embeddings,
        )
    config = transformers.LlamaConfig(
        hidden_size=head_dim * 2, num_attention_heads=2, rope_parameters=params
    )
    if rope.rope_type == "default":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        theirs, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    else:
        theirs, _ = ROPE_INIT_FUNCTIONS[rope.rope_type](config, "cpu")
    ours = inverse_frequencies(head_dim, rope)
    np.testing.assert_array_max_ulp(ours, theirs.numpy(), maxulp=1)

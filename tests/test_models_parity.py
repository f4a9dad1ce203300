"""The JAX model against the `transformers` PyTorch reference, with negative controls."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_fixtures import left_padded_batch, reference_logits, save_tiny_checkpoint

from jaxrl.models import hf
from jaxrl.models.config import RopeConfig
from jaxrl.models.rope import inverse_frequencies
from jaxrl.models.transformer import Transformer


def _tolerance(ref: np.ndarray) -> float:
    return 2e-5 * max(1.0, float(np.abs(ref).max()))


def _jax_logits(model: Transformer, tokens, mask) -> np.ndarray:
    with jax.default_matmul_precision("highest"):
        return np.asarray(model(jnp.asarray(tokens), jnp.asarray(mask, bool)))


def _max_diff(ours, ref, mask) -> float:
    return float(np.abs(ours - ref)[mask == 1].max())


@pytest.fixture(scope="module", params=["llama3", "llama3_tied", "qwen2", "qwen3"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    torch_model = save_tiny_checkpoint(path, request.param)
    tokens, mask = left_padded_batch(torch_model.config.vocab_size)
    ref = reference_logits(torch_model, tokens, mask)
    return request.param, str(path), torch_model, tokens, mask, ref


def _model_with(path: str, **config_changes) -> Transformer:
    """The checkpoint's weights in a model whose config has `config_changes` applied; parameters
    the changed config does not have are dropped (a negative control)."""
    config = hf.load_config(path)
    params = nnx.to_pure_dict(hf.load_params(path, config))
    changed = config.replace(**config_changes)
    abstract = nnx.eval_shape(lambda: Transformer(changed, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)

    def keep(tree, template):
        return {
            k: keep(tree[k], v) if isinstance(v, dict) else tree[k] for k, v in template.items()
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
    assert config.model_type == {"llama3": "llama", "llama3_tied": "llama"}.get(kind, kind)
    assert config.tie_word_embeddings == (kind == "llama3_tied")
    assert config.qkv_bias == (kind == "qwen2")
    assert config.qk_norm == (kind == "qwen3")
    assert config.num_kv_heads < config.num_heads  # grouped-query attention is exercised
    if kind == "qwen3":
        assert config.head_dim * config.num_heads != config.hidden_size
    if kind.startswith("llama3"):
        assert config.rope.rope_type == "llama3"


# Each feature switched off must move the logits past the parity tolerance.
_CONTROLS = {
    "llama3": ("llama3 rope scaling off", lambda c: {"rope": RopeConfig(theta=c.rope.theta)}),
    "llama3_tied": ("llama3 rope scaling off", lambda c: {"rope": RopeConfig(theta=c.rope.theta)}),
    "qwen2": ("qkv bias off", lambda c: {"qkv_bias": False}),
    "qwen3": ("q/k norm off", lambda c: {"qk_norm": False}),
}


def test_negative_control_exceeds_tolerance(checkpoint):
    kind, path, _, tokens, mask, ref = checkpoint
    label, change = _CONTROLS[kind]
    model = _model_with(path, **change(hf.load_config(path)))
    diff = _max_diff(_jax_logits(model, tokens, mask), ref, mask)
    print(f"{kind} with {label}: max|diff|={diff:.3g} (tolerance {_tolerance(ref):.3g})")
    assert diff > 10 * _tolerance(ref), (kind, label, diff)


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

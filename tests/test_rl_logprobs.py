"""token_logprobs: fp32 log-probs / entropies vs a float64 NumPy reference; chunked == unchunked."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.rl.logprobs import logprobs_from_logits, token_logprobs, token_logprobs_and_entropy

B, T, D, V = 2, 8, 4, 64
TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def inputs():
    rng = np.random.default_rng(0)
    hidden_btd = rng.normal(size=(B, T, D)).astype(np.float32)
    unembed_dv = rng.normal(size=(D, V)).astype(np.float32)
    targets_bt = rng.integers(0, V, size=(B, T)).astype(np.int32)
    return hidden_btd, unembed_dv, targets_bt


def numpy_reference(hidden_btd, unembed_dv, targets_bt, temperature):
    z = np.einsum("btd,dv->btv", hidden_btd.astype(np.float64), unembed_dv.astype(np.float64))
    z = z / temperature
    zmax = z.max(axis=-1, keepdims=True)
    logp = z - (zmax + np.log(np.exp(z - zmax).sum(axis=-1, keepdims=True)))
    logprobs = np.take_along_axis(logp, targets_bt[..., None], axis=-1)[..., 0]
    entropy = -(np.exp(logp) * logp).sum(axis=-1)
    return logprobs, entropy


@pytest.mark.parametrize("chunk", [None, 16, 7, 1, 1000])
def test_matches_numpy_reference(inputs, chunk):
    ref_lp, ref_ent = numpy_reference(*inputs, TEMPERATURE)
    with jax.default_matmul_precision("highest"):
        lp, ent = token_logprobs_and_entropy(
            *inputs, temperature=TEMPERATURE, vocab_chunk_size=chunk
        )
    assert lp.dtype == ent.dtype == jnp.float32
    np.testing.assert_allclose(lp, ref_lp, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(ent, ref_ent, rtol=1e-6, atol=1e-6)


def test_logprobs_from_logits_matches_reference(inputs):
    hidden_btd, unembed_dv, targets_bt = inputs
    logits_btv = np.einsum("btd,dv->btv", hidden_btd, unembed_dv)
    ref_lp, ref_ent = numpy_reference(hidden_btd, unembed_dv, targets_bt, TEMPERATURE)
    # The reference uses float64 logits; allow the fp32 rounding of the logits themselves.
    lp, ent = logprobs_from_logits(logits_btv, targets_bt, temperature=TEMPERATURE)
    np.testing.assert_allclose(lp, ref_lp, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ent, ref_ent, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk", [16, 7])
def test_chunked_gradients_equal_unchunked(inputs, chunk):
    hidden_btd, unembed_dv, targets_bt = inputs
    weights_bt = np.linspace(-1.0, 1.0, B * T, dtype=np.float32).reshape(B, T)

    def objective(h, w, chunk):
        lp, ent = token_logprobs_and_entropy(
            h, w, targets_bt, temperature=TEMPERATURE, vocab_chunk_size=chunk
        )
        return jnp.sum(weights_bt * lp) + 0.3 * jnp.sum(ent)

    with jax.default_matmul_precision("highest"):
        grads_full = jax.grad(objective, argnums=(0, 1))(hidden_btd, unembed_dv, None)
        grads_chunked = jax.grad(objective, argnums=(0, 1))(hidden_btd, unembed_dv, chunk)
    for full, chunked in zip(grads_full, grads_chunked, strict=True):
        assert np.all(np.isfinite(chunked))
        np.testing.assert_allclose(chunked, full, rtol=1e-5, atol=1e-6 * np.abs(full).max())


def _all_shapes(jaxpr, shapes):
    for eqn in jaxpr.eqns:
        for var in (*eqn.invars, *eqn.outvars):
            if hasattr(var.aval, "shape"):
                shapes.append(tuple(var.aval.shape))
        for param in eqn.params.values():
            for sub in param if isinstance(param, list | tuple) else (param,):
                if hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
                    _all_shapes(sub.jaxpr, shapes)
                elif hasattr(sub, "eqns"):
                    _all_shapes(sub, shapes)
    return shapes


def test_chunked_never_forms_full_logits(inputs):
    hidden_btd, unembed_dv, targets_bt = inputs

    def loss(h, w, chunk):
        lp, ent = token_logprobs_and_entropy(h, w, targets_bt, vocab_chunk_size=chunk)
        return jnp.sum(lp) + jnp.sum(ent)

    def largest(chunk):
        jaxpr = jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1)), static_argnums=2)(
            hidden_btd, unembed_dv, chunk
        )
        return max(int(np.prod(s)) for s in _all_shapes(jaxpr.jaxpr, []))

    # Sanity check of the probe: the unchunked program does hold a [B, T, V] array.
    assert largest(None) == B * T * V
    # Chunked, forward and backward: nothing larger than the [D, V] unembedding (256 < 1024).
    assert largest(16) == D * V < B * T * V


def test_bf16_inputs_give_fp32_logprobs(inputs):
    hidden_btd, unembed_dv, targets_bt = inputs
    lp = token_logprobs(
        jnp.asarray(hidden_btd, jnp.bfloat16),
        jnp.asarray(unembed_dv, jnp.bfloat16),
        targets_bt,
        vocab_chunk_size=16,
    )
    assert lp.dtype == jnp.float32 and lp.shape == (B, T)
    ref_lp, _ = numpy_reference(hidden_btd, unembed_dv, targets_bt, 1.0)
    # bf16 inputs carry ~3 significant digits; this only checks the plumbing, not precision.
    np.testing.assert_allclose(lp, ref_lp, rtol=0.1, atol=0.5)


def test_bad_arguments_raise(inputs):
    hidden_btd, unembed_dv, targets_bt = inputs
    with pytest.raises(ValueError, match="shape mismatch"):
        token_logprobs(hidden_btd, unembed_dv[:3], targets_bt)
    with pytest.raises(TypeError, match="integer"):
        token_logprobs(hidden_btd, unembed_dv, targets_bt.astype(np.float32))
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(hidden_btd, unembed_dv, targets_bt, temperature=0.0)
    with pytest.raises(ValueError, match="vocab_chunk_size"):
        token_logprobs(hidden_btd, unembed_dv, targets_bt, vocab_chunk_size=0)


def test_batch_sharded_over_eight_devices_matches_single_device(inputs):
    _, unembed_dv, _ = inputs
    rng = np.random.default_rng(3)
    hidden_btd = rng.normal(size=(8, 2, D)).astype(np.float32)
    targets_bt = rng.integers(0, V, size=(8, 2)).astype(np.int32)
    mesh = jax.make_mesh((8,), ("data",))
    batch_sharding = jax.NamedSharding(mesh, jax.P("data"))
    fn = jax.jit(lambda h, w, y: token_logprobs(h, w, y, vocab_chunk_size=16))
    with jax.default_matmul_precision("highest"):
        sharded = fn(
            jax.device_put(hidden_btd, batch_sharding),
            jax.device_put(unembed_dv, jax.NamedSharding(mesh, jax.P())),
            jax.device_put(targets_bt, batch_sharding),
        )
    assert sharded.sharding.is_equivalent_to(batch_sharding, sharded.ndim)
    ref_lp, _ = numpy_reference(hidden_btd, unembed_dv, targets_bt, 1.0)
    np.testing.assert_allclose(sharded, ref_lp, rtol=1e-6, atol=1e-6)

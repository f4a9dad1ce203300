"""Weighting schemes against NumPy references, equal auxiliary mass, and the learned scheme's
bilevel (look-ahead) gradient against float64 finite differences."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.flatten_util import ravel_pytree

from msd_jax import losses, models, weighting
from msd_jax.views import MultimodalBatch

B, C = 7, 4
TEACHER_BVC = np.random.default_rng(0).normal(scale=2.0, size=(B, 3, C)).astype(np.float32)
SALIENCY_BM = np.random.default_rng(1).normal(size=(B, 2)).astype(np.float32)
SALIENCY_BM[0] = [-0.5, -0.1]  # both clipped to zero: "sum" falls back to the uniform split


def np_softmax(z):
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def all_schemes(aux_scale):
    return {
        "uniform": weighting.make_weighting("uniform", aux_scale=aux_scale),
        "population": weighting.make_weighting(
            "population", aux_scale=aux_scale, mean_saliency=(0.3, 0.9)
        ),
        "instance_sum": weighting.make_weighting("instance", aux_scale=aux_scale),
        "instance_softmax": weighting.make_weighting(
            "instance", aux_scale=aux_scale, normalisation="softmax", temperature=0.5
        ),
        "learned_scalar": weighting.make_weighting("learned", aux_scale=aux_scale),
        "learned_net": weighting.make_weighting(
            "learned", aux_scale=aux_scale, parametrisation="net", hidden_size=4
        ),
    }


def weights_of(scheme, params=None):
    if params is None:
        params = scheme.init(jax.random.key(0)).params
    return np.asarray(scheme.weights(params, jnp.asarray(TEACHER_BVC), jnp.asarray(SALIENCY_BM)))


def test_fixed_schemes_match_numpy():
    s = 0.7
    schemes = all_schemes(s)
    np.testing.assert_allclose(weights_of(schemes["uniform"]), np.full((B, 2), s))
    np.testing.assert_allclose(
        weights_of(schemes["population"]), np.tile([2 * s * 0.25, 2 * s * 0.75], (B, 1)), rtol=1e-6
    )
    clipped = np.maximum(SALIENCY_BM, 0) + 1e-6
    np.testing.assert_allclose(
        weights_of(schemes["instance_sum"]),
        2 * s * clipped / clipped.sum(1, keepdims=True),
        rtol=1e-6,
    )
    np.testing.assert_allclose(weights_of(schemes["instance_sum"])[0], [s, s], rtol=1e-6)
    np.testing.assert_allclose(
        weights_of(schemes["instance_softmax"]), 2 * s * np_softmax(SALIENCY_BM / 0.5), rtol=1e-6
    )


def test_learned_schemes_match_numpy_and_start_uniform():
    s = 1.3
    schemes = all_schemes(s)
    for name in ("learned_scalar", "learned_net"):
        np.testing.assert_allclose(weights_of(schemes[name]), np.full((B, 2), s), rtol=1e-6)
    phi = {"logits_m": jnp.asarray([0.4, -1.1])}
    np.testing.assert_allclose(
        weights_of(schemes["learned_scalar"], phi),
        np.tile(2 * s * np_softmax(np.array([0.4, -1.1])), (B, 1)),
        rtol=1e-6,
    )
    rng = np.random.default_rng(2)
    net = {
        "w1_fh": rng.normal(size=(6, 4)), "b1_h": rng.normal(size=4),
        "w2_hm": rng.normal(size=(4, 2)), "b2_m": rng.normal(size=2),
    }  # fmt: skip
    z = TEACHER_BVC.astype(np.float64)
    p = np_softmax(z)
    features = np.concatenate([-(p * np.log(p)).sum(-1), p.max(-1)], axis=1)
    hidden = np.tanh(features @ net["w1_fh"] + net["b1_h"])
    expected = 2 * s * np_softmax(hidden @ net["w2_hm"] + net["b2_m"])
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), net)
    np.testing.assert_allclose(weights_of(schemes["learned_net"], params), expected, rtol=1e-5)


@pytest.mark.parametrize("aux_scale", [1.0, 0.35])
def test_every_scheme_keeps_the_same_auxiliary_mass(aux_scale):
    rng = np.random.default_rng(3)
    for name, scheme in all_schemes(aux_scale).items():
        params = scheme.init(jax.random.key(1)).params
        if scheme.learned:  # away from the uniform start
            params = jax.tree.map(lambda x: x + jnp.asarray(rng.normal(size=x.shape)), params)
        w_bm = weights_of(scheme, params)
        assert scheme.mass == pytest.approx(2 * aux_scale)
        np.testing.assert_allclose(w_bm.sum(1), 2 * aux_scale, rtol=1e-6, err_msg=name)
        assert (w_bm >= 0).all(), name
        if name != "uniform":
            assert np.abs(w_bm - aux_scale).max() > 1e-3, name  # it does redistribute


def test_constructors_validate_hyper_parameters():
    cases = [
        ("uniform", {"aux_scale": -1.0}, "aux_scale"),
        ("population", {"mean_saliency": (0.5,)}, "mean_saliency"),
        ("population", {"mean_saliency": (-0.1, 0.5)}, "mean_saliency"),
        ("population", {"mean_saliency": (0.0, 0.0)}, "all zero"),
        ("instance", {"normalisation": "max"}, "normalisation"),
        ("instance", {"temperature": 0.0}, "temperature"),
        ("learned", {"parametrisation": "tree"}, "parametrisation"),
        ("learned", {"inner_lr": float("nan")}, "inner_lr"),
        ("learned", {"hidden_size": 0}, "hidden_size"),
    ]
    for name, hparams, match in cases:
        with pytest.raises(ValueError, match=match):
            weighting.make_weighting(name, **hparams)
    with pytest.raises(ValueError, match="unknown weighting"):
        weighting.make_weighting("oracle")
    with pytest.raises(TypeError, match="bad hyper-parameters for weighting 'uniform'"):
        weighting.make_weighting("uniform", temperature=2.0)
    with pytest.raises(TypeError, match="mean_saliency"):
        weighting.make_weighting("population")
    with pytest.raises(ValueError, match="needs per-sample saliency"):
        weighting.make_weighting("instance").weights((), jnp.asarray(TEACHER_BVC), None)


def _x64_problem(rng):
    """A tiny float64 MLP student, a train and a validation batch, teacher logits."""
    p, d, vocab, t = 2, 3, 9, 4
    config = models.MLPConfig(
        num_classes=C, vocab_size=vocab, max_patches=p, patch_dim=d, text_embed_size=4,
        hidden_sizes=(8,), init_std=0.5, dtype="float64", param_dtype="float64",
    )  # fmt: skip
    student = nnx.split(models.build_model(config, rngs=nnx.Rngs(0)))

    def batch(n):
        return MultimodalBatch(
            text_ids_bt=jnp.asarray(rng.integers(0, vocab, (n, t)), jnp.int32),
            text_mask_bt=jnp.asarray(rng.random((n, t)) < 0.8),
            image_bpd=jnp.asarray(rng.normal(size=(n, p, d))),
            image_mask_bp=jnp.ones((n, p), bool),
            label_b=jnp.asarray(rng.integers(0, C, n), jnp.int32),
        )

    return student, batch(B), batch(5), jnp.asarray(rng.normal(scale=2.0, size=(B, 3, C)))


@pytest.mark.parametrize("parametrisation", ["scalar", "net"])
def test_learned_weight_gradient_matches_finite_differences_in_float64(parametrisation):
    with jax.enable_x64(True):
        rng = np.random.default_rng(4)
        (graphdef, theta), train, val, teacher_bvc = _x64_problem(rng)
        scheme = weighting.make_weighting(
            "learned", parametrisation=parametrisation, hidden_size=3, inner_lr=0.5
        )
        phi = scheme.init_params(jax.random.key(0))
        phi = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape)), phi)
        assert all(x.dtype == jnp.float64 for x in jax.tree.leaves((phi, theta)))
        config = losses.DistillationLoss(tau=2.0, alpha=0.5)

        def train_loss(params, w_bm):
            logits_bvc = nnx.merge(graphdef, params).view_logits(train)
            return losses.msd_loss(logits_bvc, teacher_bvc, train.label_b, w_bm, config)[0]

        def val_loss(params):
            logits_bc = nnx.merge(graphdef, params)(val)
            return jnp.mean(losses.cross_entropy(logits_bc, val.label_b))

        flat_phi, unravel = ravel_pytree(phi)

        def meta_loss(flat):
            return weighting.lookahead_validation_loss(
                unravel(flat), scheme, theta, train_loss, val_loss, teacher_bvc
            )

        h = 1e-5
        eye = np.eye(flat_phi.size)
        state = weighting.WeightingState(params=phi, opt_state=scheme.meta_optimizer.init(phi))

        @jax.jit  # one program: gradient, the 2n finite-difference points and meta_update
        def evaluate(flat):
            shifted = jax.vmap(meta_loss)(flat + h * jnp.concatenate([eye, -eye]))
            updated = weighting.meta_update(scheme, state, theta, train_loss, val_loss, teacher_bvc)
            return jax.grad(meta_loss)(flat), shifted, meta_loss(flat), updated

        grad, shifted, value, (new_state, metrics) = jax.device_get(evaluate(flat_phi))
        n = flat_phi.size
        fd = (shifted[:n] - shifted[n:]) / (2 * h)
        assert np.abs(grad).max() > 1e-4  # the look-ahead makes phi matter
        np.testing.assert_allclose(grad, fd, rtol=1e-4, atol=1e-9)

        # meta_update takes one Adam step along that gradient (size meta_lr, sign of -grad).
        step = ravel_pytree(new_state.params)[0] - flat_phi
        np.testing.assert_allclose(step, -scheme.meta_lr * np.sign(fd), rtol=1e-3)
        np.testing.assert_allclose(metrics["meta/val_loss_lookahead"], value, rtol=1e-12)

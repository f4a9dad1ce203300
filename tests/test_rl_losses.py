"""AIPO, PPO-clip / GRPO, KL and entropy terms: values and gradients vs NumPy references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.rl.losses import (
    AIPOLoss,
    PolicyLossInputs,
    PPOClipLoss,
    kl_penalty,
    make_loss,
)

RHO = 2.5
EPS_LOW, EPS_HIGH = 0.2, 0.28
# Ratios on both sides of 1 +- eps and of rho (none on a boundary).
RATIOS = np.array([0.3, 0.7, 0.95, 1.0, 1.1, 1.5, 3.0, 6.0])


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(2)
    b, t = 4, 5
    mask = np.zeros((b, t), bool)
    mask[0, :] = True
    mask[1, :3] = True
    mask[2, :1] = True  # row 3 stays empty (a bucket-filling row)
    logpi = -rng.uniform(0.1, 3.0, size=(b, t))
    ratio = rng.choice(RATIOS, size=(b, t))
    ratio[0, :4] = [6.0, 3.0, 0.3, 1.1]  # make sure row 0 covers every regime
    logmu = logpi - np.log(ratio)
    ref = logpi + rng.normal(scale=0.5, size=(b, t))
    entropy = rng.uniform(0.0, 2.0, size=(b, t))
    adv = np.array([1.3, -0.7, 0.4, 2.0])
    # Padding holds garbage that must not reach the loss or its gradient.
    logpi_padded = np.where(mask, logpi, np.nan).astype(np.float32)
    logmu_padded = np.where(mask, logmu, -np.inf).astype(np.float32)
    inputs = PolicyLossInputs(
        logprobs_bt=jnp.asarray(logpi_padded),
        behaviour_logprobs_bt=jnp.asarray(logmu_padded),
        advantages_b=jnp.asarray(adv, jnp.float32),
        mask_bt=jnp.asarray(mask),
        ref_logprobs_bt=jnp.asarray(np.where(mask, ref, np.inf), jnp.float32),
        entropy_bt=jnp.asarray(np.where(mask, entropy, np.nan), jnp.float32),
    )
    # The references use the fp32-rounded inputs in float64.
    ref_np = dict(
        logpi=np.where(mask, logpi_padded, 0).astype(np.float64),
        logmu=np.where(mask, logmu_padded, 0).astype(np.float64),
        ref=np.where(mask, np.asarray(inputs.ref_logprobs_bt), 0).astype(np.float64),
        entropy=np.where(mask, np.asarray(inputs.entropy_bt), 0).astype(np.float64),
        adv=np.asarray(inputs.advantages_b, np.float64)[:, None] * np.ones((1, t)),
        mask=mask,
    )
    return inputs, ref_np


def token_weights(mask, normaliser):
    """d loss / d per-token-loss for each normaliser, written out independently."""
    if normaliser == "tokens":
        return mask / mask.sum()
    n_b = mask.sum(axis=1, keepdims=True)
    rows_with_tokens = (n_b > 0).sum()
    return np.where(mask, 1.0 / np.maximum(n_b, 1) / rows_with_tokens, 0.0)


def grads(loss_fn, inputs):
    """jax.grad of the loss wrt log pi and the entropy input, under jit."""

    def f(logprobs_bt, entropy_bt):
        return loss_fn(inputs.replace(logprobs_bt=logprobs_bt, entropy_bt=entropy_bt))

    fn = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))
    (loss, metrics), (g_logpi, g_ent) = fn(inputs.logprobs_bt, inputs.entropy_bt)
    return loss, metrics, np.asarray(g_logpi), np.asarray(g_ent)


@pytest.mark.parametrize("normaliser", ["tokens", "sequence_mean"])
def test_aipo_value_and_gradient(data, normaliser):
    inputs, r = data
    w = token_weights(r["mask"], normaliser)
    ratio = np.exp(r["logpi"] - r["logmu"])
    loss, metrics, g_logpi, g_ent = grads(AIPOLoss(rho=RHO, normaliser=normaliser), inputs)
    np.testing.assert_allclose(
        loss, np.sum(w * -np.minimum(ratio, RHO) * r["adv"] * r["logpi"]), rtol=1e-6
    )
    # The acceptance criterion: grad wrt log pi = -min(ratio, rho) * A / normaliser, per token,
    # including tokens above rho; exactly 0 on padding.
    np.testing.assert_allclose(g_logpi, -np.minimum(ratio, RHO) * r["adv"] * w, rtol=1e-6)
    assert np.all(g_logpi[~r["mask"]] == 0.0) and np.all(g_ent == 0.0)
    above = r["mask"] & (ratio > RHO)
    assert above.sum() >= 2
    np.testing.assert_allclose(metrics["truncated_fraction"], above.sum() / r["mask"].sum())


def test_aipo_is_not_a_one_sided_clip(data):
    """The naive `-min(ratio, rho) * A` has zero gradient above rho; AIPO keeps weight rho."""
    inputs, r = data
    mask = r["mask"]
    w = token_weights(mask, "tokens")

    def naive(logprobs_bt):
        ratio_bt = jnp.exp(jnp.where(mask, logprobs_bt - inputs.behaviour_logprobs_bt, 0.0))
        per_token = -jnp.minimum(ratio_bt, RHO) * inputs.advantages_b[:, None]
        return jnp.sum(jnp.where(mask, per_token, 0.0)) / mask.sum()

    g_naive = np.asarray(jax.grad(naive)(inputs.logprobs_bt))
    _, _, g_aipo, _ = grads(AIPOLoss(rho=RHO), inputs)
    ratio = np.exp(r["logpi"] - r["logmu"])
    above, below = mask & (ratio > RHO), mask & (ratio < RHO)
    assert np.all(g_naive[above] == 0.0)
    np.testing.assert_allclose(g_aipo[above], (-RHO * r["adv"] * w)[above], rtol=1e-6)
    assert np.all(np.abs(g_aipo[above]) > 1e-3)
    # Below rho the two agree: d(-ratio A)/d log pi = -ratio A = AIPO's weight times -A.
    np.testing.assert_allclose(g_naive[below], g_aipo[below], rtol=1e-5)


@pytest.mark.parametrize("normaliser", ["tokens", "sequence_mean"])
def test_ppo_clip_value_and_gradient(data, normaliser):
    inputs, r = data
    w = token_weights(r["mask"], normaliser)
    ratio, adv = np.exp(r["logpi"] - r["logmu"]), r["adv"]
    loss_fn = PPOClipLoss(clip_eps=EPS_LOW, clip_eps_high=EPS_HIGH, normaliser=normaliser)
    loss, metrics, g_logpi, _ = grads(loss_fn, inputs)
    surrogate = np.minimum(ratio * adv, np.clip(ratio, 1 - EPS_LOW, 1 + EPS_HIGH) * adv)
    np.testing.assert_allclose(loss, np.sum(w * -surrogate), rtol=1e-6)
    # The clip is active (zero gradient) only on the side where it binds.
    clipped = ((adv > 0) & (ratio > 1 + EPS_HIGH)) | ((adv < 0) & (ratio < 1 - EPS_LOW))
    clipped &= r["mask"]
    assert clipped.sum() >= 2 and (r["mask"] & ~clipped).sum() >= 2
    want = np.where(clipped, 0.0, -ratio * adv * w)
    np.testing.assert_allclose(g_logpi, want, rtol=1e-6, atol=1e-12)
    np.testing.assert_allclose(metrics["clip_fraction"], clipped.sum() / r["mask"].sum())


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_kl_estimators_value_and_gradient(data, estimator):
    inputs, r = data
    log_r = r["ref"] - r["logpi"]
    want_kl = -log_r if estimator == "k1" else np.exp(log_r) - 1 - log_r
    want_grad = np.ones_like(log_r) if estimator == "k1" else 1 - np.exp(log_r)
    got = kl_penalty(
        jnp.asarray(r["logpi"], jnp.float32), jnp.asarray(r["ref"], jnp.float32), estimator
    )
    np.testing.assert_allclose(got, want_kl, rtol=1e-6, atol=1e-7)
    if estimator == "k3":
        assert np.all(np.asarray(got) >= 0)

    coef = 0.1
    w = token_weights(r["mask"], "tokens")
    ratio = np.exp(r["logpi"] - r["logmu"])
    loss_fn = make_loss("aipo", rho=RHO, kl_coef=coef, kl_estimator=estimator)
    loss, metrics, g_logpi, _ = grads(loss_fn, inputs)
    pg = -np.minimum(ratio, RHO) * r["adv"] * r["logpi"]
    np.testing.assert_allclose(loss, np.sum(w * (pg + coef * want_kl)), rtol=1e-6)
    np.testing.assert_allclose(metrics["kl"], np.sum(w * want_kl), rtol=1e-5)
    want = (-np.minimum(ratio, RHO) * r["adv"] + coef * want_grad) * w
    np.testing.assert_allclose(g_logpi, want, rtol=1e-5, atol=1e-9)


def test_entropy_bonus(data):
    inputs, r = data
    coef = 0.05
    w = token_weights(r["mask"], "sequence_mean")
    loss_fn = make_loss("grpo", clip_eps=EPS_LOW, entropy_coef=coef)
    loss, metrics, _, g_ent = grads(loss_fn, inputs)
    np.testing.assert_allclose(metrics["entropy"], np.sum(w * r["entropy"]), rtol=1e-6)
    np.testing.assert_allclose(loss, metrics["pg_loss"] - coef * metrics["entropy"], rtol=1e-6)
    np.testing.assert_allclose(g_ent, -coef * w, rtol=1e-6)


def test_registry_and_validation(data):
    inputs, _ = data
    assert make_loss("grpo").normaliser == "sequence_mean"
    assert make_loss("grpo", normaliser="tokens").normaliser == "tokens"
    assert make_loss("aipo").normaliser == "tokens" and make_loss("aipo").rho == 4.0
    assert isinstance(make_loss("ppo_clip"), PPOClipLoss)
    bad = [
        ("aipo", {"rho": 0.5}, ValueError),
        ("aipo", {"rho": float("inf")}, ValueError),
        ("aipo", {"normaliser": "batch"}, ValueError),
        ("aipo", {"kl_coef": -1.0}, ValueError),
        ("aipo", {"kl_estimator": "k2"}, ValueError),
        ("ppo_clip", {"clip_eps": 1.5}, ValueError),
        ("ppo_clip", {"clip_eps_high": 0.0}, ValueError),
        ("aipo", {"clip_eps": 0.2}, TypeError),
        ("reinforce", {}, ValueError),
    ]
    for name, hparams, error in bad:
        with pytest.raises(error):
            make_loss(name, **hparams)
    with pytest.raises(ValueError, match="ref_logprobs_bt"):
        make_loss("aipo", kl_coef=0.1)(inputs.replace(ref_logprobs_bt=None))
    with pytest.raises(ValueError, match="entropy_bt"):
        make_loss("aipo", entropy_coef=0.1)(inputs.replace(entropy_bt=None))


def test_behaviour_kl_metric(data):
    """`behaviour_kl`: KL(mu || pi) per token, k3 on mu's samples ((r - 1) - log r with
    r = pi / mu), averaged over the real tokens: ~0 on policy, > 0 otherwise."""
    inputs, r = data
    _, metrics = AIPOLoss()(inputs)
    log_r = (r["logpi"] - r["logmu"])[r["mask"]]
    expected = np.mean(np.expm1(log_r) - log_r)
    np.testing.assert_allclose(float(metrics["behaviour_kl"]), expected, rtol=1e-5)
    assert expected > 0.1
    _, on_policy = AIPOLoss()(inputs.replace(behaviour_logprobs_bt=inputs.logprobs_bt))
    assert abs(float(on_policy["behaviour_kl"])) < 1e-7

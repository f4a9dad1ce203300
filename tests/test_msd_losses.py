"""KD / MSD losses and saliency scores against float64 NumPy references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from msd_jax import losses, saliency

B, C = 6, 5


def np_log_softmax(z):
    z = np.asarray(z, np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def np_kl(teacher, student, tau):
    log_p, log_q = np_log_softmax(teacher / tau), np_log_softmax(student / tau)
    return (np.exp(log_p) * (log_p - log_q)).sum(-1)


def np_ce(logits, label):
    return -np.take_along_axis(np_log_softmax(logits), label[..., None], -1)[..., 0]


def random_logits(seed, *shape):
    return np.random.default_rng(seed).normal(scale=2.0, size=shape).astype(np.float32)


LABEL_B = np.random.default_rng(9).integers(0, C, B)


@pytest.mark.parametrize("tau, alpha", [(2.5, 0.3), (1.0, 0.0), (4.0, 1.0)])
def test_kd_loss_matches_numpy(tau, alpha):
    student, teacher = random_logits(0, B, C), random_logits(1, B, C)
    config = losses.DistillationLoss(tau=tau, alpha=alpha)
    loss, metrics = losses.kd_loss(jnp.asarray(student), jnp.asarray(teacher), LABEL_B, config)
    ce, kl = np_ce(student, LABEL_B), tau**2 * np_kl(teacher, student, tau)
    np.testing.assert_allclose(loss, np.mean((1 - alpha) * ce + alpha * kl), rtol=1e-6)
    np.testing.assert_allclose(metrics["loss/ce"], ce.mean(), rtol=1e-6)
    np.testing.assert_allclose(metrics["loss/kd_kl"], kl.mean(), rtol=1e-6)
    acc = np.mean(student.argmax(-1) == LABEL_B)
    assert metrics["accuracy/full"] == pytest.approx(acc)
    assert loss.dtype == jnp.float32


def test_msd_loss_matches_numpy_values_and_gradient():
    tau, alpha = 2.0, 0.4
    student, teacher = random_logits(2, B, 3, C), random_logits(3, B, 3, C)
    weights_bm = np.random.default_rng(4).uniform(0.2, 1.8, (B, 2)).astype(np.float32)
    config = losses.DistillationLoss(tau=tau, alpha=alpha)

    def loss_fn(s):
        return losses.msd_loss(s, jnp.asarray(teacher), LABEL_B, jnp.asarray(weights_bm), config)

    (loss, metrics), grad = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(student)

    kl_bv = tau**2 * np_kl(teacher, student, tau)
    ce = np_ce(student[:, 0], LABEL_B)
    kd = (1 - alpha) * ce + alpha * kl_bv[:, 0]
    aux = (weights_bm * kl_bv[:, 1:]).sum(1)
    np.testing.assert_allclose(loss, np.mean(kd + aux), rtol=1e-6)
    np.testing.assert_allclose(metrics["loss/kd"], kd.mean(), rtol=1e-6)
    np.testing.assert_allclose(metrics["loss/aux_kl/text"], kl_bv[:, 1].mean(), rtol=1e-6)
    np.testing.assert_allclose(metrics["loss/aux_kl/image"], kl_bv[:, 2].mean(), rtol=1e-6)
    np.testing.assert_allclose(metrics["loss/aux_weighted"], aux.mean(), rtol=1e-6)
    np.testing.assert_allclose(metrics["weights/mass"], weights_bm.sum(1).mean(), rtol=1e-6)
    np.testing.assert_allclose(metrics["weights/image"], weights_bm[:, 1].mean(), rtol=1e-6)
    for v, name in enumerate(("full", "text", "image")):
        acc = np.mean(student[:, v].argmax(-1) == LABEL_B)
        assert metrics[f"accuracy/{name}"] == pytest.approx(acc)

    # d/dz_S of tau^2 KL(p^tau(z_T) || p^tau(z_S)) is tau (q - p); of CE, softmax - onehot.
    p, q = np.exp(np_log_softmax(teacher / tau)), np.exp(np_log_softmax(student / tau))
    onehot = np.eye(C)[LABEL_B]
    expected = np.zeros_like(p)
    expected[:, 0] = (1 - alpha) * (np.exp(np_log_softmax(student[:, 0])) - onehot)
    expected[:, 0] += alpha * tau * (q[:, 0] - p[:, 0])
    expected[:, 1:] = weights_bm[..., None] * tau * (q[:, 1:] - p[:, 1:])
    np.testing.assert_allclose(grad, expected / B, rtol=1e-5, atol=1e-7)


def test_msd_with_zero_weights_is_kd_and_kd_aug_uses_full_targets():
    config = losses.DistillationLoss(tau=3.0, alpha=0.7)
    student, teacher = random_logits(5, B, 3, C), random_logits(6, B, 3, C)
    msd, _ = losses.msd_loss(student, teacher, LABEL_B, jnp.zeros(2), config)
    kd, _ = losses.kd_loss(student[:, 0], teacher[:, 0], LABEL_B, config)
    np.testing.assert_allclose(msd, kd, rtol=1e-6)
    aug = np.asarray(losses.kd_aug_targets(jnp.asarray(teacher)))
    np.testing.assert_array_equal(aug, np.repeat(teacher[:, :1], 3, axis=1))
    # bf16 logits are upcast: the loss is float32 and equals the reference on upcast inputs.
    bf16 = jnp.asarray(student).astype(jnp.bfloat16)
    loss_bf16, _ = losses.msd_loss(bf16, teacher, LABEL_B, jnp.ones(2), config)
    loss_f32, _ = losses.msd_loss(bf16.astype(jnp.float32), teacher, LABEL_B, jnp.ones(2), config)
    assert loss_bf16.dtype == jnp.float32 and loss_bf16 == loss_f32


def test_loss_config_is_validated():
    with pytest.raises(ValueError, match="tau"):
        losses.DistillationLoss(tau=0.0)
    with pytest.raises(ValueError, match="alpha"):
        losses.DistillationLoss(alpha=1.5)
    with pytest.raises(ValueError, match=r"\[B, 3, C\]"):
        losses.msd_loss(jnp.zeros((2, 2, 3)), jnp.zeros((2, 3, 3)), jnp.zeros(2, int), 1.0,
                        losses.DistillationLoss())  # fmt: skip


def test_saliency_scores_match_numpy():
    teacher = random_logits(7, B, 3, C)
    ce = np_ce(teacher, np.repeat(LABEL_B[:, None], 3, 1))  # [B, V]
    s1 = np.stack([ce[:, 2] - ce[:, 0], ce[:, 1] - ce[:, 0]], 1)  # without text = image-only
    s2 = np.stack(
        [np_kl(teacher[:, 0], teacher[:, 2], 1.0), np_kl(teacher[:, 0], teacher[:, 1], 1.0)], 1
    )
    probs = np.exp(np_log_softmax(teacher))
    s3 = np.stack([probs[np.arange(B), 1, LABEL_B], probs[np.arange(B), 2, LABEL_B]], 1)
    np.testing.assert_allclose(saliency.saliency("s1", teacher, LABEL_B), s1, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(saliency.saliency("s2", teacher), s2, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(saliency.saliency("s3", teacher, LABEL_B), s3, rtol=1e-5, atol=1e-7)
    s2_tau = np.stack(
        [np_kl(teacher[:, 0], teacher[:, 2], 3.0), np_kl(teacher[:, 0], teacher[:, 1], 3.0)], 1
    )
    np.testing.assert_allclose(
        saliency.prediction_shift(teacher, 3.0), s2_tau, rtol=1e-5, atol=1e-7
    )
    np.testing.assert_allclose(saliency.mean_saliency(s3), s3.mean(0), rtol=1e-6)
    assert (s1 < 0).any()  # removing a modality helped some samples: clipped to zero
    np.testing.assert_allclose(saliency.mean_saliency(s1), np.maximum(s1, 0).mean(0), rtol=1e-5)
    with pytest.raises(ValueError, match="needs the labels"):
        saliency.saliency("s1", teacher)
    with pytest.raises(ValueError, match="unknown saliency"):
        saliency.saliency("s4", teacher, LABEL_B)


def test_cross_fitting_takes_each_sample_from_the_teacher_that_did_not_see_it():
    n, k = 11, 3
    fold_n = saliency.fold_assignment(n, k, seed=0)
    np.testing.assert_array_equal(fold_n, saliency.fold_assignment(n, k, seed=0))
    assert sorted(np.bincount(fold_n)) == [3, 4, 4]
    fold_logits = random_logits(8, k, n, 3, C)
    held_out = np.asarray(saliency.held_out_logits(fold_logits, fold_n))
    for i in range(n):
        np.testing.assert_array_equal(held_out[i], fold_logits[fold_n[i], i])
    with pytest.raises(ValueError, match="num_folds"):
        saliency.fold_assignment(3, 1, seed=0)
    with pytest.raises(ValueError, match="fold ids"):
        saliency.held_out_logits(fold_logits, np.full(n, k))

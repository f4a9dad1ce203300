"""Knowledge distillation (KD) and modality-specific distillation (MSD) losses.

Student logits z_S, teacher logits z_T, temperature tau, p^tau(z) = softmax(z / tau), label y.
Per sample b (everything in float32, or float64 under x64, whatever the logits' dtype):

    CE_b    = -log softmax(z_S(x_b))[y_b]
    KL_b(v) = tau^2 KL(p^tau(z_T(x_b^v)) || p^tau(z_S(x_b^v)))      v in {full, text, image}
    L_KD_b  = (1 - alpha) CE_b + alpha KL_b(full)
    L_MSD_b = L_KD_b + sum_{m in {text, image}} w_bm KL_b(m)

and the batch loss is the mean over b. x^m keeps only modality m (`msd_jax.views`); teacher and
student see the same view. Alpha convention: alpha is the weight of the soft (distillation)
term, so alpha = 0 is plain cross-entropy training and alpha = 1 pure distillation; the
auxiliary terms are added on top with weights w_bm and are not scaled by alpha. The tau^2 factor
keeps the soft-term gradients at the scale of the hard-label term as tau changes (Hinton et al.).

KD-aug (the augmentation control of the evaluation) is `msd_loss` with the full-input teacher
logits as the target of every view: `msd_loss(s, kd_aug_targets(t), ...)`.

Metrics are namespaced: "loss/*" (the total and each unweighted term, batch means), "weights/*"
(batch means of w_bm and the auxiliary mass sum_m w_bm) and "accuracy/*" (student, per view).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from msd_jax.views import MODALITIES, NUM_VIEWS, VIEWS


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistillationLoss:
    """Hyper-parameters of KD / MSD.

    Attributes:
      tau: softmax temperature of both networks in the KL terms (> 0).
      alpha: weight of the KD soft term in [0, 1]; 1 - alpha weighs the hard-label CE.
    """

    tau: float = 2.0
    alpha: float = 0.5

    def __post_init__(self):
        if not (math.isfinite(self.tau) and self.tau > 0):
            raise ValueError(f"DistillationLoss.tau must be finite and > 0, got {self.tau}")
        if not (0.0 <= self.alpha <= 1.0):
            raise ValueError(f"DistillationLoss.alpha must be in [0, 1], got {self.alpha}")


def _wide(x: jax.Array) -> jax.Array:
    """`x` in float32, or float64 if it already is."""
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def log_softmax(logits_bc: jax.Array, tau: float = 1.0) -> jax.Array:
    """log softmax(z / tau) over the last axis, in float32 (or wider)."""
    return jax.nn.log_softmax(_wide(logits_bc) / tau, axis=-1)


def cross_entropy(logits_bc: jax.Array, label_b: jax.Array) -> jax.Array:
    """Per-sample `-log softmax(z)[y]`, shape `logits_bc.shape[:-1]`."""
    logp = log_softmax(logits_bc)
    return -jnp.take_along_axis(logp, label_b[..., None].astype(jnp.int32), axis=-1)[..., 0]


def kl_divergence(teacher_logits: jax.Array, student_logits: jax.Array, tau: float) -> jax.Array:
    """Per-sample KL(p^tau(z_T) || p^tau(z_S)) over the last axis (no tau^2 factor)."""
    log_p = log_softmax(teacher_logits, tau)
    log_q = log_softmax(student_logits, tau)
    return jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)


def accuracy(logits: jax.Array, label_b: jax.Array) -> jax.Array:
    """Fraction of samples whose arg-max logit is the label (logits `[B, C]`)."""
    return jnp.mean((jnp.argmax(logits, axis=-1) == label_b).astype(jnp.float32))


def kd_loss(
    student_logits_bc: jax.Array,
    teacher_logits_bc: jax.Array,
    label_b: jax.Array,
    config: DistillationLoss,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """L_KD = mean_b [(1 - alpha) CE_b + alpha tau^2 KL_b(full)] and its metrics."""
    ce_b = cross_entropy(student_logits_bc, label_b)
    kl_b = config.tau**2 * kl_divergence(teacher_logits_bc, student_logits_bc, config.tau)
    loss = jnp.mean((1.0 - config.alpha) * ce_b + config.alpha * kl_b)
    metrics = {
        "loss/total": loss,
        "loss/ce": jnp.mean(ce_b),
        "loss/kd_kl": jnp.mean(kl_b),
        "accuracy/full": accuracy(student_logits_bc, label_b),
    }
    return loss, jax.lax.stop_gradient(metrics)


def msd_loss(
    student_logits_bvc: jax.Array,
    teacher_logits_bvc: jax.Array,
    label_b: jax.Array,
    weights_bm: jax.Array,
    config: DistillationLoss,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """L_MSD = mean_b [L_KD_b + sum_m w_bm tau^2 KL_b(m)] and its metrics.

    Args:
      student_logits_bvc, teacher_logits_bvc: logits `[B, 3, C]` on the views `VIEWS`.
      label_b: `[B]` class indices.
      weights_bm: `[B, 2]` auxiliary weights of (text, image), or anything broadcastable
        (a population weight `[2]`); gradients flow into it (the learned weighting needs them).
    """
    if student_logits_bvc.shape[1] != NUM_VIEWS or teacher_logits_bvc.shape[1] != NUM_VIEWS:
        raise ValueError(
            f"logits must be [B, {NUM_VIEWS}, C] over views {VIEWS}; got student "
            f"{student_logits_bvc.shape}, teacher {teacher_logits_bvc.shape}"
        )
    tau = config.tau
    ce_b = cross_entropy(student_logits_bvc[:, 0], label_b)
    kl_bv = tau**2 * kl_divergence(teacher_logits_bvc, student_logits_bvc, tau)
    weights_bm = jnp.broadcast_to(_wide(jnp.asarray(weights_bm)), kl_bv[:, 1:].shape)
    kd_b = (1.0 - config.alpha) * ce_b + config.alpha * kl_bv[:, 0]
    aux_b = jnp.sum(weights_bm * kl_bv[:, 1:], axis=1)
    loss = jnp.mean(kd_b + aux_b)
    metrics = {
        "loss/total": loss,
        "loss/kd": jnp.mean(kd_b),
        "loss/ce": jnp.mean(ce_b),
        "loss/kd_kl": jnp.mean(kl_bv[:, 0]),
        "loss/aux_weighted": jnp.mean(aux_b),
        "weights/mass": jnp.mean(jnp.sum(weights_bm, axis=1)),
    }
    for m, name in enumerate(MODALITIES):
        metrics[f"loss/aux_kl/{name}"] = jnp.mean(kl_bv[:, 1 + m])
        metrics[f"weights/{name}"] = jnp.mean(weights_bm[:, m])
    for v, name in enumerate(VIEWS):
        metrics[f"accuracy/{name}"] = accuracy(student_logits_bvc[:, v], label_b)
    return loss, jax.lax.stop_gradient(metrics)


def kd_aug_targets(teacher_logits_bvc: jax.Array) -> jax.Array:
    """The full-input teacher logits repeated as the target of every view (KD-aug control)."""
    return jnp.broadcast_to(teacher_logits_bvc[:, :1], teacher_logits_bvc.shape)

"""Saliency of each modality for each sample, from cross-fitted (held-out) teacher predictions.

For sample i with label y_i and modality m (m in {text, image}), with p_T the teacher's softmax
at temperature 1 (or `tau` for S2) and "x without m" the view that keeps the other modality:

    S1_im = CE(y_i, z_T(x_i without m)) - CE(y_i, z_T(x_i))       loss increase when m is removed
    S2_im = KL(p_T(x_i) || p_T(x_i without m))                     prediction shift, no label
    S3_im = p_T(y_i | x_i^m)                                       label probability from m alone

S1 may be negative (removing a modality can help); the weighting schemes clip at 0. Output arrays
are `saliency_bm` with columns in `MODALITIES` order (text, image).

Cross-fitting: a teacher's predictions on its own training samples are over-confident, so the
saliency of sample i is computed from a teacher that did not see i. `fold_assignment` splits the
N training samples into K folds; teacher k is trained on every fold but k, predicts the views of
all samples (`fold_logits_knvc`), and `held_out_logits` keeps, for sample i, the predictions of
the teacher whose held-out fold holds i. (The teacher used as the distillation target is the one
trained on everything; only the saliency uses the cross-fitted predictions.)
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from msd_jax.losses import cross_entropy, kl_divergence, log_softmax
from msd_jax.views import MODALITIES, VIEWS

_FULL = VIEWS.index("full")
# Column m of saliency_bm: the view that keeps only MODALITIES[m], and the one without it.
_ONLY = tuple(VIEWS.index(m) for m in MODALITIES)
_WITHOUT = tuple(VIEWS.index(other) for other in reversed(MODALITIES))


def _check_views(teacher_logits_bvc: jax.Array) -> None:
    if teacher_logits_bvc.ndim != 3 or teacher_logits_bvc.shape[1] != len(VIEWS):
        raise ValueError(
            f"teacher logits must be [B, {len(VIEWS)}, C] over views {VIEWS}, got "
            f"{teacher_logits_bvc.shape}"
        )


def loss_increase(teacher_logits_bvc: jax.Array, label_b: jax.Array) -> jax.Array:
    """S1 `[B, 2]`: CE(y, z_T(x without m)) - CE(y, z_T(x))."""
    _check_views(teacher_logits_bvc)
    ce_bv = cross_entropy(teacher_logits_bvc, label_b[:, None])
    return ce_bv[:, _WITHOUT] - ce_bv[:, _FULL, None]


def prediction_shift(teacher_logits_bvc: jax.Array, tau: float = 1.0) -> jax.Array:
    """S2 `[B, 2]`: KL(p_T(x) || p_T(x without m)) at temperature `tau` (no label needed)."""
    _check_views(teacher_logits_bvc)
    full = teacher_logits_bvc[:, _FULL : _FULL + 1]
    return kl_divergence(full, teacher_logits_bvc[:, _WITHOUT], tau)


def unimodal_label_probability(teacher_logits_bvc: jax.Array, label_b: jax.Array) -> jax.Array:
    """S3 `[B, 2]`: p_T(y | x^m), the teacher's probability of the label from m alone."""
    _check_views(teacher_logits_bvc)
    logp_bvc = log_softmax(teacher_logits_bvc[:, _ONLY])
    index = jnp.broadcast_to(label_b[:, None, None].astype(jnp.int32), logp_bvc.shape[:2] + (1,))
    return jnp.exp(jnp.take_along_axis(logp_bvc, index, axis=-1)[..., 0])


def _prediction_shift_unlabelled(teacher_logits_bvc: jax.Array, label_b=None) -> jax.Array:
    return prediction_shift(teacher_logits_bvc)


# name -> (score function of (teacher_logits_bvc, label_b), needs labels)
SALIENCY: dict[str, tuple[Callable[..., jax.Array], bool]] = {
    "s1": (loss_increase, True),
    "s2": (_prediction_shift_unlabelled, False),
    "s3": (unimodal_label_probability, True),
}


def saliency(
    name: str, teacher_logits_bvc: jax.Array, label_b: jax.Array | None = None
) -> jax.Array:
    """Saliency `[B, 2]` by name: "s1" and "s3" need the labels, "s2" does not."""
    if name not in SALIENCY:
        raise ValueError(f"unknown saliency {name!r}; registered: {sorted(SALIENCY)}")
    score_fn, needs_label = SALIENCY[name]
    if needs_label and label_b is None:
        raise ValueError(f"saliency {name!r} needs the labels (only 's2' works without)")
    return score_fn(teacher_logits_bvc, label_b)


def mean_saliency(saliency_nm: jax.Array) -> tuple[float, ...]:
    """Population saliency (text, image): mean over samples of max(s_im, 0).

    Clipped like the "instance" weighting, so a negative S1 (removing m helped) counts as zero
    saliency. The input of `make_weighting("population", mean_saliency=...)`.
    """
    return tuple(float(x) for x in np.asarray(jnp.mean(jnp.maximum(saliency_nm, 0.0), axis=0)))


def fold_assignment(num_samples: int, num_folds: int, seed: int) -> np.ndarray:
    """`fold_n` in [0, K): a random split of N samples into K folds of sizes differing by <= 1."""
    if not 2 <= num_folds <= num_samples:
        raise ValueError(f"need 2 <= num_folds <= num_samples, got {num_folds} and {num_samples}")
    order = np.random.default_rng(seed).permutation(num_samples)
    fold_n = np.empty(num_samples, np.int32)
    fold_n[order] = np.arange(num_samples) % num_folds
    return fold_n


def held_out_logits(fold_logits_knvc: jax.Array, fold_n: np.ndarray | jax.Array) -> jax.Array:
    """Cross-fitted logits `[N, V, C]`: sample i takes teacher fold_n[i]'s prediction.

    `fold_logits_knvc[k]` are the view logits of every sample under the teacher trained without
    fold k.
    """
    k, n = fold_logits_knvc.shape[:2]
    fold_n = jnp.asarray(fold_n)
    if fold_n.shape != (n,):
        raise ValueError(f"fold_n has shape {fold_n.shape}, expected ({n},)")
    if int(jnp.min(fold_n)) < 0 or int(jnp.max(fold_n)) >= k:
        raise ValueError(f"fold ids must lie in [0, {k}) for {k} fold teachers")
    return jnp.asarray(fold_logits_knvc)[fold_n, jnp.arange(n)]

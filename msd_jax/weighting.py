"""Weights w_bm of the per-modality auxiliary terms, selected by name.

Every scheme gives each sample the same total auxiliary mass

    sum_m w_bm = M * aux_scale          (M = 2 modalities; aux_scale = 1 by default)

so the schemes differ only in how they split it across modalities, never in how much auxiliary
signal the student gets overall (uniform: aux_scale each).

- "uniform":    w_m = aux_scale.
- "population": w_m = M * aux_scale * sbar_m / sum_m' sbar_m', with sbar the mean (cross-fitted)
                saliency of each modality over the training set, given at construction.
- "instance":   per sample, from the sample's cross-fitted saliency s_bm:
                "sum":     w_bm = M aux_scale (s+_bm + eps) / sum_m' (s+_bm' + eps), s+ = max(s, 0)
                "softmax": w_bm = M aux_scale softmax_m(s_bm / temperature)
- "learned":    w_bm = M aux_scale softmax_m(a_bm) with a_bm = phi_m (per-modality scalars) or
                a tiny net a_b = W2 tanh(W1 f_b + b1) + b2 on teacher features f_b (per view:
                entropy and max probability of p_T). phi is trained by a one-step look-ahead
                bilevel update on a validation batch (`meta_update`):

                    theta'(phi) = theta - eta_in * grad_theta L_MSD(theta, w(phi); train batch)
                    phi        <- phi - meta_opt(grad_phi L_val(theta'(phi)))

                with L_val the student's full-input cross-entropy on the validation batch. The
                look-ahead is a plain SGD step (as in DARTS / learning-to-reweight) whatever the
                student's real optimizer; grad_phi differentiates through it (second order).
                phi starts at the uniform split (scalars and the last layer at zero).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import optax
from flax import struct

from msd_jax.losses import log_softmax
from msd_jax.views import NUM_MODALITIES, NUM_VIEWS


@struct.dataclass
class WeightingState:
    """Trainable state of a weighting scheme (empty for the fixed ones).

    Attributes:
      params: the learned scheme's phi (a dict of arrays), else ().
      opt_state: the meta-optimizer's state of phi, else ().
    """

    params: Any = ()
    opt_state: Any = ()


def _check_positive(owner: str, name: str, value: float, allow_zero: bool = False) -> None:
    ok = math.isfinite(value) and (value >= 0 if allow_zero else value > 0)
    if not ok:
        raise ValueError(
            f"{owner}.{name} must be finite and {'>=' if allow_zero else '>'} 0, got {value}"
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Weighting:
    """Base class: `weights(params, teacher_logits_bvc, saliency_bm) -> w_bm [B, 2]`.

    Attributes:
      aux_scale: the uniform per-modality weight; every scheme's per-sample mass is M * aux_scale.
    """

    needs_saliency: ClassVar[bool] = False
    learned: ClassVar[bool] = False

    aux_scale: float = 1.0

    def __post_init__(self):
        _check_positive(type(self).__name__, "aux_scale", self.aux_scale, allow_zero=True)

    @property
    def mass(self) -> float:
        """Total auxiliary weight per sample, sum_m w_bm."""
        return NUM_MODALITIES * self.aux_scale

    def init(self, key: jax.Array) -> WeightingState:
        del key
        return WeightingState()

    def weights(
        self, params: Any, teacher_logits_bvc: jax.Array, saliency_bm: jax.Array | None
    ) -> jax.Array:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True, kw_only=True)
class UniformWeighting(Weighting):
    """w_bm = aux_scale."""

    def weights(self, params, teacher_logits_bvc, saliency_bm):
        b = teacher_logits_bvc.shape[0]
        return jnp.full((b, NUM_MODALITIES), self.aux_scale, jnp.float32)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PopulationWeighting(Weighting):
    """w_m = M aux_scale sbar_m / sum sbar: one weight per modality from the mean saliency.

    Attributes:
      mean_saliency: (text, image) mean cross-fitted saliency over the training set
        (`saliency.mean_saliency`), each >= 0 and not all 0 (clip S1 first if it can be < 0).
    """

    mean_saliency: tuple[float, ...]

    def __post_init__(self):
        super().__post_init__()
        s = tuple(float(x) for x in self.mean_saliency)
        if len(s) != NUM_MODALITIES or not all(math.isfinite(x) and x >= 0 for x in s):
            raise ValueError(
                f"PopulationWeighting.mean_saliency must be {NUM_MODALITIES} finite values >= 0 "
                f"(text, image), got {self.mean_saliency}"
            )
        if sum(s) <= 0:
            raise ValueError("PopulationWeighting.mean_saliency is all zero; use 'uniform'")
        object.__setattr__(self, "mean_saliency", s)

    def weights(self, params, teacher_logits_bvc, saliency_bm):
        b = teacher_logits_bvc.shape[0]
        total = sum(self.mean_saliency)
        w_m = jnp.asarray([self.mass * s / total for s in self.mean_saliency], jnp.float32)
        return jnp.broadcast_to(w_m, (b, NUM_MODALITIES))


INSTANCE_NORMALISATIONS = ("sum", "softmax")


@dataclasses.dataclass(frozen=True, kw_only=True)
class InstanceWeighting(Weighting):
    """Per-sample weights from each sample's saliency (see the module docstring).

    Attributes:
      normalisation: "sum" (clipped saliency / its sum) or "softmax".
      temperature: softmax temperature (> 0).
      eps: added to the clipped saliency under "sum" (> 0), so a sample whose saliency is all
        zero gets the uniform split.
    """

    needs_saliency: ClassVar[bool] = True

    normalisation: str = "sum"
    temperature: float = 1.0
    eps: float = 1e-6

    def __post_init__(self):
        super().__post_init__()
        if self.normalisation not in INSTANCE_NORMALISATIONS:
            raise ValueError(
                f"InstanceWeighting.normalisation must be one of {INSTANCE_NORMALISATIONS}, got "
                f"{self.normalisation!r}"
            )
        _check_positive("InstanceWeighting", "temperature", self.temperature)
        _check_positive("InstanceWeighting", "eps", self.eps)

    def weights(self, params, teacher_logits_bvc, saliency_bm):
        if saliency_bm is None:
            raise ValueError(
                "the 'instance' weighting needs per-sample saliency: pass "
                "TeacherTargets(saliency_bm=...) from cross-fitted teachers (msd_jax.saliency)"
            )
        s_bm = saliency_bm.astype(jnp.promote_types(saliency_bm.dtype, jnp.float32))
        if self.normalisation == "softmax":
            return self.mass * jax.nn.softmax(s_bm / self.temperature, axis=-1)
        clipped = jnp.maximum(s_bm, 0.0) + self.eps
        return self.mass * clipped / jnp.sum(clipped, axis=-1, keepdims=True)


LEARNED_PARAMETRISATIONS = ("scalar", "net")
NUM_TEACHER_FEATURES = 2 * NUM_VIEWS


def teacher_features(teacher_logits_bvc: jax.Array) -> jax.Array:
    """`[B, 2V]`: entropy and max probability of p_T on each view (inputs of the weight net)."""
    logp_bvc = log_softmax(teacher_logits_bvc)
    p_bvc = jnp.exp(logp_bvc)
    entropy_bv = -jnp.sum(p_bvc * logp_bvc, axis=-1)
    return jnp.concatenate([entropy_bv, jnp.max(p_bvc, axis=-1)], axis=-1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LearnedWeighting(Weighting):
    """w_bm = M aux_scale softmax(a_bm), a learned by a one-step look-ahead bilevel update.

    Attributes:
      parametrisation: "scalar" (phi = one logit per modality) or "net" (a tiny MLP on
        `teacher_features`).
      hidden_size: the weight net's width.
      inner_lr: eta_in, the look-ahead SGD step on the student (> 0).
      meta_lr: Adam learning rate of phi (> 0).
    """

    learned: ClassVar[bool] = True

    parametrisation: str = "scalar"
    hidden_size: int = 8
    inner_lr: float = 1e-2
    meta_lr: float = 1e-2

    def __post_init__(self):
        super().__post_init__()
        if self.parametrisation not in LEARNED_PARAMETRISATIONS:
            raise ValueError(
                f"LearnedWeighting.parametrisation must be one of {LEARNED_PARAMETRISATIONS}, got "
                f"{self.parametrisation!r}"
            )
        if self.hidden_size < 1:
            raise ValueError(f"LearnedWeighting.hidden_size must be >= 1, got {self.hidden_size}")
        _check_positive("LearnedWeighting", "inner_lr", self.inner_lr)
        _check_positive("LearnedWeighting", "meta_lr", self.meta_lr)

    @property
    def meta_optimizer(self) -> optax.GradientTransformation:
        return optax.adam(self.meta_lr)

    def init_params(self, key: jax.Array) -> dict[str, jax.Array]:
        """phi at the uniform split: zero logits, or a net whose last layer is zero."""
        if self.parametrisation == "scalar":
            return {"logits_m": jnp.zeros((NUM_MODALITIES,), jnp.float32)}
        f, h = NUM_TEACHER_FEATURES, self.hidden_size
        return {
            "w1_fh": jax.random.normal(key, (f, h), jnp.float32) / math.sqrt(f),
            "b1_h": jnp.zeros((h,), jnp.float32),
            "w2_hm": jnp.zeros((h, NUM_MODALITIES), jnp.float32),
            "b2_m": jnp.zeros((NUM_MODALITIES,), jnp.float32),
        }

    def init(self, key: jax.Array) -> WeightingState:
        params = self.init_params(key)
        return WeightingState(params=params, opt_state=self.meta_optimizer.init(params))

    def weights(self, params, teacher_logits_bvc, saliency_bm):
        b = teacher_logits_bvc.shape[0]
        if self.parametrisation == "scalar":
            logits_bm = jnp.broadcast_to(params["logits_m"], (b, NUM_MODALITIES))
        else:
            features_bf = teacher_features(jax.lax.stop_gradient(teacher_logits_bvc))
            features_bf = features_bf.astype(params["w1_fh"].dtype)
            hidden_bh = jnp.tanh(features_bf @ params["w1_fh"] + params["b1_h"])
            logits_bm = hidden_bh @ params["w2_hm"] + params["b2_m"]
        return self.mass * jax.nn.softmax(logits_bm, axis=-1)


def lookahead_validation_loss(
    weight_params: Any,
    scheme: LearnedWeighting,
    student_params: Any,
    train_loss_fn: Callable[[Any, jax.Array], jax.Array],
    val_loss_fn: Callable[[Any], jax.Array],
    teacher_logits_bvc: jax.Array,
    saliency_bm: jax.Array | None = None,
) -> jax.Array:
    """L_val(theta - eta_in grad_theta L_train(theta, w(phi))) as a function of phi.

    Args:
      weight_params: phi.
      student_params: theta (any pytree, e.g. an nnx.State of Params).
      train_loss_fn: (theta, w_bm) -> scalar MSD loss on the training batch.
      val_loss_fn: theta -> scalar validation loss.
    """
    w_bm = scheme.weights(weight_params, teacher_logits_bvc, saliency_bm)
    grads = jax.grad(train_loss_fn)(student_params, w_bm)
    lookahead = jax.tree.map(lambda p, g: p - scheme.inner_lr * g, student_params, grads)
    return val_loss_fn(lookahead)


def meta_update(
    scheme: LearnedWeighting,
    state: WeightingState,
    student_params: Any,
    train_loss_fn: Callable[[Any, jax.Array], jax.Array],
    val_loss_fn: Callable[[Any], jax.Array],
    teacher_logits_bvc: jax.Array,
    saliency_bm: jax.Array | None = None,
) -> tuple[WeightingState, dict[str, jax.Array]]:
    """One meta-optimizer step on phi along grad_phi of `lookahead_validation_loss`."""
    val_loss, grads = jax.value_and_grad(lookahead_validation_loss)(
        state.params,
        scheme,
        student_params,
        train_loss_fn,
        val_loss_fn,
        teacher_logits_bvc,
        saliency_bm,
    )
    updates, opt_state = scheme.meta_optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {"meta/val_loss_lookahead": val_loss, "meta/grad_norm": optax.tree.norm(grads)}
    return WeightingState(params=params, opt_state=opt_state), metrics


WEIGHTINGS: dict[str, Callable[..., Weighting]] = {
    "uniform": UniformWeighting,
    "population": PopulationWeighting,
    "instance": InstanceWeighting,
    "learned": LearnedWeighting,
}


def make_weighting(name: str, **hparams) -> Weighting:
    """A registered scheme by name, e.g. `make_weighting("instance", normalisation="softmax")`."""
    if name not in WEIGHTINGS:
        raise ValueError(f"unknown weighting {name!r}; registered: {sorted(WEIGHTINGS)}")
    try:
        return WEIGHTINGS[name](**hparams)
    except TypeError as e:
        raise TypeError(f"bad hyper-parameters for weighting {name!r}: {e}") from e

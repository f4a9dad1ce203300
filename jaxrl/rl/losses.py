"""Policy-gradient losses selected by name: AIPO (LlamaRL), PPO-clip, GRPO, Dr. GRPO, DAPO, plus KL
and entropy.

Every loss maps `PolicyLossInputs` (per-token log-probs of the sampled completion tokens under the
trained policy pi, the behaviour policy mu that sampled them, optionally a frozen reference policy,
per-sequence advantages A_b and the completion mask) to `(scalar loss, metrics)`:

    loss = N( l_bt + beta_kl * KL_bt - beta_ent * H_bt )

where l_bt is the loss's per-token policy term, KL_bt a per-token estimator of KL(pi || pi_ref),
H_bt the per-token entropy of pi, and N the normaliser over completion tokens (mask m_bt, n_b =
sum_t m_bt, B' = number of rows with n_b > 0):

    "tokens":         N(x) = sum_{b,t} m_bt x_bt / sum_{b,t} m_bt
    "sequence_mean":  N(x) = (1 / B') sum_b (1 / n_b) sum_t m_bt x_bt
    "constant":       N(x) = sum_{b,t} m_bt x_bt / (B' * T)      (T: the padded completion length,
                      i.e. the sampler's max_new_tokens; Dr. GRPO's constant normaliser)

Masked positions may hold anything (padding, inf): they are replaced before any arithmetic, so their
value and gradient are exactly zero.

`make_loss(name, **hparams)` builds a registered loss; the constructors validate hyper-parameters.
The registered names are presets that mean what the literature means by them: each class states
its settings (clip range, normaliser, and the advantage estimator it goes with, `advantage`, which
`jaxrl.train.trainer.LossConfig` uses unless told otherwise):

    name       policy term                    eps_low / eps_high   normaliser      advantage
    aipo       -sg(min(r, rho)) A log pi      rho = 4              tokens          group_mean
    grpo       PPO clip                       0.2 / 0.2            sequence_mean   group_mean_std
    dr_grpo    PPO clip                       0.2 / 0.2            constant        group_mean
    dapo       PPO clip ("clip higher")       0.2 / 0.28           tokens          group_mean_std
    ppo_clip   PPO clip                       0.2 / 0.2            tokens          group_mean
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import struct

NORMALISERS = ("tokens", "sequence_mean", "constant")
KL_ESTIMATORS = ("k1", "k3")


@struct.dataclass
class PolicyLossInputs:
    """Per-token inputs of a policy loss (all fp32 except the mask).

    Attributes:
      logprobs_bt: log pi_theta(y_bt), the differentiable log-probs of the sampled tokens.
      behaviour_logprobs_bt: log mu(y_bt) from the sampler (for PPO/GRPO: the "old" policy).
      advantages_b: per-sequence advantages A_b, broadcast over the sequence's tokens.
      mask_bt: True (or 1) on completion tokens that count.
      ref_logprobs_bt: log pi_ref(y_bt) of a frozen reference policy; needed when kl_coef > 0.
      entropy_bt: per-token entropy of pi at each position; needed when entropy_coef > 0.
    """

    logprobs_bt: jax.Array
    behaviour_logprobs_bt: jax.Array
    advantages_b: jax.Array
    mask_bt: jax.Array
    ref_logprobs_bt: jax.Array | None = None
    entropy_bt: jax.Array | None = None


def normalise(x_bt: jax.Array, mask_bt: jax.Array, normaliser: str) -> jax.Array:
    """Masked reduction of per-token values to a scalar (see the module docstring)."""
    mask_bt = mask_bt.astype(bool)
    x_bt = jnp.where(mask_bt, x_bt, 0.0)
    if normaliser == "tokens":
        return jnp.sum(x_bt) / jnp.maximum(jnp.sum(mask_bt), 1)
    if normaliser == "sequence_mean":
        n_b = jnp.sum(mask_bt, axis=1)
        per_seq_b = jnp.sum(x_bt, axis=1) / jnp.maximum(n_b, 1)
        return jnp.sum(per_seq_b) / jnp.maximum(jnp.sum(n_b > 0), 1)
    if normaliser == "constant":
        rows = jnp.maximum(jnp.sum(jnp.any(mask_bt, axis=1)), 1)
        return jnp.sum(x_bt) / (rows * x_bt.shape[1])
    raise ValueError(f"unknown normaliser {normaliser!r}; expected one of {NORMALISERS}")


def kl_penalty(
    logprobs_bt: jax.Array, ref_logprobs_bt: jax.Array, estimator: str = "k3"
) -> jax.Array:
    """Per-token estimators of KL(pi || pi_ref) from y ~ pi, with log r = log pi_ref - log pi:

        k1 = -log r                      (unbiased, high variance, can be negative)
        k3 = (r - 1) - log r             (unbiased, >= 0, low variance; GRPO's choice)

    As loss terms their gradients wrt log pi are 1 (k1) and 1 - r (k3). Tokens sampled from a
    lagging behaviour policy mu make both slightly biased; the bias shrinks with the lag.
    """
    log_r_bt = ref_logprobs_bt - logprobs_bt
    if estimator == "k1":
        return -log_r_bt
    if estimator == "k3":
        return jnp.expm1(log_r_bt) - log_r_bt
    raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {KL_ESTIMATORS}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PolicyLoss:
    """Shared normalisation, KL and entropy terms; subclasses define the per-token policy term.

    `advantage` (a class attribute) names the group-advantage estimator the objective is defined
    with (`jaxrl.rl.make_advantage_estimator`); `LossConfig` uses it unless told otherwise.
    """

    advantage: ClassVar[str] = "group_mean"
    normaliser: str = "tokens"
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0

    def __post_init__(self):
        if self.normaliser not in NORMALISERS:
            raise ValueError(f"normaliser must be one of {NORMALISERS}, got {self.normaliser!r}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(
                f"kl_estimator must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}"
            )
        for name in ("kl_coef", "entropy_coef"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be finite and >= 0, got {value}")

    def policy_term(
        self, logprobs_bt: jax.Array, log_ratio_bt: jax.Array, advantages_bt: jax.Array
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Per-token policy loss l_bt and per-token metrics (reported as token means).

        Inputs are already 0 at masked positions; `advantages_bt` is A_b broadcast over t.
        """
        raise NotImplementedError

    def __call__(self, inputs: PolicyLossInputs) -> tuple[jax.Array, dict[str, jax.Array]]:
        """`(loss, metrics)`; differentiate wrt whatever produced `inputs.logprobs_bt`."""
        mask_bt = inputs.mask_bt.astype(bool)
        logprobs_bt = jnp.where(mask_bt, inputs.logprobs_bt, 0.0)
        behaviour_bt = jnp.where(mask_bt, inputs.behaviour_logprobs_bt, 0.0)
        log_ratio_bt = logprobs_bt - behaviour_bt
        advantages_bt = jnp.broadcast_to(inputs.advantages_b[:, None], mask_bt.shape)
        policy_bt, token_metrics = self.policy_term(logprobs_bt, log_ratio_bt, advantages_bt)
        num_tokens = jnp.maximum(jnp.sum(mask_bt), 1)
        metrics = {
            k: jnp.sum(jnp.where(mask_bt, v, 0.0)) / num_tokens for k, v in token_metrics.items()
        }
        total_bt = policy_bt
        metrics["pg_loss"] = normalise(policy_bt, mask_bt, self.normaliser)
        if self.kl_coef > 0:
            if inputs.ref_logprobs_bt is None:
                raise ValueError("kl_coef > 0 needs ref_logprobs_bt (a frozen reference policy)")
            ref_bt = jnp.where(mask_bt, inputs.ref_logprobs_bt, 0.0)
            kl_bt = kl_penalty(logprobs_bt, ref_bt, self.kl_estimator)
            total_bt = total_bt + self.kl_coef * kl_bt
            metrics["kl"] = normalise(kl_bt, mask_bt, self.normaliser)
        if self.entropy_coef > 0:
            if inputs.entropy_bt is None:
                raise ValueError("entropy_coef > 0 needs entropy_bt (token_logprobs_and_entropy)")
            total_bt = total_bt - self.entropy_coef * inputs.entropy_bt
            metrics["entropy"] = normalise(inputs.entropy_bt, mask_bt, self.normaliser)
        loss = normalise(total_bt, mask_bt, self.normaliser)
        ratio_bt = jnp.exp(log_ratio_bt)
        # KL(behaviour || policy) per token, k3 on the behaviour's samples: staleness, and any
        # generator / trainer mismatch (numerics, routing) on top of it.
        behaviour_kl_bt = kl_penalty(behaviour_bt, logprobs_bt, "k3")
        metrics |= {
            "loss": loss,
            "num_tokens": jnp.sum(mask_bt),
            "ratio_mean": jnp.sum(jnp.where(mask_bt, ratio_bt, 0.0)) / num_tokens,
            "ratio_max": jnp.max(jnp.where(mask_bt, ratio_bt, 0.0)),
            # On-policy (sync, fp32) this must be ~0: a sampler / trainer mismatch shows here.
            "abs_log_ratio_max": jnp.max(jnp.abs(log_ratio_bt)),
            "behaviour_kl": jnp.sum(jnp.where(mask_bt, behaviour_kl_bt, 0.0)) / num_tokens,
        }
        return loss, jax.lax.stop_gradient(metrics)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AIPOLoss(PolicyLoss):
    """Asynchronous Importance-weighted Policy Optimisation (LlamaRL), per token:

        ratio_t = exp(log pi(y_t) - log mu(y_t))
        l_t     = - stop_gradient(min(ratio_t, rho)) * A * log pi(y_t)
        grad l_t = - min(ratio_t, rho) * A * grad log pi(y_t)

    The weight is truncated on one side only and never clipped to zero: tokens with ratio > rho
    still move with weight rho. (Writing `-min(ratio, rho) * A` without the log zeroes their
    gradient and turns AIPO into a one-sided PPO clip.) The loss value itself is not a meaningful
    objective; only its gradient is.

    Default normaliser: "tokens" (divide by the number of completion tokens in the batch). Every
    sampled token then carries the same weight whatever the length of its completion, matching
    AIPO's per-token importance weights; the per-sequence mean instead gives each token of a
    short completion more weight, which under negative advantages penalises long wrong answers
    less per token (the length bias pointed out by DAPO / Dr. GRPO). Use "sequence_mean" to get
    GRPO's 1/|y| weighting.

    Settings (the "aipo" preset, LlamaRL arXiv:2505.24034): rho = 4, normaliser "tokens",
    advantage "group_mean" (A_i = r_i - mean(r_group), no std scaling).

    Attributes:
      rho: truncation level, >= 1 (LlamaRL uses values in [2, 10]); the DESIGN default is 4.
    """

    rho: float = 4.0
    advantage: ClassVar[str] = "group_mean"

    def __post_init__(self):
        super().__post_init__()
        if not (math.isfinite(self.rho) and self.rho >= 1.0):
            raise ValueError(
                f"AIPO rho must be finite and >= 1 (a weight cap below 1 would down-weight "
                f"on-policy tokens); got {self.rho}"
            )

    def policy_term(self, logprobs_bt, log_ratio_bt, advantages_bt):
        ratio_bt = jnp.exp(log_ratio_bt)
        weight_bt = jax.lax.stop_gradient(jnp.minimum(ratio_bt, self.rho))
        loss_bt = -weight_bt * advantages_bt * logprobs_bt
        return loss_bt, {"truncated_fraction": (ratio_bt > self.rho).astype(jnp.float32)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class PPOClipLoss(PolicyLoss):
    """PPO's clipped surrogate, per token, with the old (behaviour) log-probs:

        ratio_t = exp(log pi(y_t) - log pi_old(y_t))
        l_t     = - min(ratio_t * A, clip(ratio_t, 1 - eps_low, 1 + eps_high) * A)

    Its gradient is -ratio_t * A * grad log pi(y_t) where the unclipped term is the smaller one
    and 0 where the clip is active (ratio beyond 1 + eps_high with A > 0, below 1 - eps_low with
    A < 0). Registered as "ppo_clip" with the "tokens" normaliser and group-mean advantages; the
    GRPO, Dr. GRPO and DAPO presets below are this loss with their own settings.

    Attributes:
      clip_eps: eps_low, in (0, 1).
      clip_eps_high: eps_high > 0; None means eps_low (a larger value is DAPO's "clip higher").
    """

    clip_eps: float = 0.2
    clip_eps_high: float | None = None

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 < self.clip_eps < 1.0:
            raise ValueError(f"clip_eps must be in (0, 1), got {self.clip_eps}")
        if self.clip_eps_high is not None and not (
            math.isfinite(self.clip_eps_high) and self.clip_eps_high > 0
        ):
            raise ValueError(f"clip_eps_high must be finite and > 0, got {self.clip_eps_high}")

    def policy_term(self, logprobs_bt, log_ratio_bt, advantages_bt):
        eps_high = self.clip_eps if self.clip_eps_high is None else self.clip_eps_high
        ratio_bt = jnp.exp(log_ratio_bt)
        unclipped_bt = ratio_bt * advantages_bt
        clipped_bt = jnp.clip(ratio_bt, 1.0 - self.clip_eps, 1.0 + eps_high) * advantages_bt
        loss_bt = -jnp.minimum(unclipped_bt, clipped_bt)
        return loss_bt, {"clip_fraction": (clipped_bt < unclipped_bt).astype(jnp.float32)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class GRPOLoss(PPOClipLoss):
    """GRPO (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300, eq. 3), as published:

        A_i  = (r_i - mean(r_group)) / (std(r_group) + eps)      advantage "group_mean_std"
        loss = (1 / G) sum_i (1 / |o_i|) sum_t -min(ratio A_i, clip(ratio, 0.8, 1.2) A_i)

    Settings: clip_eps = 0.2 (eps_high = eps_low), normaliser "sequence_mean" (the mean over
    sequences of each sequence's token mean), advantage "group_mean_std" (population std,
    eps = 1e-6). The paper's KL term is `kl_coef` with the k3 estimator (off by default, as in
    most recent recipes). Every setting can be overridden by keyword.
    """

    normaliser: str = "sequence_mean"
    advantage: ClassVar[str] = "group_mean_std"


@dataclasses.dataclass(frozen=True, kw_only=True)
class DrGRPOLoss(PPOClipLoss):
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv:2503.20783): GRPO
    without its two biases, the 1/|o_i| length normalisation and the std scaling:

        A_i  = r_i - mean(r_group)                                advantage "group_mean"
        loss = (1 / (G * T)) sum_i sum_t -min(ratio A_i, clip(ratio, 0.8, 1.2) A_i)

    where T is a constant, the generation budget (the batch's padded completion length,
    `max_new_tokens`), as in the paper's code and TRL's `loss_type="dr_grpo"`. Settings:
    clip_eps = 0.2, normaliser "constant", advantage "group_mean".
    """

    normaliser: str = "constant"
    advantage: ClassVar[str] = "group_mean"


@dataclasses.dataclass(frozen=True, kw_only=True)
class DAPOLoss(PPOClipLoss):
    """DAPO (Yu et al. 2025, arXiv:2503.14476, eq. 8): token-level policy gradient with
    "clip higher":

        A_i  = (r_i - mean(r_group)) / (std(r_group) + eps)      advantage "group_mean_std"
        loss = (1 / sum_i |o_i|) sum_i sum_t -min(ratio A_i, clip(ratio, 1 - 0.2, 1 + 0.28) A_i)

    Settings: clip_eps = 0.2 (eps_low), clip_eps_high = 0.28, normaliser "tokens", advantage
    "group_mean_std", no KL. DAPO's dynamic sampling is `RLConfig.oversample`; its overlong
    reward shaping is a reward (not part of the loss).
    """

    clip_eps_high: float | None = 0.28
    normaliser: str = "tokens"
    advantage: ClassVar[str] = "group_mean_std"


LOSSES: dict[str, Callable[..., PolicyLoss]] = {
    "aipo": AIPOLoss,
    "ppo_clip": PPOClipLoss,
    "grpo": GRPOLoss,
    "dr_grpo": DrGRPOLoss,
    "dapo": DAPOLoss,
}


def make_loss(name: str, **hparams) -> PolicyLoss:
    """Build a registered loss by name, e.g. `make_loss("aipo", rho=4.0, kl_coef=0.01)`."""
    if name not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; registered: {sorted(LOSSES)}")
    try:
        return LOSSES[name](**hparams)
    except TypeError as e:
        raise TypeError(f"bad hyper-parameters for loss {name!r}: {e}") from e

"""Group-baseline advantages: n samples per prompt share a baseline computed from their rewards.

For a row i in group g (the valid rows with the same group id), with n_g rows, rewards r_j,

    mean_g  = (1 / n_g) sum_{j in g} r_j
    std_g   = sqrt((1 / n_g) sum_{j in g} (r_j - mean_g)^2)        (population std, ddof = 0)

    baseline "mean":           A_i = r_i - mean_g
    baseline "leave_one_out":  A_i = r_i - (1 / (n_g - 1)) sum_{j in g, j != i} r_j
                                   = n_g / (n_g - 1) * (r_i - mean_g)     (0 when n_g = 1)
    scale_by_std:              A_i <- A_i / (std_g + eps)

The leave-one-out baseline does not depend on r_i, so the policy-gradient estimate stays unbiased
(RLOO); the plain mean is biased by a factor (n_g - 1) / n_g but is what GRPO uses. Dividing by the
std (GRPO) makes the step size independent of the reward scale, at the price of up-weighting groups
whose rewards barely differ. Groups whose rewards are all equal get A = 0 in every variant.

Group ids are arbitrary integers (e.g. global prompt indices): groups are found with a [B, B]
equality mask, which is cheap for RL batch sizes (a few thousand rows at most) and needs no
re-numbering. Invalid rows (`valid_b` False) are ignored and get A = 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

BASELINES = ("mean", "leave_one_out")


def group_advantages(
    reward_b: jax.Array,
    group_id_b: jax.Array,
    *,
    valid_b: jax.Array | None = None,
    baseline: str = "mean",
    scale_by_std: bool = False,
    eps: float = 1e-6,
) -> jax.Array:
    """Per-sample advantages `[B]` fp32 from rewards and group ids `[B]` (see module docstring)."""
    if baseline not in BASELINES:
        raise ValueError(f"unknown baseline {baseline!r}; expected one of {BASELINES}")
    reward_b = reward_b.astype(jnp.float32)
    if valid_b is None:
        valid_b = jnp.ones(reward_b.shape, bool)
    same_bb = (
        (group_id_b[:, None] == group_id_b[None, :]) & valid_b[:, None] & valid_b[None, :]
    ).astype(jnp.float32)
    count_b = jnp.sum(same_bb, axis=1)
    safe_count_b = jnp.maximum(count_b, 1.0)
    mean_b = (same_bb @ reward_b) / safe_count_b
    centred_b = reward_b - mean_b
    if baseline == "leave_one_out":
        advantage_b = jnp.where(count_b > 1, centred_b * count_b / jnp.maximum(count_b - 1, 1), 0.0)
    else:
        advantage_b = centred_b
    if scale_by_std:
        # Deviations of every group member from row i's group mean: exact, no E[r^2] - E[r]^2.
        sq_dev_bb = (reward_b[None, :] - mean_b[:, None]) ** 2
        std_b = jnp.sqrt(jnp.sum(same_bb * sq_dev_bb, axis=1) / safe_count_b)
        advantage_b = advantage_b / (std_b + eps)
    return jnp.where(valid_b, advantage_b, 0.0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupAdvantage:
    """A configured group-baseline estimator: `__call__(reward_b, group_id_b, valid_b) -> A_b`."""

    baseline: str = "mean"
    scale_by_std: bool = False
    eps: float = 1e-6

    def __post_init__(self):
        if self.baseline not in BASELINES:
            raise ValueError(f"unknown baseline {self.baseline!r}; expected one of {BASELINES}")
        if not self.eps > 0:
            raise ValueError(
                f"eps must be > 0 (it guards groups with equal rewards); got {self.eps}"
            )

    def __call__(
        self, reward_b: jax.Array, group_id_b: jax.Array, valid_b: jax.Array | None = None
    ) -> jax.Array:
        return group_advantages(
            reward_b,
            group_id_b,
            valid_b=valid_b,
            baseline=self.baseline,
            scale_by_std=self.scale_by_std,
            eps=self.eps,
        )


ADVANTAGE_ESTIMATORS: dict[str, Callable[..., GroupAdvantage]] = {
    # A = r - mean_g (Dr. GRPO; the AIPO default).
    "group_mean": lambda **kw: GroupAdvantage(baseline="mean", **kw),
    # A = (r - mean_g) / (std_g + eps) (GRPO).
    "group_mean_std": lambda **kw: GroupAdvantage(baseline="mean", scale_by_std=True, **kw),
    # A = r - mean of the other samples of the group (RLOO).
    "leave_one_out": lambda **kw: GroupAdvantage(baseline="leave_one_out", **kw),
}


def make_advantage_estimator(name: str, **hparams) -> GroupAdvantage:
    """Build a registered estimator by name; unknown names or hyper-parameters raise."""
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(
            f"unknown advantage estimator {name!r}; registered: {sorted(ADVANTAGE_ESTIMATORS)}"
        )
    try:
        return ADVANTAGE_ESTIMATORS[name](**hparams)
    except TypeError as e:
        raise TypeError(f"bad hyper-parameters for advantage estimator {name!r}: {e}") from e

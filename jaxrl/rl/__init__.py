"""RL algorithm core: rollout records, group advantages, policy losses, per-token log-probs."""

from jaxrl.rl.advantages import (
    ADVANTAGE_ESTIMATORS,
    GroupAdvantage,
    group_advantages,
    make_advantage_estimator,
)
from jaxrl.rl.logprobs import logprobs_from_logits, token_logprobs, token_logprobs_and_entropy
from jaxrl.rl.losses import (
    LOSSES,
    AIPOLoss,
    DAPOLoss,
    DrGRPOLoss,
    GRPOLoss,
    PolicyLoss,
    PolicyLossInputs,
    PPOClipLoss,
    kl_penalty,
    make_loss,
    normalise,
)
from jaxrl.rl.rollout import (
    Rollout,
    RolloutBatch,
    collate_rollouts,
    rollouts_from_samples,
    select_groups,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "LOSSES",
    "AIPOLoss",
    "DAPOLoss",
    "DrGRPOLoss",
    "GRPOLoss",
    "GroupAdvantage",
    "PPOClipLoss",
    "PolicyLoss",
    "PolicyLossInputs",
    "Rollout",
    "RolloutBatch",
    "collate_rollouts",
    "group_advantages",
    "kl_penalty",
    "logprobs_from_logits",
    "make_advantage_estimator",
    "make_loss",
    "normalise",
    "rollouts_from_samples",
    "select_groups",
    "token_logprobs",
    "token_logprobs_and_entropy",
]

"""The loss "pg_no_is": policy gradient that ignores the behaviour policy, the control of the
experiments that ask what the importance correction buys (rl-async, rl-streaming). Importing
this module registers it."""

from __future__ import annotations

import dataclasses

from jaxrl.rl.losses import LOSSES, PolicyLoss


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlainPGLoss(PolicyLoss):
    """Policy gradient that ignores the behaviour policy: l_t = -A * log pi(y_t), i.e. AIPO with
    the importance weight min(pi/mu, rho) replaced by 1."""

    def policy_term(self, logprobs_bt, log_ratio_bt, advantages_bt):
        return -advantages_bt * logprobs_bt, {}


# LossConfig passes clip_eps to every non-AIPO loss; this one has no hyper-parameter of its own.
LOSSES.setdefault("pg_no_is", lambda clip_eps=None, **kw: PlainPGLoss(**kw))
# A config that binds AIPO's rho must unbind it for this loss (a config error otherwise).
OVERRIDES = ["LossConfig.name = 'pg_no_is'", "LossConfig.rho = None"]

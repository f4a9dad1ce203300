"""What the trainer's optimizer loop carries and how one update moves it: the optimizer's
config (`OptimizerConfig`, AdamW with a schedule), the train state (`TrainState`, a plain pytree
checkpointed as is), float32 master weights for low-precision params (docs/precision.md) and
`apply_gradients`. `jaxrl.train.trainer` re-exports `OptimizerConfig` and `TrainState`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import struct

Params = dict  # nested dict of arrays, as nnx.to_pure_dict returns


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW (optax.adamw) with optional global-norm clipping and a warm-up + decay schedule.

    Per parameter p with gradient g (after clipping), step t >= 1, learning rate lr_t:

        m = b1 m + (1 - b1) g,   v = b2 v + (1 - b2) g^2
        p <- p - lr_t * ( (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) + weight_decay * p )

    max_grad_norm: clip the gradients' global L2 norm to this value first; None = no clipping
      (and no norm pass in the optimizer: the update is plain AdamW).
    schedule: "constant" (after warm-up), "linear" or "cosine" decay to `end_learning_rate` at
      `decay_steps` (default: the run's total steps). An SFT warm start should decay to zero: a
      checkpoint cut off at full learning rate "improves" under any further low-rate training.
    grad_accum_steps: micro-batches per optimizer step (the batch is split along its rows).
    """

    learning_rate: float = 1e-3
    warmup_steps: int = 0
    schedule: str = "constant"
    decay_steps: int = 0
    end_learning_rate: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0
    grad_accum_steps: int = 1

    def validate(self) -> None:
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate={self.learning_rate} must be > 0")
        if self.schedule not in ("constant", "linear", "cosine"):
            raise ValueError(f"schedule={self.schedule!r}; use constant, linear or cosine")
        if self.warmup_steps < 0 or self.decay_steps < 0:
            raise ValueError("warmup_steps and decay_steps must be >= 0")
        if self.grad_accum_steps < 1:
            raise ValueError(f"grad_accum_steps={self.grad_accum_steps} must be >= 1")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(
                f"max_grad_norm={self.max_grad_norm} must be > 0; use None for no clipping"
            )
        for name in ("b1", "b2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name}={getattr(self, name)} must be in [0, 1)")
        if not self.eps > 0 or self.weight_decay < 0:
            raise ValueError(f"eps={self.eps} must be > 0, weight_decay={self.weight_decay} >= 0")

    def __post_init__(self):
        self.validate()

    def schedule_fn(self, total_steps: int) -> optax.Schedule:
        decay = self.decay_steps or total_steps
        warm = min(self.warmup_steps, decay)
        if self.schedule == "constant":
            main = optax.constant_schedule(self.learning_rate)
        elif self.schedule == "linear":
            main = optax.linear_schedule(
                self.learning_rate, self.end_learning_rate, max(decay - warm, 1)
            )
        else:
            alpha = self.end_learning_rate / self.learning_rate
            main = optax.cosine_decay_schedule(self.learning_rate, max(decay - warm, 1), alpha)
        if warm == 0:
            return main
        ramp = optax.linear_schedule(0.0, self.learning_rate, warm)
        return optax.join_schedules([ramp, main], [warm])

    def make(self, total_steps: int) -> optax.GradientTransformation:
        """The optax transformation for a run of `total_steps` optimizer steps."""
        adamw = optax.adamw(
            self.schedule_fn(total_steps),
            b1=self.b1,
            b2=self.b2,
            eps=self.eps,
            weight_decay=self.weight_decay,
        )
        if self.max_grad_norm is None:
            return adamw
        return optax.chain(optax.clip_by_global_norm(self.max_grad_norm), adamw)


@struct.dataclass
class TrainState:
    """Everything the optimizer loop carries: a plain pytree (checkpointed as is)."""

    step: jax.Array  # int32 scalar: optimizer updates applied
    params: Params
    opt_state: Any


def init_state(params: Params, optimizer: optax.GradientTransformation) -> TrainState:
    return TrainState(
        step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params)
    )


# --- mixed precision (docs/precision.md) ---------------------------------------------------------


class MasterWeightsState(NamedTuple):
    """The optimizer state of `with_master_weights`: float32 copies of the params (`master`, the
    params' tree and shapes, so they take the params' shardings) and the wrapped transformation's
    state, built on the master copies (Adam's moments in float32)."""

    master: Params
    inner: Any


def with_master_weights(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """`tx` run on float32 master weights of low-precision (bf16 / fp16) params.

    Per parameter, with master w (float32) and gradient g (any float dtype):

        init:    w = float32(p);  inner = tx.init(w)
        update:  u, inner = tx.update(float32(g), inner, w);  w <- w + u   (float32 add)

    The trainer then sets p = cast(w, p.dtype) (`apply_gradients`): an update smaller than half a
    bf16 ulp of p (|u| < 2^-9 |p|) still accumulates in w and reaches p once the sum crosses a
    rounding boundary, where `p + u` in bf16 would drop it every step. The returned updates are
    the float32 `u` (for metrics); applying them to p is not how p moves.
    """

    def init(params):
        master = jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), params)
        return MasterWeightsState(master=master, inner=tx.init(master))

    def update(grads, state, params=None):
        del params
        grads = jax.tree.map(lambda g: jnp.asarray(g, jnp.float32), grads)
        updates, inner = tx.update(grads, state.inner, state.master)
        master = optax.apply_updates(state.master, updates)
        return updates, MasterWeightsState(master=master, inner=inner)

    return optax.GradientTransformation(init, update)


def needs_master_weights(params: Any) -> bool:
    """Whether any floating-point param is stored below float32 (bf16, fp16)."""
    return any(
        jnp.issubdtype(x.dtype, jnp.floating) and jnp.finfo(x.dtype).bits < 32
        for x in jax.tree.leaves(params)
    )


def apply_gradients(state: TrainState, grads, optimizer) -> tuple[TrainState, dict]:
    """One optimizer update of `state` with `grads`: the params move by the update, or (master
    weights) become the cast of the updated float32 masters; the step counts up by one."""
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    if isinstance(opt_state, MasterWeightsState):  # the params are the master weights, cast
        params = jax.tree.map(lambda w, p: w.astype(p.dtype), opt_state.master, state.params)
    else:
        params = optax.apply_updates(state.params, updates)
    new = TrainState(step=state.step + 1, params=params, opt_state=opt_state)
    return new, {"grad_norm": optax.tree.norm(grads), "update_norm": optax.tree.norm(updates)}

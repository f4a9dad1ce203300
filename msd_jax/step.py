"""The jitted, sharded KD / MSD train step.

    state, metrics = train_step(state, batch, targets)              # kd, kd_aug, msd
    state, metrics = train_step(state, batch, targets, val_batch)   # msd with learned weights

- `state` (`TrainState`, donated): step, student params, optimizer state, weighting state.
- `batch` (`MultimodalBatch`): split over the mesh's batch axes (the `act_batch` rule).
- `targets` (`TeacherTargets`): the frozen teacher's logits on the three views, `[B, 3, C]`,
  computed once per sample by `make_teacher_fn` (one batched forward) and cached by the caller,
  plus, for the "instance" weighting, cross-fitted saliency `[B, 2]` (`msd_jax.saliency`).
- `val_batch`: a validation batch for the learned weighting's look-ahead update.

Objectives: "kd" (student on the full input only: `losses.kd_loss`), "msd" (student on the three
views in one batched forward: `losses.msd_loss` with the scheme's weights) and "kd_aug" (the same
views with full-input teacher targets). For the learned scheme the step first updates phi by
`weighting.meta_update`, then the student with the new weights.

Shardings: params by their logical names through the rules table (`models.DATA_PARALLEL_RULES`,
or `models.FSDP_RULES`), optimizer moments like their params, step and weighting state
replicated, batch / targets split along the batch, metrics replicated. The step is traced under
`sharding_context(mesh, rules)` so the models' activation constraints apply.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding

from jaxrl.infra import sharding as ax
from msd_jax.losses import DistillationLoss, cross_entropy, kd_aug_targets, kd_loss, msd_loss
from msd_jax.models import MultimodalModel
from msd_jax.views import MultimodalBatch
from msd_jax.weighting import Weighting, WeightingState, meta_update

OBJECTIVES = ("kd", "kd_aug", "msd")


@struct.dataclass
class TrainState:
    """Everything a step reads and writes.

    Attributes:
      step: int32 scalar, steps taken.
      params: the student's nnx.State (Params only).
      opt_state: the optax state of `params`.
      weighting: the weighting scheme's state (phi and its optimizer state for "learned").
    """

    step: jax.Array
    params: nnx.State
    opt_state: Any
    weighting: WeightingState


@struct.dataclass
class TeacherTargets:
    """Per-sample teacher outputs the step consumes (batch-major like the batch).

    Attributes:
      logits_bvc: `[B, 3, C]` frozen-teacher logits on the views (full, text, image).
      saliency_bm: `[B, 2]` cross-fitted saliency (text, image); only "instance" needs it.
    """

    logits_bvc: jax.Array
    saliency_bm: jax.Array | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepConfig:
    """What the step optimises.

    Attributes:
      objective: "kd", "kd_aug" or "msd".
      loss: temperature and alpha (`losses.DistillationLoss`).
    """

    objective: str = "msd"
    loss: DistillationLoss = DistillationLoss()

    def __post_init__(self):
        if self.objective not in OBJECTIVES:
            raise ValueError(
                f"StepConfig.objective must be one of {OBJECTIVES}, got {self.objective!r}"
            )


@dataclasses.dataclass(frozen=True)
class ShardedFunction:
    """A jitted function traced and run under its mesh and rules (for `constrain`)."""

    jitted: Any
    mesh: Mesh
    rules: ax.LogicalRules

    def __call__(self, *args):
        with ax.sharding_context(self.mesh, self.rules):
            return self.jitted(*args)

    def lower(self, *args):
        """`jax.jit(...).lower` under the context; `.compile()` it to time compilation alone."""
        with ax.sharding_context(self.mesh, self.rules):
            return self.jitted.lower(*args)


def batch_sharding(mesh: Mesh, rules: ax.LogicalRules) -> NamedSharding:
    """Splits a leading batch axis as the `act_batch` rule says (a prefix for whole pytrees)."""
    return NamedSharding(mesh, ax.logical_to_pspec((ax.ACT_BATCH,), rules))


def init_student(
    model_fn: Callable[[], MultimodalModel], mesh: Mesh, rules: ax.LogicalRules
) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """A model's (graphdef, params, params_shardings), params born on their devices.

    `model_fn` builds the model, e.g. `lambda: build_model(cfg, rngs=nnx.Rngs(seed))`.
    """
    graphdef, params, shardings = ax.init_sharded(model_fn, mesh, rules)
    if jax.tree.leaves(nnx.filter_state(params, nnx.Not(nnx.Param))):
        raise ValueError("msd models must hold only nnx.Params (no RNG or batch-stat state)")
    return graphdef, params, shardings


def init_train_state(
    params: nnx.State,
    optimizer: optax.GradientTransformation,
    weighting: Weighting | None,
    mesh: Mesh,
    rules: ax.LogicalRules,
    key: jax.Array,
) -> tuple[TrainState, TrainState]:
    """The initial state on `mesh` and its shardings: (state, state_shardings).

    `params` (from `init_student`, a checkpoint, or another mesh) are moved to the layout the
    rules give them (a no-op when already there); the optimizer state is born sharded like them;
    the step and the weighting state are replicated. The state may share buffers with `params`,
    and the train step donates it: pass a copy if you need `params` afterwards.
    """
    params_sh = ax.param_shardings(params, mesh, rules)
    params = jax.device_put(params, params_sh)
    opt_sh = ax.opt_state_shardings(jax.eval_shape(optimizer.init, params), params, params_sh, mesh)
    opt_state = jax.jit(optimizer.init, out_shardings=opt_sh)(params)
    replicated = ax.replicated(mesh)
    w_state = WeightingState() if weighting is None else weighting.init(key)
    w_state = jax.device_put(w_state, replicated)
    shardings = TrainState(
        step=replicated,
        params=params_sh,
        opt_state=opt_sh,
        weighting=jax.tree.map(lambda _: replicated, w_state),
    )
    state = TrainState(
        step=jax.device_put(jnp.zeros((), jnp.int32), replicated),
        params=params,
        opt_state=opt_state,
        weighting=w_state,
    )
    return state, shardings


def student_loss(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    batch: MultimodalBatch,
    teacher_logits_bvc: jax.Array,
    weights_bm: jax.Array | None,
    config: StepConfig,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The objective's (loss, metrics) for student `params`; differentiable in params and w_bm."""
    model = nnx.merge(graphdef, params)
    if config.objective == "kd":
        logits_bc = model(batch)
        return kd_loss(logits_bc, teacher_logits_bvc[:, 0], batch.label_b, config.loss)
    if config.objective == "kd_aug":
        teacher_logits_bvc = kd_aug_targets(teacher_logits_bvc)
    logits_bvc = model.view_logits(batch)
    return msd_loss(logits_bvc, teacher_logits_bvc, batch.label_b, weights_bm, config.loss)


def make_train_step(
    graphdef: nnx.GraphDef,
    optimizer: optax.GradientTransformation,
    weighting: Weighting | None,
    config: StepConfig,
    mesh: Mesh,
    rules: ax.LogicalRules,
    state_shardings: TrainState,
) -> ShardedFunction:
    """The jitted step `(state, batch, targets[, val_batch]) -> (state, metrics)`, state donated.

    `val_batch` is an argument only when `weighting.learned`.
    """
    if config.objective != "kd" and weighting is None:
        raise ValueError(f"objective {config.objective!r} needs a weighting scheme")
    if config.objective == "kd" and weighting is not None and weighting.learned:
        raise ValueError("objective 'kd' has no auxiliary terms to learn weights for")
    learned = config.objective != "kd" and weighting.learned

    def train_step(state: TrainState, batch, targets: TeacherTargets, val_batch=None):
        teacher_bvc = targets.logits_bvc
        w_state, metrics = state.weighting, {}
        if learned:

            def train_loss(params, w_bm):
                return student_loss(graphdef, params, batch, teacher_bvc, w_bm, config)[0]

            def val_loss(params):
                logits_bc = nnx.merge(graphdef, params)(val_batch)
                return jnp.mean(cross_entropy(logits_bc, val_batch.label_b))

            w_state, metrics = meta_update(
                weighting,
                w_state,
                state.params,
                train_loss,
                val_loss,
                teacher_bvc,
                targets.saliency_bm,
            )
        weights_bm = None
        if config.objective != "kd":
            weights_bm = weighting.weights(w_state.params, teacher_bvc, targets.saliency_bm)
            weights_bm = jax.lax.stop_gradient(weights_bm)
        grad_fn = jax.value_and_grad(student_loss, argnums=1, has_aux=True)
        (_, loss_metrics), grads = grad_fn(
            graphdef, state.params, batch, teacher_bvc, weights_bm, config
        )
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = metrics | loss_metrics | {"optim/grad_norm": optax.tree.norm(grads)}
        new_state = TrainState(
            step=state.step + 1, params=params, opt_state=opt_state, weighting=w_state
        )
        return new_state, metrics

    data = batch_sharding(mesh, rules)
    in_shardings = (state_shardings, data, data) + ((data,) if learned else ())
    fn = (
        train_step if learned else (lambda state, batch, targets: train_step(state, batch, targets))
    )
    jitted = jax.jit(
        fn,
        in_shardings=in_shardings,
        out_shardings=(state_shardings, ax.replicated(mesh)),
        donate_argnums=0,
    )
    return ShardedFunction(jitted, mesh, rules)


def make_teacher_fn(
    graphdef: nnx.GraphDef, mesh: Mesh, rules: ax.LogicalRules, params_shardings: nnx.State
) -> ShardedFunction:
    """Jitted `(teacher_params, batch) -> logits_bvc [B, 3, C]`: all views, one forward pass.

    The teacher is frozen, so a run computes this once per training sample and caches it.
    """

    def teacher_logits(params: nnx.State, batch: MultimodalBatch) -> jax.Array:
        return nnx.merge(graphdef, params).view_logits(batch)

    data = batch_sharding(mesh, rules)
    jitted = jax.jit(teacher_logits, in_shardings=(params_shardings, data), out_shardings=data)
    return ShardedFunction(jitted, mesh, rules)

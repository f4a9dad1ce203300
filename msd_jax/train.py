"""One training run of an MSD experiment (a teacher or a student), checkpointed and resumable.

    model = CompiledModel(spec.model_config(train_split), mesh, rules)
    state, state_shardings = model.init_state(seed, optimizer, scheme)
    train_step = step.make_train_step(model.graphdef, optimizer, scheme, ..., state_shardings)
    state = run_training(run_dir, config, state, train_step, step_inputs, desc="kd/seed_0")

`run_training` is the loop; its plumbing is `jaxrl.infra.run_io.RunIO`, shared with SFT and RL:
Orbax checkpoints in `RUN_DIR/checkpoints` (atomic; resumed from the newest finished step),
metrics in `RUN_DIR/metrics.jsonl`, a progress bar or log lines, NaN checks, the graceful stop,
and the fault hooks of `jaxrl.infra.faults` (`JAXRL_FAULT=kill_at_step=N | kill_in_save=N`).
Resuming is exact: the batch of step s is a pure function of (seed, s) (`data.batch_indices`),
so a run killed and resumed ends with the same bits as one that never stopped.

The teacher's objective (`make_supervised_step`) is cross-entropy on the full input plus, with
weight `unimodal_weight`, on the text-only and image-only views, so that its unimodal
predictions (the targets of MSD's auxiliary terms, and the saliency) are in-distribution:

    L_teacher = mean_b [CE(y_b, z(x_b)) + u (CE(y_b, z(x_b^text)) + CE(y_b, z(x_b^image)))]
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxrl.infra import preemption
from jaxrl.infra import sharding as ax
from jaxrl.infra.run_io import RunIO
from msd_jax import models
from msd_jax.data import REGIMES, MultimodalDataset
from msd_jax.losses import accuracy, cross_entropy
from msd_jax.step import ShardedFunction, TrainState, batch_sharding, make_teacher_fn
from msd_jax.views import VIEWS
from msd_jax.weighting import Weighting, WeightingState

LOSS = "loss/total"  # the metric checked for NaN / Inf
MODEL_KINDS = ("mlp", "transformer")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A model without its data-dependent sizes (those come from the dataset).

    Attributes:
      kind: "mlp" (`models.MLPConfig`) or "transformer" (`models.TransformerConfig`).
      mlp_hidden_sizes, text_embed_size: the MLP's hidden widths and text embedding size.
      size: the transformer's named size (`models.TRANSFORMER_SIZES`).
      hidden_size, num_layers, num_heads, mlp_size: transformer overrides of that size (0: keep).
    """

    kind: str = "mlp"
    mlp_hidden_sizes: tuple[int, ...] = (128,)
    text_embed_size: int = 32
    size: str = "student"
    hidden_size: int = 0
    num_layers: int = 0
    num_heads: int = 0
    mlp_size: int = 0

    def validate(self) -> None:
        if self.kind not in MODEL_KINDS:
            raise ValueError(f"kind={self.kind!r}; expected one of {MODEL_KINDS}")
        if self.kind == "transformer" and self.size not in models.TRANSFORMER_SIZES:
            raise ValueError(f"size={self.size!r}; known: {sorted(models.TRANSFORMER_SIZES)}")

    def summary(self) -> str:
        """A short description, e.g. "MLP (512, 512)" or "transformer 'student'"."""
        if self.kind == "mlp":
            return f"MLP {tuple(self.mlp_hidden_sizes)}"
        names = ("hidden_size", "num_layers", "num_heads", "mlp_size")
        overrides = ", ".join(f"{n}={getattr(self, n)}" for n in names if getattr(self, n))
        return f"transformer {self.size!r}" + (f" ({overrides})" if overrides else "")

    def model_config(self, data: MultimodalDataset) -> models.ModelConfig:
        """The model config for batches shaped like `data`."""
        self.validate()
        if self.kind == "mlp":
            return models.MLPConfig(
                num_classes=data.num_classes,
                vocab_size=data.vocab_size,
                max_patches=data.num_patches,
                patch_dim=data.patch_dim,
                text_embed_size=self.text_embed_size,
                hidden_sizes=tuple(self.mlp_hidden_sizes),
            )
        names = ("hidden_size", "num_layers", "num_heads", "mlp_size")
        overrides = {n: getattr(self, n) for n in names if getattr(self, n)}
        return models.transformer_config(
            self.size,
            num_classes=data.num_classes,
            vocab_size=data.vocab_size,
            max_text_len=data.text_len,
            max_patches=data.num_patches,
            patch_dim=data.patch_dim,
            **overrides,
        )


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """How one run trains: AdamW with linear warmup and cosine decay to 0, clipped gradients.

    Attributes:
      steps: optimizer steps of the run.
      batch_size: samples per step (a multiple of the mesh's data-parallel size).
      learning_rate, warmup_steps, weight_decay, max_grad_norm: the optimizer.
      save_every_steps, keep_last_n: checkpoints (the last step is always saved).
      log_every_steps: metrics.jsonl lines (and log lines off a terminal).
    """

    steps: int = 1000
    batch_size: int = 64
    learning_rate: float = 1e-3
    warmup_steps: int = 0
    weight_decay: float = 1e-4
    max_grad_norm: float = 1.0
    save_every_steps: int = 500
    keep_last_n: int = 1
    log_every_steps: int = 50

    def validate(self) -> None:
        for name in ("steps", "batch_size", "save_every_steps", "keep_last_n", "log_every_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError(f"warmup_steps={self.warmup_steps} must lie in [0, steps)")
        for name in ("learning_rate", "max_grad_norm"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(f"{name}={getattr(self, name)} must be finite and > 0")
        if not self.weight_decay >= 0:
            raise ValueError(f"weight_decay={self.weight_decay} must be >= 0")

    def optimizer(self) -> optax.GradientTransformation:
        """The optimizer; one object per config value, so jitted inits built from it are reused."""
        return _optimizer(self)


@functools.cache
def _optimizer(config: TrainConfig) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, config.learning_rate, config.warmup_steps, config.steps, end_value=0.0
    )
    return optax.chain(
        optax.clip_by_global_norm(config.max_grad_norm),
        optax.adamw(schedule, weight_decay=config.weight_decay),
    )


class CompiledModel:
    """A model on a mesh: its jitted init and batched view forward, compiled once and shared by
    every run of that model (the teacher and its fold teachers; every student of a study).

    Attributes:
      config, graphdef, param_shardings, mesh, rules: the model and its layout.
      num_params: its parameter count.
      predict: jitted `(params, batch) -> logits_bvc [B, 3, C]` (`step.make_teacher_fn`).
    """

    def __init__(self, config: models.ModelConfig, mesh, rules: ax.LogicalRules):
        self.config, self.mesh, self.rules = config, mesh, rules
        self._model_fn = lambda key: models.build_model(config, rngs=nnx.Rngs(params=key))
        abstract_model = nnx.eval_shape(lambda: self._model_fn(jax.random.key(0)))
        self.graphdef, self.abstract_params = nnx.split(abstract_model)
        if jax.tree.leaves(nnx.filter_state(self.abstract_params, nnx.Not(nnx.Param))):
            raise ValueError("msd models must hold only nnx.Params (no RNG or batch-stat state)")
        self.param_shardings = ax.param_shardings(self.abstract_params, mesh, rules)
        self.predict = make_teacher_fn(self.graphdef, mesh, rules, self.param_shardings)
        self.num_params = sum(x.size for x in jax.tree.leaves(self.abstract_params))
        self._inits: dict[optax.GradientTransformation, Any] = {}

    def _opt_shardings(self, optimizer: optax.GradientTransformation):
        abstract_opt = jax.eval_shape(optimizer.init, self.abstract_params)
        return ax.opt_state_shardings(
            abstract_opt, self.abstract_params, self.param_shardings, self.mesh
        )

    def _init_fn(self, optimizer: optax.GradientTransformation):
        """One jitted `key -> (params, opt_state)` per optimizer, born with their shardings."""
        if optimizer not in self._inits:

            def init(key):
                params = nnx.split(self._model_fn(key))[1]
                return params, optimizer.init(params)

            out_shardings = (self.param_shardings, self._opt_shardings(optimizer))
            self._inits[optimizer] = jax.jit(init, out_shardings=out_shardings)
        return self._inits[optimizer]

    def state_shardings(
        self, optimizer: optax.GradientTransformation, scheme: Weighting | None
    ) -> TrainState:
        """Shardings of the TrainState: params by the rules, optimizer moments like their
        params, the step and the weighting state replicated."""
        replicated = ax.replicated(self.mesh)
        abstract_w = jax.eval_shape(self._weighting_init(scheme), jax.random.key(0))
        return TrainState(
            step=replicated,
            params=self.param_shardings,
            opt_state=self._opt_shardings(optimizer),
            weighting=jax.tree.map(lambda _: replicated, abstract_w),
        )

    def abstract_state(
        self, optimizer: optax.GradientTransformation, scheme: Weighting | None
    ) -> TrainState:
        """The TrainState as ShapeDtypeStructs with shardings (a restore target); no compute."""
        abstract = TrainState(
            step=jax.ShapeDtypeStruct((), jnp.int32),
            params=self.abstract_params,
            opt_state=jax.eval_shape(optimizer.init, self.abstract_params),
            weighting=jax.eval_shape(self._weighting_init(scheme), jax.random.key(0)),
        )
        return ax.attach_shardings(abstract, self.state_shardings(optimizer, scheme))

    @staticmethod
    def _weighting_init(scheme: Weighting | None):
        return (lambda key: WeightingState()) if scheme is None else scheme.init

    def init_state(
        self, seed: int, optimizer: optax.GradientTransformation, scheme: Weighting | None
    ) -> tuple[TrainState, TrainState]:
        """The initial TrainState of seed `seed` (params from `jax.random.key(seed)`; the
        weighting state from the same key) and its shardings, as `step.init_train_state`."""
        shardings = self.state_shardings(optimizer, scheme)
        key = jax.random.key(seed)
        with ax.sharding_context(self.mesh, self.rules):
            params, opt_state = self._init_fn(optimizer)(key)
        w_state = jax.device_put(self._weighting_init(scheme)(key), shardings.weighting)
        step = jax.device_put(jnp.zeros((), jnp.int32), shardings.step)
        state = TrainState(step=step, params=params, opt_state=opt_state, weighting=w_state)
        return state, shardings


def make_supervised_step(
    graphdef: nnx.GraphDef,
    optimizer: optax.GradientTransformation,
    unimodal_weight: float,
    mesh,
    rules: ax.LogicalRules,
    state_shardings: TrainState,
) -> ShardedFunction:
    """The teacher's jitted step `(state, batch) -> (state, metrics)`, state donated.

    Loss: CE on the full view + `unimodal_weight` x (CE on the text-only + image-only views).
    """
    if not (math.isfinite(unimodal_weight) and unimodal_weight >= 0):
        raise ValueError(f"unimodal_weight={unimodal_weight} must be finite and >= 0")

    def loss_fn(params, batch):
        model = nnx.merge(graphdef, params)
        if unimodal_weight == 0:
            logits_bc = model(batch)
            loss = jnp.mean(cross_entropy(logits_bc, batch.label_b))
            return loss, {"loss/total": loss, "accuracy/full": accuracy(logits_bc, batch.label_b)}
        logits_bvc = model.view_logits(batch)
        ce_bv = cross_entropy(logits_bvc, batch.label_b[:, None])
        loss = jnp.mean(ce_bv[:, 0] + unimodal_weight * jnp.sum(ce_bv[:, 1:], axis=1))
        metrics = {"loss/total": loss}
        for v, name in enumerate(VIEWS):
            metrics[f"loss/ce/{name}"] = jnp.mean(ce_bv[:, v])
            metrics[f"accuracy/{name}"] = accuracy(logits_bvc[:, v], batch.label_b)
        return loss, metrics

    def train_step(state: TrainState, batch):
        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, batch)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = metrics | {"optim/grad_norm": optax.tree.norm(grads)}
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
        return new_state, jax.lax.stop_gradient(metrics)

    jitted = jax.jit(
        train_step,
        in_shardings=(state_shardings, batch_sharding(mesh, rules)),
        out_shardings=(state_shardings, ax.replicated(mesh)),
        donate_argnums=0,
    )
    return ShardedFunction(jitted, mesh, rules)


def run_training(
    run_dir: str | Path,
    config: TrainConfig,
    state: TrainState,
    train_step: ShardedFunction,
    step_inputs: Callable[[int], tuple],
    *,
    desc: str,
) -> TrainState:
    """Trains `state` to `config.steps` in `run_dir`, resuming from its newest checkpoint.

    `state` is the initial state (also the restore target: its shardings are reused) and is
    donated; `step_inputs(s)` gives the step's arguments after the state for 0-based step s.
    A run whose last step is already saved is restored and returned without training.
    Metrics are written every `log_every_steps` (no TensorBoard); the loss is checked for
    NaN / Inf there and before every checkpoint, so a non-finite state is never saved.
    """
    # Never undone: the handlers stay for the study's later stages, so a signal between two
    # trainings (e.g. while teacher logits are cached) is still honoured.
    preemption.install()
    io = RunIO(
        run_dir,
        total_steps=config.steps,
        save_every_steps=config.save_every_steps,
        keep_last_n=config.keep_last_n,
        desc=desc,
        log_every_steps=config.log_every_steps,
        tensorboard=False,
        host_metrics=False,
        finite=(LOSS,),
        advice="Lower the learning rate.",
    )
    try:
        restored = io.restore(state)
        if restored is not None:
            state = restored[0]
        start = int(state.step)
        if start > config.steps:
            raise ValueError(
                f"[{desc}] {run_dir} holds a checkpoint of step {start} > steps={config.steps}; "
                "use the run's own config or a new workdir"
            )
        io.start(start)
        for s in range(start, config.steps):
            state, metrics = train_step(state, *step_inputs(s))
            done = s + 1
            final = done == config.steps
            if done % config.log_every_steps == 0 or final:
                io.log(done, metrics, {"loss": f"{float(metrics[LOSS]):.4f}"})
            else:
                io.show(done)
            if io.save_due(done, force=final):
                io.check_finite(done, {LOSS: float(metrics[LOSS])})
                io.save(state, {"step": done}, force=final)
            # A stop requested by now ends the run at its saved step; one the fault hooks request
            # (`sigterm_at_step=N`) is honoured at the next step, which it saves.
            io.stop_if_requested(done)
            io.fault_hooks(done)
    finally:
        io.close()
    return state


def predict_views(
    predict_fn: ShardedFunction, params: nnx.State, data: MultimodalDataset, batch_size: int
) -> np.ndarray:
    """Logits `[N, 3, C]` of every sample on the views (full, text, image), as float32 NumPy.

    `predict_fn` is `step.make_teacher_fn(...)` (any model's batched view forward).
    """
    indices, n = data.padded_indices(batch_size)
    chunks = [
        np.asarray(predict_fn(params, data.batch(indices[i : i + batch_size])))
        for i in range(0, len(indices), batch_size)
    ]
    return np.concatenate(chunks)[:n].astype(np.float32)


def view_metrics(logits_nvc: np.ndarray, data: MultimodalDataset) -> dict[str, float]:
    """Accuracy per view (and AUROC of class 1 for binary tasks), as plain floats; with regimes
    (DigitsCaption), also the full-input accuracy within each regime ("by_regime/<regime>")."""
    label_n = data.label_n
    correct_nv = np.argmax(logits_nvc, -1) == label_n[:, None]
    metrics = {f"accuracy/{name}": float(np.mean(correct_nv[:, v])) for v, name in enumerate(VIEWS)}
    if logits_nvc.shape[-1] == 2:
        for v, name in enumerate(VIEWS):
            metrics[f"auroc/{name}"] = auroc(logits_nvc[:, v, 1] - logits_nvc[:, v, 0], label_n)
    if data.regime_n is not None:
        for r, regime in enumerate(REGIMES):
            if np.any(data.regime_n == r):
                metrics[f"by_regime/{regime}"] = float(np.mean(correct_nv[data.regime_n == r, 0]))
    return metrics


def auroc(score_n: np.ndarray, label_n: np.ndarray) -> float:
    """Area under the ROC curve of `score_n` for label 1 (Mann-Whitney U, ties count half);
    NaN when one class is absent."""
    pos, neg = score_n[label_n == 1], score_n[label_n == 0]
    if not len(pos) or not len(neg):
        return float("nan")
    order = np.argsort(np.concatenate([pos, neg]), kind="stable")
    ranks = np.empty(len(order))
    values = np.concatenate([pos, neg])[order]
    # Average ranks over ties.
    _, first, counts = np.unique(values, return_index=True, return_counts=True)
    mean_rank = first + (counts + 1) / 2.0
    ranks[order] = np.repeat(mean_rank, counts)
    u = ranks[: len(pos)].sum() - len(pos) * (len(pos) + 1) / 2.0
    return float(u / (len(pos) * len(neg)))

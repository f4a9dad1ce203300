"""The trainer: optimizer, train state, and the jitted SFT and RL steps on the trainer mesh.

Steps are pure functions `step(state, batch) -> (state, metrics)`, jitted once with explicit
`in_shardings` / `out_shardings` on the trainer mesh and the state donated (MaxText style).
Parameters are a pure dict of arrays (`nnx.to_pure_dict`), merged into the model's graph inside
the step, so the state is a plain pytree that Orbax and optax handle directly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from jaxrl import lora as lora_lib
from jaxrl.infra import sharding as ax
from jaxrl.models.config import ModelConfig
from jaxrl.models.transformer import Transformer
from jaxrl.rl import (
    PolicyLoss,
    PolicyLossInputs,
    RolloutBatch,
    make_advantage_estimator,
    make_loss,
)
from jaxrl.rl.logprobs import token_logprobs, token_logprobs_and_entropy
from jaxrl.rl.packing import (
    PackedRolloutBatch,
    pack_rollout_batch,
    pack_sft_batch,
    segment_mask,
)

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


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """The RL objective: a registered loss preset (`jaxrl.rl.losses`) and its advantage estimator.

    `name` picks a preset that means what its name says; fields left at None take the preset's
    value (see each loss class's docstring):

        name       loss                                 normaliser      advantage        clip
        aipo       LlamaRL AIPO, rho 4 (the default)    tokens          group_mean       -
        grpo       GRPO (DeepSeekMath)                  sequence_mean   group_mean_std   0.2
        dr_grpo    Dr. GRPO                             constant        group_mean       0.2
        dapo       DAPO (clip higher)                   tokens          group_mean_std   0.2/0.28
        ppo_clip   PPO clip                             tokens          group_mean       0.2

    Setting a field overrides the preset (e.g. `LossConfig(name="grpo", normaliser="tokens")`);
    a field the loss does not take (`rho` for a clipped loss, `clip_eps` for AIPO) is an error.
    `temperature` must be the sampler's: log pi is computed under the same distribution the
    behaviour log-probs were (no top-k / top-p in RL).
    """

    name: str = "aipo"
    rho: float | None = None
    clip_eps: float | None = None
    clip_eps_high: float | None = None
    normaliser: str | None = None
    advantage: str | None = None
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    temperature: float = 1.0
    vocab_chunk_size: int = 0

    def validate(self) -> None:
        self.make_loss()
        make_advantage_estimator(self.advantage_name)
        if not self.temperature > 0:
            raise ValueError(f"temperature={self.temperature} must be > 0")

    def make_loss(self) -> PolicyLoss:
        """The configured `PolicyLoss` (the preset with this config's overrides)."""
        hparams = dict(
            kl_coef=self.kl_coef, kl_estimator=self.kl_estimator, entropy_coef=self.entropy_coef
        )
        for name in ("rho", "clip_eps", "clip_eps_high", "normaliser"):
            if getattr(self, name) is not None:
                hparams[name] = getattr(self, name)
        return make_loss(self.name, **hparams)

    @property
    def advantage_name(self) -> str:
        """The advantage estimator: `advantage` if set, else the preset's."""
        if self.advantage is not None:
            return self.advantage
        return getattr(self.make_loss(), "advantage", "group_mean")


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

    The trainer then sets p = cast(w, p.dtype) (`_apply`): an update smaller than half a bf16
    ulp of p (|u| < 2^-9 |p|) still accumulates in w and reaches p once the sum crosses a
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


def sequence_mask(valid_bs: jax.Array) -> jax.Array:
    """Causal attention mask `[B, S, S]` restricted to real tokens."""
    s = valid_bs.shape[-1]
    return jnp.tril(jnp.ones((s, s), bool))[None] & valid_bs[:, None, :].astype(bool)


def _split_micro(tree: Any, num: int) -> Any:
    def split(x):
        if x.shape[0] % num:
            raise ValueError(f"batch of {x.shape[0]} rows does not split into {num} micro-batches")
        return x.reshape(num, x.shape[0] // num, *x.shape[1:])

    return jax.tree.map(split, tree)


def _accumulate(
    loss_fn: Callable, params: Params, micro_batches: Any, weights_m: jax.Array
) -> tuple[Any, dict]:
    """Gradient of `sum_m weights_m * loss_fn(params, micro_m)`, one micro-batch at a time.

    Each micro-batch's gradient comes in the params' dtype; the sum is carried in float32 (at
    least), so bf16 params accumulate without bf16 rounding at every micro-batch."""
    grad_fn = jax.grad(loss_fn, has_aux=True)

    def body(acc, xs):
        micro, weight = xs
        grads, metrics = grad_fn(params, micro)
        acc = jax.tree.map(lambda a, g: a + weight * g.astype(a.dtype), acc, grads)
        return acc, metrics

    zeros = jax.tree.map(
        lambda p: jnp.zeros(p.shape, jnp.promote_types(p.dtype, jnp.float32)), params
    )
    grads, metrics_m = jax.lax.scan(body, zeros, (micro_batches, weights_m))
    metrics = jax.tree.map(lambda m: jnp.sum(m * weights_m), metrics_m)
    return grads, metrics


def _apply(state: TrainState, grads, optimizer) -> tuple[TrainState, dict]:
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    if isinstance(opt_state, MasterWeightsState):  # the params are the master weights, cast
        params = jax.tree.map(lambda w, p: w.astype(p.dtype), opt_state.master, state.params)
    else:
        params = optax.apply_updates(state.params, updates)
    new = TrainState(step=state.step + 1, params=params, opt_state=opt_state)
    return new, {"grad_norm": optax.tree.norm(grads), "update_norm": optax.tree.norm(updates)}


# --- SFT -----------------------------------------------------------------------------------------


def sft_loss(graphdef, params: Params, batch: dict, vocab_chunk_size: int | None):
    """Mean next-token cross-entropy over `loss_mask_bs` (targets at s, predicted from s-1).

    batch: `tokens_bs` int32, `loss_mask_bs` bool (True on tokens the model must emit); packed
    (`jaxrl.rl.packing.pack_sft_batch`) it also holds `segment_bs` and `positions_bs`.
    """
    model: Transformer = nnx.merge(graphdef, params)
    tokens, loss_mask = batch["tokens_bs"], batch["loss_mask_bs"]
    if "segment_bs" in batch:
        mask_bss, positions = segment_mask(batch["segment_bs"]), batch["positions_bs"]
    else:  # every column is attended: right padding follows the targets
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        mask_bss = sequence_mask(tokens != -1)
    hidden, _ = model.hidden_states(tokens, positions, mask_bss)
    logprobs = token_logprobs(
        hidden[:, :-1], model.unembedding(), tokens[:, 1:], vocab_chunk_size=vocab_chunk_size
    )
    mask = loss_mask[:, 1:]
    count = jnp.maximum(mask.sum(), 1)
    nll = -jnp.sum(jnp.where(mask, logprobs, 0.0)) / count
    accuracy = jnp.sum(mask & (logprobs > jnp.log(0.5))) / count
    return nll, {"loss": nll, "token_confident_fraction": accuracy}


def _with_base(base: Params | None, params: Params) -> Params:
    """The params the graphdef merges: `params` alone, or (LoRA) the frozen base plus the
    trained adapters `params`."""
    return params if base is None else lora_lib.combine(base, params)


def sft_step(
    state: TrainState,
    batch: dict,
    base: Params | None = None,
    *,
    graphdef,
    optimizer,
    grad_accum_steps: int,
    vocab_chunk_size: int | None,
):
    loss_fn = lambda p, b: sft_loss(graphdef, _with_base(base, p), b, vocab_chunk_size)
    micro = _split_micro(batch, grad_accum_steps)
    counts_m = jnp.sum(micro["loss_mask_bs"][:, :, 1:], axis=(1, 2)).astype(jnp.float32)
    weights_m = counts_m / jnp.maximum(counts_m.sum(), 1.0)
    grads, metrics = _accumulate(loss_fn, state.params, micro, weights_m)
    state, opt_metrics = _apply(state, grads, optimizer)
    return state, metrics | opt_metrics


# --- RL ------------------------------------------------------------------------------------------


def completion_logprobs(
    model: Transformer,
    batch: RolloutBatch | PackedRolloutBatch,
    loss: LossConfig,
    with_entropy: bool,
    pack_groups: int = 1,
) -> tuple[jax.Array, jax.Array | None]:
    """fp32 log pi of each completion token `[B, T]` (and entropy) under `temperature`; a packed
    batch is gathered from its `pack_groups` groups (`jaxrl.rl.packing`)."""
    if isinstance(batch, PackedRolloutBatch):
        mask_rll = segment_mask(batch.segment_rl, batch.prefix_rl)
        hidden, _ = model.hidden_states(batch.tokens_rl, batch.positions_rl, mask_rll)
        hidden_btd = batch.completion_hidden(hidden, pack_groups)
    else:
        tokens, mask, positions = batch.sequence()
        hidden, _ = model.hidden_states(tokens, positions, sequence_mask(mask))
        hidden_btd = batch.completion_hidden(hidden)
    chunk = loss.vocab_chunk_size or None
    if with_entropy:
        return token_logprobs_and_entropy(
            hidden_btd,
            model.unembedding(),
            batch.completion_ids_bt,
            temperature=loss.temperature,
            vocab_chunk_size=chunk,
        )
    logprobs = token_logprobs(
        hidden_btd,
        model.unembedding(),
        batch.completion_ids_bt,
        temperature=loss.temperature,
        vocab_chunk_size=chunk,
    )
    return logprobs, None


def rl_loss(
    graphdef, params: Params, micro: dict, loss: LossConfig, batch_type=RolloutBatch, groups=1
):
    """The configured policy loss on one micro-batch; `micro` holds the fields of `batch_type`
    (`RolloutBatch` or `PackedRolloutBatch`, packed in `groups` groups per micro-batch) plus
    `advantages_b` (computed on the whole batch, since groups span micro-batches) and, with a KL
    term, `ref_logprobs_bt`."""
    model: Transformer = nnx.merge(graphdef, params)
    names = {f.name for f in dataclasses.fields(batch_type)}
    batch = batch_type(**{k: v for k, v in micro.items() if k in names})
    logprobs, entropy = completion_logprobs(model, batch, loss, loss.entropy_coef > 0, groups)
    inputs = PolicyLossInputs(
        logprobs_bt=logprobs,
        behaviour_logprobs_bt=batch.behaviour_logprobs_bt,
        advantages_b=micro["advantages_b"],
        mask_bt=batch.completion_mask_bt & batch.valid_b[:, None],
        ref_logprobs_bt=micro.get("ref_logprobs_bt"),
        entropy_bt=entropy,
    )
    return loss.make_loss()(inputs)


def rl_step(
    state: TrainState,
    batch: RolloutBatch | PackedRolloutBatch,
    ref_params: Params | None,
    base: Params | None = None,
    *,
    graphdef,
    optimizer,
    loss: LossConfig,
    grad_accum_steps: int,
    pack_shards: int = 1,
):
    """One optimizer update on a batch of scored rollouts.

    A `PackedRolloutBatch` must be packed in `grad_accum_steps x pack_shards` groups (each
    micro-batch's rollouts with their own rows, split over `pack_shards` data-parallel devices).

    The frozen reference policy (KL term) lives on the trainer mesh with the params' sharding:
    one extra forward pass per step and one more copy of the params in memory. With LoRA
    (`base` given, `state.params` the adapters) the reference is the base with the adapters off
    (B = 0: exactly the base's logits) and `ref_params` is ignored: no copy of the weights.
    """
    mask_bt = batch.completion_mask_bt & batch.valid_b[:, None]
    advantages_b = make_advantage_estimator(loss.advantage_name)(
        batch.reward_b, batch.group_id_b, batch.valid_b
    )
    micro_all = dataclasses.asdict(batch) | {"advantages_b": advantages_b}
    if base is not None and loss.kl_coef > 0:
        ref_params = _with_base(base, lora_lib.zero_adapters(state.params))
    if ref_params is not None and loss.kl_coef > 0:
        ref_model = nnx.merge(graphdef, ref_params)
        ref_logprobs, _ = completion_logprobs(
            ref_model, batch, loss, False, grad_accum_steps * pack_shards
        )
        micro_all["ref_logprobs_bt"] = jax.lax.stop_gradient(ref_logprobs)
    micro = _split_micro(micro_all, grad_accum_steps)
    # Micro-batch m's share of the normaliser: its tokens ("tokens") or its non-empty rows
    # ("sequence_mean", "constant": both average over rows).
    if loss.make_loss().normaliser == "tokens":
        counts_m = jnp.sum(_split_micro(mask_bt, grad_accum_steps), axis=(1, 2))
    else:
        rows_b = jnp.any(mask_bt, axis=-1)
        counts_m = jnp.sum(_split_micro(rows_b, grad_accum_steps), axis=1)
    counts_m = counts_m.astype(jnp.float32)
    weights_m = counts_m / jnp.maximum(counts_m.sum(), 1.0)
    loss_fn = lambda p, m: rl_loss(graphdef, _with_base(base, p), m, loss, type(batch), pack_shards)
    grads, metrics = _accumulate(loss_fn, state.params, micro, weights_m)
    state, opt_metrics = _apply(state, grads, optimizer)
    metrics = metrics | opt_metrics
    metrics["advantage_abs_mean"] = jnp.sum(jnp.abs(advantages_b) * batch.valid_b) / jnp.maximum(
        batch.valid_b.sum(), 1
    )
    return state, metrics


# --- the trainer executor ------------------------------------------------------------------------


class Trainer:
    """Holds the trainer mesh, the shardings and the jitted steps (compiled once per shape).

    `state_shardings` lay params and optimizer state out as `rules` say (FSDP x TP by default);
    batches are split along the batch axis; metrics come back replicated.

    Packing (`pack_length` > 0): each batch is packed on the host into rows of `pack_length`
    tokens with segment ids before it is placed (`jaxrl.rl.packing`: no FLOPs on padding, the
    loss unchanged), one packing group per micro-batch and data-parallel device; a sequence
    longer than `pack_length` is an error.

    Shared prompts (`share_prompts`, packed batches only): the rollouts of a packing group with
    identical prompts (a GRPO group's samples) are packed as one `[prompt, c_1, ..., c_n]` unit,
    the prompt run through the model once and each completion attending to it and to itself
    (`jaxrl.rl.packing`): the loss and gradients of the repeated layout, with (G - 1) / G of the
    prompt tokens' FLOPs saved. None (the default) turns it on wherever packing is on. Packing is
    refused with `attention_impl="pallas"`, whose kernel takes a causal mask with key validity
    only.

    LoRA (`lora` given): the state's params are the adapters only (`jaxrl.lora`), so gradients,
    optimizer state and checkpoints cover the adapters; the frozen base lives in
    `self.base_params` (laid out as a full model's params, set by `init` or `set_base`) and
    enters each step as an argument that is never donated or updated.

    Precision (docs/precision.md): the forward and backward passes run on `state.params` as
    stored (`ModelConfig.param_dtype`), computing in `ModelConfig.dtype`; gradients are summed
    over micro-batches, clipped and fed to the optimizer in float32. Params stored below float32
    (bf16) get float32 master weights in the optimizer state (`with_master_weights`,
    `self.master_weights`): Adam and the update run on them and `state.params` is their cast.
    """

    def __init__(
        self,
        model_config: ModelConfig,
        mesh: jax.sharding.Mesh,
        rules: ax.LogicalRules,
        optimizer: optax.GradientTransformation,
        *,
        grad_accum_steps: int = 1,
        loss: LossConfig | None = None,
        vocab_chunk_size: int | None = None,
        lora: lora_lib.LoraConfig | None = None,
        pack_length: int = 0,
        share_prompts: bool | None = None,
    ):
        if pack_length < 0:
            raise ValueError(f"pack_length={pack_length}: use 0 (padded batches) or a row length")
        if pack_length and model_config.attention_impl == "pallas":
            # The splash kernel is given each key's validity only (`pallas_attention`): in a
            # packed row every sequence would attend to the sequences packed before it.
            raise ValueError(
                f"pack_length={pack_length} with attention_impl='pallas': the splash kernel "
                "sees key validity only, not the packed rows' sequence boundaries; use "
                "pack_length=0 (padded batches) or attention_impl='xla'"
            )
        if share_prompts and not pack_length:
            raise ValueError(
                "share_prompts=True packs each group as [prompt, completions] in rows with a "
                "shared-prompt mask: it needs pack_length > 0; set pack_length, or "
                "share_prompts=None / False"
            )
        self.share_prompts = bool(pack_length if share_prompts is None else share_prompts)
        self.model_config, self.mesh, self.rules = model_config, mesh, rules
        self.pack_length, self.grad_accum_steps = pack_length, grad_accum_steps
        self.pack_shards = ax.batch_split(mesh, rules)
        if lora is not None:
            optimizer = lora_lib.with_b_lr_ratio(optimizer, lora)
        self.loss = loss or LossConfig()
        self.lora = lora
        graphdef, abstract = nnx.split(
            nnx.eval_shape(lambda: Transformer(model_config, rngs=nnx.Rngs(0)))
        )
        self.base_param_shardings = nnx.to_pure_dict(ax.param_shardings(abstract, mesh, rules))
        self.base_params: Params | None = None
        if lora is not None:
            graphdef, abstract = lora_lib.abstract_lora(model_config, lora)
        self.graphdef = graphdef
        self.abstract_params = nnx.to_pure_dict(abstract)
        self.param_shardings = nnx.to_pure_dict(ax.param_shardings(abstract, mesh, rules))
        self.frozen_adapter_shardings: Params = {}
        if lora is not None:  # LoRA-FA: the A's sit with the base, out of the state
            self.frozen_adapter_shardings = lora_lib.frozen_part(self.param_shardings, lora)
            self.abstract_params = lora_lib.trained_part(self.abstract_params, lora)
            self.param_shardings = lora_lib.trained_part(self.param_shardings, lora)
        self.master_weights = needs_master_weights(self.abstract_params)
        if self.master_weights:
            optimizer = with_master_weights(optimizer)
        self.optimizer = optimizer
        abstract_opt = jax.eval_shape(optimizer.init, self.abstract_params)
        self.state_shardings = TrainState(
            step=ax.replicated(mesh),
            params=self.param_shardings,
            opt_state=ax.opt_state_shardings(
                abstract_opt, self.abstract_params, self.param_shardings, mesh
            ),
        )
        self.replicated = ax.replicated(mesh)
        common = dict(graphdef=graphdef, optimizer=optimizer, grad_accum_steps=grad_accum_steps)
        self._sft = jax.jit(
            lambda s, b, base: sft_step(s, b, base, vocab_chunk_size=vocab_chunk_size, **common),
            in_shardings=(self.state_shardings, None, None),
            out_shardings=(self.state_shardings, self.replicated),
            donate_argnums=0,
        )
        self._rl = jax.jit(
            lambda s, b, r, base: rl_step(
                s, b, r, base, loss=self.loss, pack_shards=self.pack_shards, **common
            ),
            in_shardings=(self.state_shardings, None, None, None),
            out_shardings=(self.state_shardings, self.replicated),
            donate_argnums=0,
        )

    def abstract_state(self) -> TrainState:
        """ShapeDtypeStructs with shardings: the restore target of a checkpoint."""
        abstract = jax.eval_shape(lambda p: init_state(p, self.optimizer), self.abstract_params)
        return ax.attach_shardings(abstract, self.state_shardings)

    def lower_rl_step(self, abstract_batch: RolloutBatch):
        """The RL step lowered for an abstract batch (ShapeDtypeStructs; shardings are added
        here) and the abstract state: nothing is allocated. `.compile()` gives the compiler's
        `memory_analysis()` / `cost_analysis()` per device (`launch.plan`). No reference policy
        (kl_coef = 0) and no LoRA base."""
        batch = ax.attach_shardings(
            abstract_batch, ax.batch_shardings(abstract_batch, self.mesh, self.rules)
        )
        with self._context():
            return self._rl.lower(self.abstract_state(), batch, None, None)

    @classmethod
    def from_hf(
        cls,
        path: str,
        optimizer: OptimizerConfig,
        *,
        total_steps: int,
        mesh: jax.sharding.Mesh | None = None,
        rules: ax.LogicalRules | None = None,
        loss: LossConfig | None = None,
        vocab_chunk_size: int | None = None,
        **config_overrides: Any,
    ) -> tuple[Trainer, TrainState]:
        """A trainer for the HF `save_pretrained` directory `path` and its first `TrainState`.

        The weights are read (safetensors only) straight into the trainer's parameter shardings,
        one tensor at a time. `mesh` defaults to every device on ("fsdp", "tp") = (n, 1), `rules`
        to `TRAINER_RULES`; `optimizer` is built for a run of `total_steps` optimizer steps.
        `config_overrides` set what HF configs do not carry (`param_dtype="bfloat16"`,
        `dtype="bfloat16"`, `attention_impl="cudnn"`, ...). The tokenizer: `hf.load_tokenizer`.

            trainer, state = Trainer.from_hf("ckpt/", OptimizerConfig(1e-6), total_steps=100,
                                             loss=LossConfig(name="grpo"))
            state, metrics = trainer.rl_step(state, batch)
        """
        from jaxrl.infra.mesh import MeshConfig, make_mesh
        from jaxrl.models import hf

        model_config = hf.load_config(path, **config_overrides)
        if mesh is None:
            mesh = make_mesh(MeshConfig(("fsdp", "tp"), (-1, 1)))
        trainer = cls(
            model_config,
            mesh,
            ax.TRAINER_RULES if rules is None else rules,
            optimizer.make(total_steps),
            grad_accum_steps=optimizer.grad_accum_steps,
            loss=loss,
            vocab_chunk_size=vocab_chunk_size,
        )
        params = hf.load_params(path, model_config, trainer.param_shardings)
        return trainer, trainer.init(params)

    def init(self, params: Params | nnx.State | Transformer) -> TrainState:
        """A fresh state around `params` (placed into the trainer layout first): a pure dict of
        arrays, an `nnx.State` (`hf.load_params`) or a whole `Transformer` (`hf.load_model`),
        whose config must be this trainer's. The state's params are cast to the model's
        `param_dtype`; float32 master weights (bf16 params) keep the given values."""
        if isinstance(params, Transformer):
            if params.config != self.model_config:
                raise ValueError(
                    "the model's config differs from the trainer's; build the Trainer with "
                    "model.config (or use Trainer.from_hf)"
                )
            params = nnx.state(params)
        if isinstance(params, nnx.State):
            params = nnx.to_pure_dict(params)
        if self.lora is not None:
            self.set_base(params)
            with self._context():
                params = jax.jit(
                    lambda: lora_lib.trained_part(
                        lora_lib.init_adapters(self.model_config, self.lora), self.lora
                    ),
                    out_shardings=self.param_shardings,
                )()
        params = jax.device_put(params, self.param_shardings)
        dtypes = jax.tree.map(lambda x: x.dtype, self.abstract_params)

        def make(p):
            # The state holds the params in their storage dtype; master weights take the given
            # values (float32 ones in full).
            cast = jax.tree.map(lambda x, d: x.astype(d), p, dtypes)
            opt_state = self.optimizer.init(p if self.master_weights else cast)
            return TrainState(step=jnp.zeros((), jnp.int32), params=cast, opt_state=opt_state)

        with self._context():
            return jax.jit(make, out_shardings=self.state_shardings)(params)

    def set_base(self, params: Params) -> None:
        """The frozen base of a LoRA trainer (placed into the full model's trainer layout); with
        `LoraConfig.freeze_a`, plus the frozen A's (rebuilt from the adapters' seed)."""
        if self.lora is None:
            raise ValueError("set_base is for a LoRA trainer (Trainer(..., lora=LoraConfig()))")
        base = jax.device_put(params, self.base_param_shardings)
        if self.frozen_adapter_shardings:
            with self._context():
                frozen = jax.jit(
                    lambda: lora_lib.frozen_part(
                        lora_lib.init_adapters(self.model_config, self.lora), self.lora
                    ),
                    out_shardings=self.frozen_adapter_shardings,
                )()
            base = lora_lib.combine(base, frozen)
        self.base_params = base

    def policy_params(self, params: Params) -> Params:
        """What the graphdef merges for `state.params`: the base plus the adapters with LoRA."""
        return _with_base(self._base(), params) if self.lora is not None else params

    def _base(self) -> Params | None:
        if self.lora is not None and self.base_params is None:
            raise ValueError("a LoRA trainer needs its frozen base: call init(base) or set_base")
        return self.base_params

    def init_params(self, seed: int) -> Params:
        """Random params born sharded (a jitted init with `out_shardings`); LoRA: the base's."""

        def make():  # the key is made inside: no host constant to place across processes
            key = jax.random.fold_in(jax.random.key(seed), 0)
            return nnx.to_pure_dict(
                nnx.state(Transformer(self.model_config, rngs=nnx.Rngs(params=key)))
            )

        with self._context():
            return jax.jit(make, out_shardings=self.base_param_shardings)()

    def place_batch(self, batch):
        return ax.place_host(batch, ax.batch_shardings(batch, self.mesh, self.rules))

    def _context(self):
        return ax.sharding_context(self.mesh, self.rules)

    def _pack_groups(self) -> int:
        return self.grad_accum_steps * self.pack_shards

    def sft_step(self, state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        if self.pack_length:
            batch = pack_sft_batch(batch, self.pack_length, self._pack_groups())
        with self._context():
            return self._sft(state, self.place_batch(batch), self._base())

    def rl_step(
        self, state: TrainState, batch: RolloutBatch, ref_params: Params | None = None
    ) -> tuple[TrainState, dict]:
        """One update on `batch` (host arrays, as `collate_rollouts` makes them; laid out here
        by `layout_batch`)."""
        batch = self.layout_batch(batch)
        with self._context():
            return self._rl(state, self.place_batch(batch), ref_params, self._base())

    def layout_batch(self, batch: RolloutBatch | PackedRolloutBatch):
        """`batch` as `rl_step` trains on it: packed when the trainer packs (each group's prompt
        once when `share_prompts`), else unchanged."""
        if self.pack_length and isinstance(batch, RolloutBatch):
            return pack_rollout_batch(
                batch, self.pack_length, self._pack_groups(), share_prompts=self.share_prompts
            )
        return batch

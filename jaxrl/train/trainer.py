"""The trainer: the jitted SFT and RL steps on the trainer mesh, and the train state around them.

Steps are pure functions `step(state, batch) -> (state, metrics)`, jitted once with explicit
`in_shardings` / `out_shardings` on the trainer mesh and the state donated (MaxText style).
Parameters are a pure dict of arrays (`nnx.to_pure_dict`), merged into the model's graph inside
the step, so the state is a plain pytree that Orbax and optax handle directly.

The optimizer's config, the train state and master weights are in `jaxrl.train.state`; the pure
steps, their losses and `LossConfig` in `jaxrl.train.steps`. `OptimizerConfig`, `LossConfig` and
`TrainState` are importable from here.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxrl.infra import sharding as ax
from jaxrl.models.config import ModelConfig
from jaxrl.models.transformer import Transformer
from jaxrl.rl import RolloutBatch
from jaxrl.rl.packing import (
    AUTO,
    PackedRolloutBatch,
    auto_row_length,
    pack_rollout_batch,
    pack_sft_batch,
)
from jaxrl.train import lora as lora_lib
from jaxrl.train.state import (
    OptimizerConfig,
    Params,
    TrainState,
    init_state,
    needs_master_weights,
    with_master_weights,
)
from jaxrl.train.steps import LossConfig, rl_step, sft_step, with_base


class Trainer:
    """Holds the trainer mesh, the shardings and the jitted steps (compiled once per shape).

    `state_shardings` lay params and optimizer state out as `rules` say (FSDP x TP by default);
    batches are split along the batch axis; metrics come back replicated.

    Packing (`pack_length` > 0): each batch is packed on the host into rows of `pack_length`
    tokens with segment ids before it is placed (`jaxrl.rl.packing`: no FLOPs on padding, the
    loss unchanged), one packing group per micro-batch and data-parallel device; a sequence
    longer than `pack_length` is an error. `pack_length="auto"` derives the rows from each
    batch's shapes (`jaxrl.rl.packing.auto_row_length`: one GRPO group's prompt and full-length
    completions, `P + G * T`, at most 4 padded rows; an SFT batch's own width): every sequence
    fits, so it is exact for any batch. 0 trains padded batches.

    Shared prompts (`share_prompts`, packed batches only): the rollouts of a packing group with
    identical prompts (a GRPO group's samples) are packed as one `[prompt, c_1, ..., c_n]` unit,
    the prompt run through the model once and each completion attending to it and to itself
    (`jaxrl.rl.packing`): the loss and gradients of the repeated layout, with (G - 1) / G of the
    prompt tokens' FLOPs saved. None (the default) turns it on wherever packing is on. Packing is
    refused with `attention_impl="pallas"` in a CPU program, whose splash kernel takes a causal
    mask with key validity only ("auto" trains padded batches there).

    Which to set: packed rows with shared prompts are the fast exact path for GRPO-style groups
    (docs/peers.md: rlbench-tiny's step 0.343 s against 0.384 s padded); `Trainer.from_hf`
    defaults to "auto". The constructor keeps 0 (padded) so that a layout is chosen explicitly
    where the step is built by hand; set "auto" or a row length about one group's unit long
    (longer rows cost more attention, which is dense over the row), or 0 where attention memory
    binds (long completions) or for `attention_impl="pallas"` on a CPU.

    LoRA (`lora` given): the state's params are the adapters only (`jaxrl.train.lora`), so
    gradients, optimizer state and checkpoints cover the adapters; the frozen base lives in
    `self.base_params` (laid out as a full model's params, set by `init` or `set_base`) and
    enters each step as an argument that is never donated or updated.

    Precision (docs/precision.md): the forward and backward passes run on `state.params` as
    stored (`ModelConfig.param_dtype`), computing in `ModelConfig.dtype`; gradients are summed
    over micro-batches, clipped and fed to the optimizer in float32. Params stored below float32
    (bf16) get float32 master weights in the optimizer state (`with_master_weights`,
    `self.master_weights`): Adam and the update run on them and `state.params` is their cast.

    Mixture-of-experts policies: both steps add `loss.router_aux_coef(model_config)` times the
    load-balancing loss (`LossConfig.router_aux_loss_coef`; by default the model config's) and
    report it as `router_aux_loss`; dense models' steps are unchanged.
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
        pack_length: int | str = 0,
        share_prompts: bool | None = None,
    ):
        # "pallas" in a CPU program is the splash kernel (interpret mode), which sees key
        # validity only; on GPUs and TPUs it is the library's kernels, which take the packed
        # rows' segments (`gpu_attention`, `tpu_attention`).
        splash = model_config.attention_impl == "pallas" and mesh.devices.flat[0].platform == "cpu"
        if pack_length == AUTO and splash:
            pack_length = 0  # the splash kernel cannot pack (below): padded batches
        if pack_length != AUTO and (not isinstance(pack_length, int) or pack_length < 0):
            raise ValueError(
                f"pack_length={pack_length!r}: use 0 (padded batches), a row length, or "
                f"{AUTO!r} (rows from each batch's shapes)"
            )
        if pack_length and splash:
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
        aux_coef = self.loss.router_aux_coef(model_config)  # 0 for a dense model
        self._sft = jax.jit(
            lambda s, b, base: sft_step(
                s,
                b,
                base,
                vocab_chunk_size=vocab_chunk_size,
                router_aux_loss_coef=aux_coef,
                **common,
            ),  # fmt: skip
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
        pack_length: int | str = AUTO,
        share_prompts: bool | None = None,
        **config_overrides: Any,
    ) -> tuple[Trainer, TrainState]:
        """A trainer for the HF `save_pretrained` directory `path` and its first `TrainState`.

        The weights are read (safetensors only) straight into the trainer's parameter shardings,
        one tensor at a time. `mesh` defaults to every device on ("fsdp", "tp") = (n, 1), `rules`
        to `TRAINER_RULES`; `optimizer` is built for a run of `total_steps` optimizer steps.
        `pack_length` / `share_prompts`: as for the constructor; the default "auto" trains
        packed rows derived from each batch's shapes, each GRPO group's prompt once (the class
        docstring: exact, and faster than padded batches; 0 for padded batches).
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
            pack_length=pack_length,
            share_prompts=share_prompts,
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
        return with_base(self._base(), params) if self.lora is not None else params

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
            length = self.pack_length
            if length == AUTO:  # rows as wide as the batch's: every example fits
                length = np.asarray(batch["tokens_bs"]).shape[1]
            batch = pack_sft_batch(batch, length, self._pack_groups())
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
            length = auto_row_length(batch) if self.pack_length == AUTO else self.pack_length
            return pack_rollout_batch(
                batch, length, self._pack_groups(), share_prompts=self.share_prompts
            )
        return batch

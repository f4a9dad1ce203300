"""The trainer's pure steps: `sft_step` and `rl_step` (`step(state, batch, ...) -> (state,
metrics)`, gradients accumulated over micro-batches), their losses, the RL objective's config
(`LossConfig`) and `completion_logprobs`. `jaxrl.train.trainer.Trainer` jits them on the trainer
mesh; `jaxrl.train.trainer` re-exports `LossConfig`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.models.config import ModelConfig
from jaxrl.models.masks import SegmentMask, sequence_mask  # noqa: F401
from jaxrl.models.moe import load_balancing_loss, routing_mismatch
from jaxrl.models.transformer import Transformer
from jaxrl.rl import (
    PolicyLoss,
    PolicyLossInputs,
    RolloutBatch,
    make_advantage_estimator,
    make_loss,
)
from jaxrl.rl.logprobs import token_logprobs, token_logprobs_and_entropy
from jaxrl.rl.packing import PackedRolloutBatch
from jaxrl.train import lora as lora_lib
from jaxrl.train.state import Params, TrainState, apply_gradients


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

    `router_aux_loss_coef` (mixture-of-experts policies, RL and SFT steps alike): the weight of
    the load-balancing loss (`jaxrl.models.moe.load_balancing_loss`) added to the loss; None
    takes the model config's `router_aux_loss_coef` (the checkpoint's), 0 turns the term off
    (the `router_aux_loss` metric is still reported). Ignored for a dense model.

    `routing_replay` (mixture-of-experts policies; arXiv 2510.11370): the trainer's forward
    passes use the experts the generator chose for each token and layer (the rollouts' routing
    record, `Rollout.routing`) instead of their routers' top-k, the gate weights still this
    router's probabilities of those experts; tokens without a record route themselves. Whenever
    the batch carries a record, `routing/mismatch_fraction` reports the share of recorded
    (token, layer) pairs whose top-k the trainer's router would have chosen differently.
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
    router_aux_loss_coef: float | None = None
    routing_replay: bool = False

    def validate(self) -> None:
        self.make_loss()
        make_advantage_estimator(self.advantage_name)
        if not self.temperature > 0:
            raise ValueError(f"temperature={self.temperature} must be > 0")
        coef = self.router_aux_loss_coef
        if coef is not None and not coef >= 0:
            raise ValueError(
                f"LossConfig.router_aux_loss_coef={coef} must be >= 0 (0: no load-balancing "
                "term; None: the model config's router_aux_loss_coef)"
            )

    def check_replay(self, config: ModelConfig, generator_kind: str, episodes: bool) -> None:
        """Refuses routing replay where no routing record can come: a dense policy, a generator
        other than the continuous-batching engine (the one that records), multi-turn episodes
        (their rollouts are assembled from several engine requests and carry no record)."""
        if not self.routing_replay:
            return
        why = None
        if not config.num_experts:
            why = "the policy is dense (routing replay is for mixture-of-experts models)"
        elif generator_kind != "engine":
            why = (f"the generator is {generator_kind!r}, which keeps no routing record: use "
                   "GeneratorConfig.kind = 'engine'")  # fmt: skip
        elif episodes:
            why = "multi-turn episodes carry no routing record"
        if why is not None:
            raise ValueError(f"LossConfig.routing_replay = True but {why}; set it to False")

    def router_aux_coef(self, config: ModelConfig) -> float:
        """The load-balancing loss's weight for a policy of `config`: 0 for a dense model, else
        `router_aux_loss_coef`, or the model config's when None."""
        if not config.num_experts:
            return 0.0
        coef = self.router_aux_loss_coef
        return float(config.router_aux_loss_coef if coef is None else coef)

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


def _hidden_and_aux(
    model: Transformer, tokens, positions, mask, valid_bt, with_aux=True, routing=None, replay=False
):
    """`(hidden, aux, metrics)`: the final hidden states; for a mixture-of-experts model (and
    `with_aux`) the load-balancing loss over the tokens `valid_bt` marks, from the same forward
    pass (else None, and the forward is the plain `hidden_states`); with a routing record
    (`routing`, aligned with `tokens`) `routing/mismatch_fraction`, the record replayed when
    `replay` (`LossConfig.routing_replay`)."""
    with_aux = with_aux and bool(model.config.num_experts)
    if replay and routing is None:
        raise ValueError(
            "LossConfig.routing_replay is on but the rollouts carry no routing record: sample "
            "with the continuous-batching engine (GeneratorConfig.engine), which records it for "
            "mixture-of-experts policies"
        )
    if routing is not None and not model.config.num_experts:
        routing = None  # a dense policy has nothing to replay
    if not (with_aux or routing is not None):
        hidden, _ = model.hidden_states(tokens, positions, mask)
        return hidden, None, {}
    hidden, _, info = model.hidden_states(
        tokens,
        positions,
        mask,
        router_stats=with_aux,
        routing=routing if replay else None,
        record_routing=routing is not None,
    )
    aux = load_balancing_loss(info.stats, valid_bt) if with_aux else None
    metrics = {}
    if routing is not None:
        layers = jnp.asarray([model.config.is_moe_layer(i) for i in range(model.config.num_layers)])
        recorded = jnp.where((valid_bt[:, :, None] & layers[None, None, :])[..., None], routing, -1)
        wrong, compared = routing_mismatch(info.experts, recorded)
        metrics["routing/mismatch_fraction"] = jax.lax.stop_gradient(
            wrong / jnp.maximum(compared, 1.0)
        )
    return hidden, aux, metrics


def _with_aux(loss: jax.Array, metrics: dict, aux: jax.Array | None, coef: float):
    """`loss + coef * aux` and the metrics with `loss` the total and the unweighted
    `router_aux_loss` (unchanged for a dense model: `aux` None)."""
    if aux is None:
        return loss, metrics
    loss = loss + coef * aux if coef else loss
    return loss, metrics | jax.lax.stop_gradient({"loss": loss, "router_aux_loss": aux})


# --- SFT -----------------------------------------------------------------------------------------


def sft_loss(
    graphdef,
    params: Params,
    batch: dict,
    vocab_chunk_size: int | None,
    router_aux_loss_coef: float = 0.0,
):
    """Mean next-token cross-entropy over `loss_mask_bs` (targets at s, predicted from s-1).

    batch: `tokens_bs` int32, `loss_mask_bs` bool (True on tokens the model must emit); packed
    (`jaxrl.rl.packing.pack_sft_batch`) it also holds `segment_bs` and `positions_bs`.

    A mixture-of-experts model adds `router_aux_loss_coef` times the load-balancing loss over
    the attended tokens (packed: the segments' tokens) and reports it as `router_aux_loss`;
    `loss` is then the total.
    """
    model: Transformer = nnx.merge(graphdef, params)
    tokens, loss_mask = batch["tokens_bs"], batch["loss_mask_bs"]
    if "segment_bs" in batch:
        mask_bss, positions = SegmentMask(batch["segment_bs"]), batch["positions_bs"]
        valid = batch["segment_bs"] > 0
    else:  # every column is attended: right padding follows the targets
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        valid = tokens != -1
        mask_bss = SegmentMask.from_valid(valid)
    hidden, aux, _ = _hidden_and_aux(model, tokens, positions, mask_bss, valid)
    logprobs = token_logprobs(
        hidden[:, :-1], model.unembedding(), tokens[:, 1:], vocab_chunk_size=vocab_chunk_size
    )
    mask = loss_mask[:, 1:]
    count = jnp.maximum(mask.sum(), 1)
    nll = -jnp.sum(jnp.where(mask, logprobs, 0.0)) / count
    accuracy = jnp.sum(mask & (logprobs > jnp.log(0.5))) / count
    metrics = {"loss": nll, "token_confident_fraction": accuracy}
    return _with_aux(nll, metrics, aux, router_aux_loss_coef)


def with_base(base: Params | None, params: Params) -> Params:
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
    router_aux_loss_coef: float = 0.0,
):
    """One optimizer update on an SFT batch; `router_aux_loss_coef`: the load-balancing loss's
    weight for a mixture-of-experts model (`LossConfig.router_aux_coef`; ignored when dense)."""
    coef = router_aux_loss_coef
    loss_fn = lambda p, b: sft_loss(graphdef, with_base(base, p), b, vocab_chunk_size, coef)
    micro = _split_micro(batch, grad_accum_steps)
    counts_m = jnp.sum(micro["loss_mask_bs"][:, :, 1:], axis=(1, 2)).astype(jnp.float32)
    weights_m = counts_m / jnp.maximum(counts_m.sum(), 1.0)
    grads, metrics = _accumulate(loss_fn, state.params, micro, weights_m)
    state, opt_metrics = apply_gradients(state, grads, optimizer)
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
    logprobs, entropy, _, _ = _completion_forward(model, batch, loss, with_entropy, pack_groups)
    return logprobs, entropy


def _completion_forward(model, batch, loss, with_entropy, pack_groups, with_aux=False):
    """`completion_logprobs`, and with `with_aux` the load-balancing loss of a mixture-of-experts
    model over every token of the forward pass (prompts included; not padding, not invalid
    rows; None for a dense model); the routing record of the batch replayed with
    `loss.routing_replay`, `routing/mismatch_fraction` in the metrics (`_hidden_and_aux`)."""
    replay = loss.routing_replay
    if isinstance(batch, PackedRolloutBatch):
        mask_rll = SegmentMask(batch.segment_rl, batch.prefix_rl)
        tokens, positions, valid = batch.tokens_rl, batch.positions_rl, batch.segment_rl > 0
        routing = batch.routing_rllk
        hidden, aux, metrics = _hidden_and_aux(
            model, tokens, positions, mask_rll, valid, with_aux, routing, replay
        )
        hidden_btd = batch.completion_hidden(hidden, pack_groups)
    else:
        tokens, mask, positions = batch.sequence()
        mask_bss = SegmentMask.from_valid(mask)
        valid = mask & batch.valid_b[:, None]
        routing = batch.routing_bslk
        hidden, aux, metrics = _hidden_and_aux(
            model, tokens, positions, mask_bss, valid, with_aux, routing, replay
        )
        hidden_btd = batch.completion_hidden(hidden)
    chunk = loss.vocab_chunk_size or None
    if with_entropy:
        logprobs, entropy = token_logprobs_and_entropy(
            hidden_btd,
            model.unembedding(),
            batch.completion_ids_bt,
            temperature=loss.temperature,
            vocab_chunk_size=chunk,
        )
        return logprobs, entropy, aux, metrics
    logprobs = token_logprobs(
        hidden_btd,
        model.unembedding(),
        batch.completion_ids_bt,
        temperature=loss.temperature,
        vocab_chunk_size=chunk,
    )
    return logprobs, None, aux, metrics


def rl_loss(
    graphdef, params: Params, micro: dict, loss: LossConfig, batch_type=RolloutBatch, groups=1
):
    """The configured policy loss on one micro-batch; `micro` holds the fields of `batch_type`
    (`RolloutBatch` or `PackedRolloutBatch`, packed in `groups` groups per micro-batch) plus
    `advantages_b` (computed on the whole batch, since groups span micro-batches) and, with a KL
    term, `ref_logprobs_bt`. A mixture-of-experts model adds `LossConfig.router_aux_coef` times
    the load-balancing loss of the same forward pass (`router_aux_loss`; `loss` the total)."""
    model: Transformer = nnx.merge(graphdef, params)
    names = {f.name for f in dataclasses.fields(batch_type)}
    batch = batch_type(**{k: v for k, v in micro.items() if k in names})
    logprobs, entropy, aux, routing_metrics = _completion_forward(
        model, batch, loss, loss.entropy_coef > 0, groups, with_aux=True
    )
    inputs = PolicyLossInputs(
        logprobs_bt=logprobs,
        behaviour_logprobs_bt=batch.behaviour_logprobs_bt,
        advantages_b=micro["advantages_b"],
        mask_bt=batch.completion_mask_bt & batch.valid_b[:, None],
        ref_logprobs_bt=micro.get("ref_logprobs_bt"),
        entropy_bt=entropy,
    )
    value, metrics = loss.make_loss()(inputs)
    return _with_aux(value, metrics | routing_metrics, aux, loss.router_aux_coef(model.config))


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
        ref_params = with_base(base, lora_lib.zero_adapters(state.params))
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
    loss_fn = lambda p, m: rl_loss(graphdef, with_base(base, p), m, loss, type(batch), pack_shards)
    grads, metrics = _accumulate(loss_fn, state.params, micro, weights_m)
    state, opt_metrics = apply_gradients(state, grads, optimizer)
    metrics = metrics | opt_metrics
    metrics["advantage_abs_mean"] = jnp.sum(jnp.abs(advantages_b) * batch.valid_b) / jnp.maximum(
        batch.valid_b.sum(), 1
    )
    return state, metrics

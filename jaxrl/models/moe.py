"""Sparse mixture-of-experts MLP (Qwen3-MoE), with grouped matmuls and the load-balancing loss.

Routing, as transformers' `Qwen3MoeTopKRouter` computes it, per token x (hidden size E):

    logits = x @ router                           [num_experts], in the compute dtype
    probs  = softmax(logits) in float32
    w, idx = top_k(probs, k)                      k = num_experts_per_tok
    w      = w / sum(w)          if norm_topk_prob
    out    = sum_j w_j * expert_{idx_j}(x)        expert(x) = down(silu(gate(x)) * up(x))

No token is dropped: there is no capacity limit, every token reaches its k experts however
unbalanced the routing. The experts run as grouped matmuls: the N*k (token, expert) pairs are
sorted by expert and `jax.lax.ragged_dot` multiplies each contiguous group by its expert's
weights (no [N, num_experts, F] dense intermediate, no padding to a capacity).

Expert weights are stacked on a leading expert axis, `[num_experts, E, F]` (gate, up) and
`[num_experts, F, E]` (down), with the logical axes `experts`, `expert_embed`, `expert_mlp`
(`jaxrl.infra.sharding`); the router is `[E, num_experts]`, replicated across experts.

Load balancing (Switch Transformer; transformers' `load_balancing_loss_func`): over the sparse
layers l and the valid tokens t (R = layers * valid tokens),

    f_e = sum_{l,t} [e in top_k(probs_{l,t})] / R,   P_e = sum_{l,t} probs_{l,t,e} / R
    aux = num_experts * sum_e f_e * P_e

(k when routing is perfectly balanced). `Transformer.hidden_states(..., router_stats=True)`
returns the per-token sums over layers that this needs (`RouterStats`), `load_balancing_loss`
reduces them.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.infra import sharding as ax
from jaxrl.infra.sharding import logical_param as _param
from jaxrl.models import attention_forms
from jaxrl.models.config import ModelConfig
from jaxrl.models.grouped_matmul import (
    grouped_matmul,
    routed_experts,
    routes_per_device,
    sorted_swiglu,
)

# The dtype of routing records (expert ids; -1: none recorded).
ROUTING_DTYPE = jnp.int16


class RouterStats(NamedTuple):
    """Per-token router statistics summed over the sparse layers: `counts_bte[b, t, e]` how many
    layers chose expert e for token (b, t) among their top k, `probs_bte` the sum of the router
    probabilities; `layers` the number of sparse layers summed."""

    counts_bte: jax.Array
    probs_bte: jax.Array
    layers: int


class RoutingInfo(NamedTuple):
    """What sparse layers report beside their output: `RouterStats` (or None) and the routers'
    own top-k experts (`ROUTING_DTYPE`, or None): `[B, T, k]` from one layer, `[B, T, L, k]`
    from `Transformer.hidden_states` (-1 on dense layers)."""

    stats: RouterStats | None
    experts: jax.Array | None


def routing_mismatch(own_btlk: jax.Array, recorded_btlk: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`(disagreeing, compared)`: how many (token, layer) pairs with a record (`recorded >= 0`)
    chose a different set of experts than `own`, and how many were compared (float32)."""
    have = recorded_btlk[..., 0] >= 0
    same = jnp.all(
        jnp.sort(own_btlk.astype(jnp.int32), axis=-1)
        == jnp.sort(recorded_btlk.astype(jnp.int32), axis=-1),
        axis=-1,
    )
    return jnp.sum(have & ~same).astype(jnp.float32), jnp.sum(have).astype(jnp.float32)


def load_balancing_loss(stats: RouterStats, valid_bt: jax.Array | None = None) -> jax.Array:
    """The auxiliary load-balancing loss (float32 scalar) over the valid tokens, as transformers'
    `load_balancing_loss_func` computes it from the router logits of every sparse layer and the
    attention mask. 0 for a model without sparse layers."""
    if stats.layers == 0:
        return jnp.zeros((), jnp.float32)
    num_experts = stats.probs_bte.shape[-1]
    if valid_bt is None:
        valid_bt = jnp.ones(stats.probs_bte.shape[:2], bool)
    m = valid_bt.astype(jnp.float32)[..., None]
    rows = stats.layers * jnp.sum(m)
    tokens_per_expert = jnp.sum(stats.counts_bte * m, axis=(0, 1)) / rows
    prob_per_expert = jnp.sum(stats.probs_bte * m, axis=(0, 1)) / rows
    return num_experts * jnp.sum(tokens_per_expert * prob_per_expert)


class MoEMLP(nnx.Module):
    """Top-k routed SwiGLU experts (`Qwen3MoeSparseMoeBlock`)."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs, std: float):
        c = config
        e, f, n, pd = c.hidden_size, c.moe_intermediate_size, c.num_experts, c.jnp_param_dtype
        self.config = c
        self.router_kernel = _param(rngs, (e, n), (ax.EXPERT_EMBED, None), pd, std)
        axes_in = (ax.EXPERTS, ax.EXPERT_EMBED, ax.EXPERT_MLP)
        self.gate_kernel = _param(rngs, (n, e, f), axes_in, pd, std)
        self.up_kernel = _param(rngs, (n, e, f), axes_in, pd, std)
        self.down_kernel = _param(
            rngs, (n, f, e), (ax.EXPERTS, ax.EXPERT_MLP, ax.EXPERT_EMBED), pd, std
        )

    def route(
        self, x_ne: jax.Array, replay_nk: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """Router probabilities `[N, num_experts]` (float32), the top-k weights `[N, k]` (compute
        dtype; renormalised if `norm_topk_prob`), the experts used `[N, k]` and the router's own
        top-k choice `[N, k]`.

        `replay_nk` (routing replay): experts recorded elsewhere (the generator), used instead of
        the top-k on the tokens where they are given (-1: not recorded, the router chooses); the
        weights are then this router's probabilities of the replayed experts, renormalised as
        usual, so the router still gets gradients through them."""
        c = self.config
        logits = jnp.dot(x_ne, self.router_kernel[...].astype(c.jnp_dtype))
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        weights, own = jax.lax.top_k(probs, c.num_experts_per_tok)
        experts = own
        if replay_nk is not None:
            replayed = replay_nk[:, :1] >= 0
            experts = jnp.where(replayed, replay_nk.astype(own.dtype), own)
            weights = jnp.take_along_axis(probs, experts, axis=-1)
        if c.norm_topk_prob:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        return probs, weights.astype(c.jnp_dtype), experts, own

    def __call__(
        self,
        x_bte: jax.Array,
        with_stats: bool = False,
        replay_btk: jax.Array | None = None,
        record: bool = False,
    ):
        """`[B, T, E]` -> `[B, T, E]`. With `with_stats` or `record`, `(out, RoutingInfo)`: this
        layer's `RouterStats` (with_stats) and its router's own top-k `[B, T, k]` as
        `ROUTING_DTYPE` (record). `replay_btk`: experts to use instead of the router's where
        given (`route`)."""
        b, t, e = x_bte.shape
        x_ne = x_bte.reshape(b * t, e)
        replay = None if replay_btk is None else replay_btk.reshape(b * t, -1)
        probs, weights, experts, own = self.route(x_ne, replay)
        out = self._experts(x_ne, weights, experts).reshape(b, t, e)
        out = ax.constrain(out, (ax.ACT_BATCH, ax.ACT_LENGTH, ax.ACT_EMBED))
        if not (with_stats or record):
            return out
        stats = None
        if with_stats:
            n = self.config.num_experts
            counts = jnp.sum(jax.nn.one_hot(experts, n, dtype=jnp.float32), axis=1)
            stats = RouterStats(counts.reshape(b, t, n), probs.reshape(b, t, n), 1)
        chosen = own.reshape(b, t, -1).astype(ROUTING_DTYPE) if record else None
        return out, RoutingInfo(stats, chosen)

    def _experts(self, x_ne: jax.Array, weights_nk: jax.Array, experts_nk: jax.Array) -> jax.Array:
        """Every token through its k experts, weighted and summed: the (token, expert) pairs
        sorted by expert, three grouped matmuls over the groups, then unsorted. GPU and TPU
        programs in the trainer's layout sort each device's own tokens
        (`grouped_matmul.routed_experts`: no device gathers another's); CPU programs and the
        generator's layout (experts split over devices) sort all the tokens at once."""
        c = self.config
        kernels = (self.gate_kernel, self.up_kernel, self.down_kernel)
        gate, up, down = (w[...].astype(c.jnp_dtype) for w in kernels)
        if attention_forms.kernel_platform() and routes_per_device(c.num_experts, len(x_ne)):
            return routed_experts(x_ne, weights_nk, experts_nk, gate, up, down)
        down_axes = (ax.EXPERTS, ax.EXPERT_MLP, ax.EXPERT_EMBED)
        down_matmul = functools.partial(grouped_matmul, w_axes=down_axes)
        return sorted_swiglu(
            x_ne, weights_nk, experts_nk, gate, up, down, grouped_matmul, down=down_matmul
        )

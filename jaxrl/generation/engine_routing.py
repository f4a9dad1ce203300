"""The continuous-batching engine's routing record for mixture-of-experts policies.

Routing replay (arXiv 2510.11370, `LossConfig.routing_replay`) needs, for every position of a
sampled sequence, the experts each layer's router chose when the generator ran it. The engine
keeps them beside its KV cache, in a buffer laid out like the cache (`ROUTING_DTYPE`, -1 where
nothing was written):

    scanned layers    [L, S, C, k]          (the cache: [L, S, C, K, D])
    unrolled layers   L x [S, C, k]         (the cache: L x [S, C, K, D])

so the slot and position axes are the cache's and every program that copies, moves, slices or
grows cache rows by `jax.tree.map` does the same to the record: a group's prompt is prefilled
once and its record copied into its G slots with its keys and values, a continued row keeps its
earlier turns', a recomputed prefix (`kv_on_update="recompute"`) rewrites them with the new
weights. Each forward (prefill, extend, decode step) writes its tokens' top-k where it writes
their keys and values. When a row stops, `read_rows` brings its first `pos` positions (all it ran
through the model: the prompt and every sampled token but the last) to the host.

Dense models keep no record: their engine's cache and programs are exactly the KV ones.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.infra import sharding as ax
from jaxrl.models.config import ModelConfig
from jaxrl.models.moe import ROUTING_DTYPE


def records(config: ModelConfig) -> bool:
    """Whether an engine for `config` keeps a routing record (mixture-of-experts models)."""
    return bool(config.num_experts)


def init_routing(config: ModelConfig, slots: int, positions: int):
    """A record of -1s for `slots` rows of `positions` positions, in the cache's layout."""
    shape = (slots, positions, config.num_experts_per_tok)
    if config.scan_layers:
        return jnp.full((config.num_layers, *shape), -1, ROUTING_DTYPE)
    return tuple(jnp.full(shape, -1, ROUTING_DTYPE) for _ in range(config.num_layers))


def routing_axes(leaf) -> tuple:
    """A record leaf's logical axes: slots split like the cache's rows, the rest replicated."""
    return (None,) * (leaf.ndim - 3) + (ax.ACT_BATCH, None, None)


def constrain_routing(routing):
    return jax.tree.map(lambda r: ax.constrain(r, routing_axes(r)), routing)


def as_layout(config: ModelConfig, experts_btlk: jax.Array):
    """`hidden_states`' record `[B, T, L, k]` in the buffer's layout (rows B, positions T)."""
    experts = experts_btlk.astype(ROUTING_DTYPE)
    if config.scan_layers:
        return jnp.moveaxis(experts, 2, 0)
    return tuple(experts[:, :, layer] for layer in range(config.num_layers))


def write_rows(config: ModelConfig, routing, experts_btlk: jax.Array, start_b: jax.Array):
    """`routing` with row b's T new records written from position `start_b[b]` (rows B: the
    buffer's first B rows; a decode step's one position by a scatter, as its keys and values)."""
    axis = 1 if config.scan_layers else 0  # the rows' axis
    rows = jnp.arange(start_b.shape[0])

    def write(buffer, new):
        if new.shape[axis + 1] == 1:
            index = (slice(None),) * axis + (rows, start_b)
            return buffer.at[index].set(jnp.squeeze(new, axis + 1), mode="drop")

        def one(row, values, start):
            return jax.lax.dynamic_update_slice(row, values, (start,) + (0,) * (row.ndim - 1))

        return jax.vmap(one, in_axes=(axis, axis, 0), out_axes=axis)(buffer, new, start_b)

    return jax.tree.map(write, routing, as_layout(config, experts_btlk))


def read_rows(config: ModelConfig, routing, slots: np.ndarray, span: int) -> np.ndarray:
    """Host int16 `[len(slots), span, L, k]`: the first `span` positions of `slots`' records."""
    axis = 1 if config.scan_layers else 0
    return np.asarray(_read(routing, jnp.asarray(slots, jnp.int32), span=span, axis=axis))


@jax.jit(static_argnames=("span", "axis"))
def _read(routing, slots, *, span: int, axis: int):
    def cut(r):
        return jax.lax.slice_in_dim(jnp.take(r, slots, axis=axis), 0, span, axis=axis + 1)

    leaves = jax.tree.map(cut, routing)
    if isinstance(leaves, tuple):  # unrolled: L x [n, span, k]
        return jnp.stack(leaves, axis=2)
    return jnp.moveaxis(leaves, 0, 2)  # scanned: [L, n, span, k]


def with_unrecorded_last(rows: np.ndarray) -> np.ndarray:
    """A stopped row's record `[P + T - 1, L, k]` (every position it ran) with a -1 row for the
    last sampled token, which no forward ran: `[P + T, L, k]`, aligned with prompt + completion."""
    tail = np.full((1, *rows.shape[1:]), -1, rows.dtype)
    return np.concatenate([rows, tail])


def rows_of(records: dict[int, np.ndarray], samples) -> list[np.ndarray] | None:
    """The records of a group's rows `samples` (sample -> record), None when it has none."""
    if not records:
        return None
    return [records[g] for g in samples]

"""The visited-tile lists of the TPU fused attention (`jaxrl.models.tpu_attention`): which
(q block, kv block) tiles the mask reaches, as flat int32 lists the kernels read from SMEM by
scalar prefetch, and the lookup the kernels' index maps make in them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def block_visits(segment, prefix, block_q: int, block_k: int) -> jax.Array:
    """`visits[b, i, j]`: does some query of q block i see some key of kv block j (bool
    `[B, T / block_q, T / block_k]`, the mask reduced over each tile). One q block at a time
    (`lax.map`): the TPU compiler does not fuse the whole `[B, T, T]` reduction and would hold
    a buffer of that order; per q block it holds `[B, block_q, T]` at most."""
    b, t = segment.shape
    nq, nk = t // block_q, t // block_k
    seg_k = segment.reshape(b, 1, nk, block_k)
    k_pos = jnp.arange(t).reshape(1, 1, nk, block_k)

    def q_block(i):
        def rows(x):
            return lax.dynamic_slice_in_dim(x, i * block_q, block_q, axis=1)[:, :, None, None]

        seg_q, pre_q = rows(segment), rows(prefix)
        q_pos = (i * block_q + jnp.arange(block_q)).reshape(1, block_q, 1, 1)
        visible = (k_pos <= q_pos) & (seg_k > 0) & ((seg_k == seg_q) | (seg_k == pre_q))
        return visible.any(axis=(1, 3))  # [B, nk]

    return lax.map(q_block, jnp.arange(nq)).transpose(1, 0, 2)


def visit_lists(visits) -> jax.Array:
    """Flat int32 from `visits [B, N, M]`: per (b, n), the count of visited blocks, then their
    indices in increasing order (the unvisited after them), i.e. `[B, N, 1 + M]` flattened
    (SMEM holds 1-D arrays without padding)."""
    order = jnp.argsort(~visits, axis=-1, stable=True).astype(jnp.int32)
    count = visits.sum(axis=-1, keepdims=True, dtype=jnp.int32)
    return jnp.concatenate([count, order], axis=-1).reshape(-1)


def visited(lists, b, n, step, per_row: int, width: int):
    """(is step a visited tile, its block index) of block n of row b; past the count, the last
    visited tile's index (so the pipeline fetches nothing new) or 0 where none is."""
    base = (b * per_row + n) * (1 + width)
    count = lists[base]
    last = jnp.maximum(jnp.minimum(step, count - 1), 0)
    return step < count, lists[base + 1 + last]

"""Decode attention that reads the KV cache where it lies: a Pallas (Triton) kernel for GPUs.

One query token per row against the engine's cache `[B, C, K, D]` (B rows, C positions, K KV
heads, D head dim), grouped-query (G = H / K query heads per KV head):

    out[b, k, g, :] = sum_s softmax_s(q[b, k, g] . key[b, s, k] / sqrt(D) | visible[b, s])
                      value[b, s, k, :]

The kernel reads each row's keys and values straight from the cache (no slice, transpose or
copy of it) and only up to the row's last visible position, so a step's attention moves each
row's live keys and values once. The grid is (row, KV head, split of the positions); each
program walks its split in `block_k` chunks with an online softmax, and the splits are combined
afterwards (flash-decoding). The visibility mask `[B, C]` is read beside the keys, so any mask
is exact (the engine's prefix, the static sampler's left padding); a row that sees no key
returns zeros.

On a CPU (tests, and plans traced for a GPU on this host) the same kernel runs in Pallas
interpret mode. Under a mesh with logical axis rules it runs per device inside
`jax.shard_map` (rows as `act_batch`, heads as `act_kv_heads` say).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from jaxrl.models.kernel_sharding import decode_per_device

MIN_BLOCK = 16  # Triton's smallest matmul side
BLOCK_K = 128
MAX_SPLITS = 8


def platform() -> str:
    """The platform a program traced now is compiled for: the installed mesh's devices', else
    the default backend's."""
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty:
        return mesh.abstract_device.platform
    return jax.default_backend()


def blocks_for(length: int) -> tuple[int, int] | None:
    """(block_k, splits) for a cache of `length` positions, None where the kernel cannot tile
    it (a length that is not a multiple of 16)."""
    if length % MIN_BLOCK:
        return None
    block_k = BLOCK_K if length % BLOCK_K == 0 else MIN_BLOCK
    splits = 1
    while (
        splits < MAX_SPLITS
        and length % (2 * splits * block_k) == 0
        and length // (2 * splits) >= 2 * block_k
    ):
        splits *= 2
    return block_k, splits


def _kernel(layer_ref, len_ref, q_ref, k_ref, v_ref, vis_ref, o_ref, l_ref, m_ref, *, block_k,
            scale):  # fmt: skip
    """One (row, KV head, split): q `[Gp, D]`, keys / values `[L, split, D]` (strided views of
    the stacked cache, layer `layer_ref[0]` read), visibility `[split]`; writes the split's
    unnormalized output and its softmax statistics (sum l, max m)."""
    split = k_ref.shape[1]
    gp, d = q_ref.shape
    start = pl.program_id(2) * split
    length = len_ref[...]
    layer = layer_ref[0]
    f32 = jnp.float32
    low = jnp.finfo(f32).min
    q = q_ref[...]

    def body(i, carry):
        o_prev, m_prev, l_prev = carry
        chunk = pl.ds(i * block_k, block_k)
        k = k_ref[layer, chunk, :]
        v = v_ref[layer, chunk, :]
        visible = vis_ref[chunk] != 0
        logits = jax.lax.dot_general(
            q, k, (((1,), (1,)), ((), ())), preferred_element_type=f32
        ) * f32(scale)
        logits = jnp.where(visible[None, :], logits, low)
        m_next = jnp.maximum(m_prev, logits.max(axis=1))
        correction = jnp.exp(m_prev - m_next)
        p = jnp.exp(logits - m_next[:, None])
        l_next = correction * l_prev + p.sum(axis=1)
        o_next = correction[:, None] * o_prev + jax.lax.dot_general(
            p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=f32
        )
        return o_next, m_next, l_next

    chunks = jnp.clip(pl.cdiv(length - start, block_k), 0, split // block_k)
    init = (jnp.zeros((gp, d), f32), jnp.full((gp,), low, f32), jnp.zeros((gp,), f32))
    o, m, total = jax.lax.fori_loop(0, chunks, body, init)
    o_ref[...] = o
    l_ref[...] = total
    m_ref[...] = m


def _local(layer_1, q_bkgd, k_lbckd, v_lbckd, visible_bc, *, block_k, splits, interpret):
    b, kv, gp, d = q_bkgd.shape
    layers, c = k_lbckd.shape[0], k_lbckd.shape[2]
    split = c // splits
    positions = jnp.arange(1, c + 1, dtype=jnp.int32)
    length_b = jnp.max(jnp.where(visible_bc, positions[None, :], 0), axis=1)
    f32 = jnp.float32
    kernel = functools.partial(_kernel, block_k=block_k, scale=d**-0.5)
    o, sums, m = pl.pallas_call(
        kernel,
        grid=(b, kv, splits),
        in_specs=[
            pl.BlockSpec((1,), lambda i, h, j: (0,)),
            pl.BlockSpec((None,), lambda i, h, j: (i,)),
            pl.BlockSpec((None, None, gp, d), lambda i, h, j: (i, h, 0, 0)),
            pl.BlockSpec((layers, None, split, None, d), lambda i, h, j: (0, i, j, h, 0)),
            pl.BlockSpec((layers, None, split, None, d), lambda i, h, j: (0, i, j, h, 0)),
            pl.BlockSpec((None, split), lambda i, h, j: (i, j)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, gp, d), lambda i, h, j: (i, h, j, 0, 0)),
            pl.BlockSpec((None, None, None, gp), lambda i, h, j: (i, h, j, 0)),
            pl.BlockSpec((None, None, None, gp), lambda i, h, j: (i, h, j, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, kv, splits, gp, d), f32),
            jax.ShapeDtypeStruct((b, kv, splits, gp), f32),
            jax.ShapeDtypeStruct((b, kv, splits, gp), f32),
        ],
        compiler_params=pl_triton.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="decode_attention_in_place",
    )(layer_1, length_b, q_bkgd, k_lbckd, v_lbckd, visible_bc.astype(jnp.int32))
    m_max = m.max(axis=2, keepdims=True)
    weight = jnp.exp(m - m_max)
    total = (sums * weight).sum(axis=2)
    out = (o * weight[..., None]).sum(axis=2)
    return out / jnp.where(total > 0, total, 1.0)[..., None]


def decode_attention(
    q_b1hd: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    visible_bc: jax.Array,
    *,
    layer: jax.Array | None = None,
    interpret: bool | None = None,
    block_k: int | None = None,
    splits: int | None = None,
) -> jax.Array:
    """Attention `[B, 1, H, D]` of one query per row over the cache `[Bc, C, K, D]` (Bc >= B:
    rows past B are not read), or over layer `layer` of a stacked cache `[L, Bc, C, K, D]`,
    where `visible_bc[b, s]` (`[B, C]`); float32 accumulation, the output in q's dtype.
    `interpret`: Pallas interpret mode (default: off a GPU)."""
    if layer is None:
        k_cache, v_cache, layer = k_cache[None], v_cache[None], 0
    b, _, h, d = q_b1hd.shape
    rows, c, kv = k_cache.shape[1:4]
    g = h // kv
    gp = max(MIN_BLOCK, 1 << (g - 1).bit_length())
    if block_k is None or splits is None:
        tiles = blocks_for(c)
        if tiles is None:
            raise ValueError(f"decode kernel: cache length {c} is not a multiple of {MIN_BLOCK}")
        block_k, splits = tiles
    if interpret is None:
        interpret = platform() != "gpu"
    q_bkgd = q_b1hd.reshape(b, kv, g, d).astype(k_cache.dtype)
    # Rows past the queries' (idle slots) and query heads past G (Triton's 16-row matmul) are
    # padding: a padded row sees no key, so its programs read nothing.
    q_bkgd = jnp.pad(q_bkgd, ((0, rows - b), (0, 0), (0, gp - g), (0, 0)))
    visible_bc = jnp.pad(visible_bc.astype(bool), ((0, rows - b), (0, 0)))
    layer_1 = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
    local = functools.partial(_local, block_k=block_k, splits=splits, interpret=interpret)
    out = decode_per_device(local, layer_1, q_bkgd, k_cache, v_cache, visible_bc)
    return out[:b, :, :g].reshape(b, 1, h, d).astype(q_b1hd.dtype)


def write_rows(
    cache: jax.Array, x_b1kd: jax.Array, index_b: jax.Array, layer: jax.Array | None = None
) -> jax.Array:
    """The cache `[Bc, C, K, D]` (or layer `layer` of a stacked `[L, Bc, C, K, D]`) with row
    b's position `index_b[b]` set to `x_b1kd[b, 0]` for the first B rows: one scatter, in place
    when the cache is donated or carried through a loop."""
    b = x_b1kd.shape[0]
    index_b = jnp.broadcast_to(jnp.asarray(index_b, jnp.int32), (b,))
    at = (jnp.arange(b), index_b) if layer is None else (layer, jnp.arange(b), index_b)
    return cache.at[at].set(
        x_b1kd[:, 0].astype(cache.dtype),
        indices_are_sorted=True,
        unique_indices=True,
        mode="promise_in_bounds",
    )

"""Decode attention that reads the KV cache where it lies: a Pallas (Mosaic) kernel for TPUs.

The contract of `decode_kernel.decode_attention` (the GPU kernel): one query token per row
against the engine's cache `[B, C, K, D]` (B rows, C positions, K KV heads, D head dim), or layer
`layer` of a stacked cache `[L, B, C, K, D]`, grouped-query (G = H / K query heads per KV head):

    out[b, k, g, :] = sum_s softmax_s(q[b, k, g] . key[b, s, k] / sqrt(D) | visible[b, s])
                      value[b, s, k, :]

accumulated in float32; any visibility mask `[B, C]` is exact and a row that sees no key
returns zeros.

Grid (row, position block). Scalar-prefetched into SMEM: each row's length n_b (its last
visible position + 1), the row its blocks are fetched from and the layer index. Program
(b, j) gets a block `[block_k, K, D]` of the row's keys and values: a contiguous slab of the
cache (the cache is not transposed, sliced or copied in the program; the block spans all K
heads because Mosaic tiles a block's last two dims, here the cache's (K, D)), and the block's
visibility `[1, block_k]`. The K heads are walked in the kernel: per head, logits
`[G', block_k]` of its G query heads (padded to G' sublanes) against the block, an online
softmax update of the running max m, sum l and output `[G', D]` held in VMEM scratch across the
row's blocks, with invisible keys weighted exactly 0. The output `[K, G', D]` is written on the
row's last grid step.

What is read: the K/V index maps clamp the block index to the row's last needed block
(ceil(n_b / block_k) - 1), so the pipeline, which skips a fetch whose block index equals the
previous step's, fetches each row's live blocks once and `pl.when` skips the compute past them.
A row that sees nothing (padding rows past the queries, idle slots) maps to the last block the
previous row fetched, so it reads no new keys either. Rows of the cache past B are such rows.

Cache lengths: `blocks_for` (a multiple of 128 positions, or one block of at most 512 that is a
multiple of 8; the mask's block is the minor dim of a `[B, 1, C]` view); on a TPU the head dim
must be a multiple of 128 (`supports`). The caller falls back to the XLA form elsewhere
(`transformer.in_place_decode`).

Off a TPU (tests, plans traced on this host for another platform) the kernel runs in Pallas
interpret mode. Under a mesh with logical axis rules it runs per device inside `jax.shard_map`
(rows as `act_batch`, heads as `act_kv_heads` say), as the GPU kernel does.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxrl.models.decode_kernel import platform
from jaxrl.models.kernel_sharding import decode_per_device

BLOCKS = (512, 256, 128)  # position-block sizes tried, largest first (the mask's lane tiles)
MAX_SINGLE_BLOCK = 512
VMEM_BUDGET = 8 * 1024 * 1024  # bytes of K/V blocks in flight (2 operands, double-buffered)


def blocks_for(length: int) -> int | None:
    """The largest position block for a cache of `length` positions: a multiple of 128 that
    divides it, else the whole cache when it is at most 512 positions and a multiple of 8; None
    where the kernel cannot tile it."""
    for block in BLOCKS:
        if length % block == 0:
            return block
    if length <= MAX_SINGLE_BLOCK and length % 8 == 0:
        return length
    return None


def supports(length: int, head_dim: int) -> bool:
    """Whether the kernel reads a cache of `length` positions in place: `blocks_for` tiles it
    and, in a program for a TPU, the head dim is whole 128-lane tiles (XLA lays a cache with
    narrower heads out with another minor axis, and feeding the kernel's `[block_k, K, D]`
    blocks would copy the cache every step)."""
    return blocks_for(length) is not None and (platform() != "tpu" or head_dim % 128 == 0)


def _block_for(length: int, kv: int, d: int, itemsize: int) -> int:
    """`blocks_for`, halved while the K/V blocks in flight (sublane-padded heads) pass the VMEM
    budget."""
    block = blocks_for(length)
    if block is None:
        raise ValueError(f"TPU decode kernel: cannot tile a cache of {length} positions")
    sublanes = 8 * max(1, 4 // itemsize)
    padded_kv = -(-kv // sublanes) * sublanes
    while block > 128 and block % 256 == 0 and 4 * block * padded_kv * d * itemsize > VMEM_BUDGET:
        block //= 2
    return block


def _kernel(len_ref, src_ref, layer_ref, q_ref, k_ref, v_ref, vis_ref, o_ref, m_scr, l_scr,
            acc_scr, *, block_k, scale, heads):  # fmt: skip
    """Program (row b, block j): q `[K, G', D]`, keys / values `[block_k, K, D]`, visibility
    `[1, block_k]`; scratch m, l `[K, G', 1]` and the unnormalized output `[K, G', D]`."""
    del src_ref, layer_ref  # used by the index maps
    b, j = pl.program_id(0), pl.program_id(1)
    f32 = jnp.float32
    low = jnp.finfo(f32).min

    @pl.when(j == 0)
    def _init():
        m_scr[...] = jnp.full(m_scr.shape, low, f32)
        l_scr[...] = jnp.zeros(l_scr.shape, f32)
        acc_scr[...] = jnp.zeros(acc_scr.shape, f32)

    @pl.when(j * block_k < len_ref[b])
    def _step():
        visible = vis_ref[...] != 0  # [1, block_k]
        for h in range(heads):
            q = q_ref[h]  # [G', D]
            # [block_k, D] (one KV head: the cache's unit head axis is squeezed by `_local`)
            k = k_ref[...] if k_ref.ndim == 2 else k_ref[:, h, :]
            v = v_ref[...] if v_ref.ndim == 2 else v_ref[:, h, :]
            logits = jax.lax.dot_general(
                q, k, (((1,), (1,)), ((), ())), preferred_element_type=f32
            ) * f32(scale)
            logits = jnp.where(visible, logits, low)
            m_prev, l_prev = m_scr[h], l_scr[h]
            m_next = jnp.maximum(m_prev, logits.max(axis=1, keepdims=True))
            correction = jnp.exp(m_prev - m_next)
            p = jnp.where(visible, jnp.exp(logits - m_next), 0.0)
            l_scr[h] = correction * l_prev + p.sum(axis=1, keepdims=True)
            acc_scr[h] = correction * acc_scr[h] + jax.lax.dot_general(
                p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=f32
            )
            m_scr[h] = m_next

    @pl.when(j == pl.num_programs(1) - 1)
    def _finish():
        total = l_scr[...]
        o_ref[...] = acc_scr[...] / jnp.where(total > 0, total, 1.0)


def _heads(dims: tuple, kv: int) -> tuple:
    """A K/V block shape or index with the head axis (second-minor) dropped for one KV head."""
    return dims if kv > 1 else dims[:-2] + dims[-1:]


def _local(layer_1, q_bkgd, k_cache, v_cache, visible_bc, *, block_k, interpret):
    """The kernel over this device's rows and heads; `k_cache` / `v_cache` `[L, Bc, C, K, D]`
    or `[Bc, C, K, D]`, q `[Bc, K, G', D]`, visibility `[Bc, C]`."""
    rows, kv, gp, d = q_bkgd.shape
    stacked = k_cache.ndim == 5
    c = k_cache.shape[-3]
    if kv == 1:
        # One KV head: XLA lays a unit head axis out as a major one, so the cache is viewed
        # `[.., C, D]` (a bitcast); a `[block_k, 1, D]` block would make XLA copy the cache into
        # the kernel's layout.
        k_cache, v_cache = k_cache[..., 0, :], v_cache[..., 0, :]
    positions = jnp.arange(1, c + 1, dtype=jnp.int32)
    length_b = jnp.max(jnp.where(visible_bc, positions[None, :], 0), axis=1).astype(jnp.int32)
    # The row whose blocks a row's programs are pointed at: itself when it sees a key, else the
    # last such row before it (its last block stays in place: no fetch).
    live_row = jnp.where(length_b > 0, jnp.arange(rows, dtype=jnp.int32), -1)
    src_b = jnp.maximum(jax.lax.cummax(live_row), 0)

    def block(b, j, len_ref, src_ref):
        src = src_ref[b]
        last = jnp.maximum(pl.cdiv(len_ref[src], block_k) - 1, 0)
        return src, jnp.where(len_ref[b] > 0, jnp.minimum(j, last), last)

    if stacked:

        def kv_map(b, j, len_ref, src_ref, layer_ref):
            src, blk = block(b, j, len_ref, src_ref)
            return _heads((layer_ref[0], src, blk, 0, 0), kv)

        kv_block = _heads((None, None, block_k, kv, d), kv)
    else:

        def kv_map(b, j, len_ref, src_ref, layer_ref):
            src, blk = block(b, j, len_ref, src_ref)
            return _heads((src, blk, 0, 0), kv)

        kv_block = _heads((None, block_k, kv, d), kv)

    def vis_map(b, j, len_ref, src_ref, layer_ref):
        src, blk = block(b, j, len_ref, src_ref)
        return src, 0, blk

    f32 = jnp.float32
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(rows, c // block_k),
        in_specs=[
            pl.BlockSpec((None, kv, gp, d), lambda b, j, *_: (b, 0, 0, 0)),
            pl.BlockSpec(kv_block, kv_map),
            pl.BlockSpec(kv_block, kv_map),
            pl.BlockSpec((None, 1, block_k), vis_map),
        ],
        out_specs=pl.BlockSpec((None, kv, gp, d), lambda b, j, *_: (b, 0, 0, 0)),
        scratch_shapes=[
            pltpu.VMEM((kv, gp, 1), f32),
            pltpu.VMEM((kv, gp, 1), f32),
            pltpu.VMEM((kv, gp, d), f32),
        ],
    )
    kernel = functools.partial(_kernel, block_k=block_k, scale=d**-0.5, heads=kv)
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((rows, kv, gp, d), f32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="decode_attention_in_place_tpu",
    )(
        length_b,
        src_b,
        layer_1,
        q_bkgd,
        k_cache,
        v_cache,
        visible_bc.astype(jnp.int32)[:, None, :],
    )


def decode_attention(
    q_b1hd: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    visible_bc: jax.Array,
    *,
    layer: jax.Array | None = None,
    interpret: bool | None = None,
    block_k: int | None = None,
) -> jax.Array:
    """Attention `[B, 1, H, D]` of one query per row over the cache `[Bc, C, K, D]` (Bc >= B:
    rows past B are not read), or over layer `layer` of a stacked cache `[L, Bc, C, K, D]`,
    where `visible_bc[b, s]` (`[B, C]`); float32 accumulation, the output in q's dtype.
    `interpret`: Pallas interpret mode (default: off a TPU). `block_k`: positions per block
    (default `blocks_for`, within a VMEM budget; it must divide C)."""
    b, _, h, d = q_b1hd.shape
    rows, c, kv = k_cache.shape[-4:-1]
    g = h // kv
    itemsize = jnp.dtype(k_cache.dtype).itemsize
    if block_k is None:
        block_k = _block_for(c, kv, d, itemsize)
    if c % block_k:
        raise ValueError(f"TPU decode kernel: block_k {block_k} does not divide {c} positions")
    if interpret is None:
        interpret = platform() != "tpu"
    # Query heads padded to whole sublanes (8 float32 rows, 16 bf16); padded rows (idle slots
    # past the queries) see no key, so their programs fetch and compute nothing.
    sublanes = 8 * max(1, 4 // itemsize)
    gp = max(sublanes, 1 << (g - 1).bit_length())
    q_bkgd = q_b1hd.reshape(b, kv, g, d).astype(k_cache.dtype)
    q_bkgd = jnp.pad(q_bkgd, ((0, rows - b), (0, 0), (0, gp - g), (0, 0)))
    visible_bc = jnp.pad(visible_bc.astype(bool), ((0, rows - b), (0, 0)))
    layer_1 = jnp.reshape(jnp.asarray(0 if layer is None else layer, jnp.int32), (1,))
    local = functools.partial(_local, block_k=block_k, interpret=interpret)
    out = decode_per_device(local, layer_1, q_bkgd, k_cache, v_cache, visible_bc)
    return out[:b, :, :g].reshape(b, 1, h, d).astype(q_b1hd.dtype)

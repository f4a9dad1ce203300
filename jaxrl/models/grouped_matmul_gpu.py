"""The mixture-of-experts grouped matmul for NVIDIA GPUs: Pallas kernels on the Triton backend,
forward and both gradients (`jax.custom_vjp`).

Maths. The M rows of `x_mk` lie in contiguous groups (global offsets `o`, `o[0] = 0`, group g
the rows `[o[g], o[g + 1])`); `w_gkn` holds the matrices of groups `first ... first + G - 1`
(all of them when `first` is 0 and G the number of groups):

    y[r, :]  = x[r, :] @ w[g(r) - first]       r in a held group, else 0       (gmm)
    dx[r, :] = dy[r, :] @ w[g(r) - first]^T    the same kernel, w read transposed
    dw[g]    = sum over r in group first + g of x[r, :]^T dy[r, :]              (tgmm)

which is `jax.lax.ragged_dot(x, w, sizes)` and its gradients when every group is held.

Kernels (grid programs independent: each output block written by one program, no atomics):

- `gmm`, grid (row tile, N / block_n): the rows cut into `tile`-row tiles; a tile's groups (the
  first and the number of held groups its rows touch, `_tile_groups`: computed outside the
  kernel from the offsets) decide its path. A tile within one group: one product of the tile
  with the group's matrix, read directly from `w` (its `[K, block_n]` column block, `block_k`
  rows at a time), rows outside the group (padding, groups not held) zeroed. A tile that
  groups share: its `SUB` (16)-row blocks one after another, each multiplied by the matrix of
  every group its rows reach, masked to the group's rows and added. Work: at most
  `2 (M + (G - 1) SUB) K N` FLOPs (a group edge costs up to one 16-row block of another
  group's rows; an empty group between two others inside one block a masked product), against
  the `tiled` XLA form's `2 (M + (G - 1) tile) K N` and its gathered `[visits, K, N]` weights.
- `tgmm`, grid (G, K / block_k, N / block_n): a group's program loops over the row tiles its
  rows reach, `acc += x_tile^T dy_tile`; a tile the group shares in `SUB`-row blocks, only
  those that reach the group, rows outside it masked to zero. An empty group writes zeros.

Padding: M to a multiple of the tile (zero rows outside every group), K and N to multiples of
their blocks (zeros), outside the custom VJP, so JAX differentiates the pads and slices.
Triton's dot needs every dimension >= 16: tiles and blocks are powers of two >= 16.

Precision: the dots take the inputs' dtype (bf16 in training) and accumulate in fp32; the
outputs are in x's dtype (`tgmm`: w's). fp32 inputs multiply in TF32 on the GPU (Triton's
default, as XLA's), exactly in interpret mode.

`interpret=True` runs the same kernels in Pallas interpret mode (any backend: how the CPU tests
check them against `jax.lax.ragged_dot`). `jaxrl.infra.hlo_cost` models the kernels' calls by
their names (`grouped_matmul_gpu`, `grouped_matmul_gpu_t`, `grouped_matmul_gpu_tgmm`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

MIN_BLOCK = 16  # Triton's dot needs every dim >= 16
SUB = MIN_BLOCK  # rows per block of a tile that two groups share
BLOCK_K, BLOCK_N = 64, 128  # contraction and output-column blocks (clipped to the dims)
TILE = 128  # rows per tile at most (`tile` argument)
NAMES = ("grouped_matmul_gpu", "grouped_matmul_gpu_t", "grouped_matmul_gpu_tgmm")


@dataclasses.dataclass(frozen=True)
class _Config:
    tile: int
    block_k: int
    block_n: int
    num_warps: int
    num_stages: int
    interpret: bool


def _pow2_at_least(n: int, least: int = MIN_BLOCK) -> int:
    return max(least, 1 << max(n - 1, 0).bit_length())


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _tile_groups(offsets, first, held: int, rows: int, tile: int):
    """`(lo, count)` per row tile (int32 `[rows / tile]`): the first held group (index into the
    held groups) whose rows the tile reaches and how many consecutive held groups it visits (0:
    none of its rows is in a held group)."""
    ends = lax.dynamic_slice_in_dim(offsets, first + 1, held)  # ends of the held groups
    begin = offsets[first]
    tiles = rows // tile
    top = jnp.arange(tiles, dtype=jnp.int32) * tile
    bottom = top + tile - 1
    lo = jnp.searchsorted(ends, top, side="right").astype(jnp.int32)
    hi = jnp.minimum(jnp.searchsorted(ends, bottom, side="right"), held - 1).astype(jnp.int32)
    reached = (bottom >= begin) & (top < ends[-1])
    return lo, jnp.where(reached, jnp.maximum(hi - lo + 1, 0), 0).astype(jnp.int32)


def _gmm_kernel(
    lo_ref, count_ref, offsets_ref, first_ref, x_ref, w_ref, y_ref,
    *, tile, block_k, contraction, transpose,
):  # fmt: skip
    i = pl.program_id(0)
    first = first_ref[0]
    lo, count = lo_ref[i], count_ref[i]
    width = y_ref.shape[1]

    def product(top, size, g):
        """Rows `[top, top + size)` of the tile times held group g's matrix, fp32, rows outside
        the group zero."""

        def block(c, part):
            cols = pl.ds(c * block_k, block_k)
            a = x_ref[pl.ds(top, size), cols]
            if transpose:  # w [G, N_out, K_in]: the block [block_n, block_k], transposed
                return part + plgpu.dot(a, w_ref[g, :, cols], trans_b=True)
            return part + plgpu.dot(a, w_ref[g, cols, :])

        part = lax.fori_loop(
            0, contraction // block_k, block, jnp.zeros((size, width), jnp.float32)
        )
        rows = i * tile + top + jnp.arange(size)
        inside = (rows >= offsets_ref[first + g]) & (rows < offsets_ref[first + g + 1])
        return jnp.where(inside[:, None], part, 0.0)

    @pl.when(count == 0)
    def _():
        y_ref[...] = jnp.zeros(y_ref.shape, y_ref.dtype)

    @pl.when(count == 1)
    def _():
        y_ref[...] = product(0, tile, lo).astype(y_ref.dtype)

    @pl.when(count > 1)
    def _():  # groups share the tile: SUB-row blocks, each through the groups it reaches
        def sub(s, carry):
            top = s * SUB
            first_row = i * tile + top

            def before(n, g):  # the tile's groups ending before this block
                return g + (offsets_ref[first + lo + n + 1] <= first_row).astype(jnp.int32)

            def reaches(state):
                g, _ = state
                return (g < lo + count) & (offsets_ref[first + g] < first_row + SUB)

            def add(state):
                g, acc = state
                return g + 1, acc + product(top, SUB, g)

            g0 = lax.fori_loop(0, count, before, lo)
            zeros = jnp.zeros((SUB, width), jnp.float32)
            _, acc = lax.while_loop(reaches, add, (g0, zeros))
            y_ref[pl.ds(top, SUB), :] = acc.astype(y_ref.dtype)
            return carry

        lax.fori_loop(0, tile // SUB, sub, 0)


def _tgmm_kernel(offsets_ref, first_ref, x_ref, dy_ref, dw_ref, *, tile):
    g = pl.program_id(0)
    first = first_ref[0]
    start, end = offsets_ref[first + g], offsets_ref[first + g + 1]
    top = start // tile
    tiles = jnp.where(end > start, (end - 1) // tile - top + 1, 0)

    def rows_product(acc, row, size):  # acc + x^T dy over rows [row, row + size) of the group
        span = pl.ds(row, size)
        rows = row + jnp.arange(size)
        inside = ((rows >= start) & (rows < end))[:, None]
        x = x_ref[span, :]
        x = jnp.where(inside, x, jnp.zeros_like(x))
        return acc + plgpu.dot(x, dy_ref[span, :], trans_a=True)

    def body(n, acc):
        t = top + n
        whole = (t * tile >= start) & ((t + 1) * tile <= end)

        def partly(acc):  # a tile the group shares: its SUB-row blocks that reach the group
            low = (jnp.maximum(start, t * tile) - t * tile) // SUB
            high = (jnp.minimum(end, (t + 1) * tile) - 1 - t * tile) // SUB
            sub = lambda s, acc: rows_product(acc, t * tile + s * SUB, SUB)  # noqa: E731
            return lax.fori_loop(low, high + 1, sub, acc)

        return lax.cond(whole, lambda acc: rows_product(acc, t * tile, tile), partly, acc)

    acc = lax.fori_loop(0, tiles, body, jnp.zeros(dw_ref.shape, jnp.float32))
    dw_ref[...] = acc.astype(dw_ref.dtype)


def _params(cfg: _Config):
    return plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _gmm(x, w, offsets, first, cfg: _Config, transpose: bool = False):
    """`[M, C] x w -> [M, O]`: w `[G, C, O]`, or `[G, O, C]` read transposed."""
    m, c = x.shape
    o = w.shape[1] if transpose else w.shape[2]
    g = w.shape[0]
    block_out = cfg.block_k if transpose else cfg.block_n  # K (dx) or N (y) columns out
    block_in = cfg.block_n if transpose else cfg.block_k
    lo, count = _tile_groups(offsets, first[0], g, m, cfg.tile)
    if transpose:
        w_spec = pl.BlockSpec((g, block_out, c), lambda i, j: (0, j, 0))
    else:
        w_spec = pl.BlockSpec((g, c, block_out), lambda i, j: (0, 0, j))
    kernel = functools.partial(
        _gmm_kernel, tile=cfg.tile, block_k=block_in, contraction=c, transpose=transpose
    )
    vector = lambda n: pl.BlockSpec((n,), lambda i, j: (0,))  # noqa: E731
    return pl.pallas_call(
        kernel,
        grid=(m // cfg.tile, o // block_out),
        in_specs=[
            vector(lo.shape[0]),
            vector(lo.shape[0]),
            vector(offsets.shape[0]),
            vector(1),
            pl.BlockSpec((cfg.tile, c), lambda i, j: (i, 0)),
            w_spec,
        ],
        out_specs=pl.BlockSpec((cfg.tile, block_out), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((m, o), x.dtype),
        compiler_params=_params(cfg),
        interpret=cfg.interpret,
        name=NAMES[1] if transpose else NAMES[0],
    )(lo, count, offsets, first, x, w)


def _tgmm(x, dy, offsets, first, groups: int, cfg: _Config, dtype):
    """`[G, K, N]`: per held group, the sum over its rows of `x^T dy`."""
    m, k = x.shape
    n = dy.shape[1]
    bk, bn = cfg.block_k, cfg.block_n
    return pl.pallas_call(
        functools.partial(_tgmm_kernel, tile=cfg.tile),
        grid=(groups, k // bk, n // bn),
        in_specs=[
            pl.BlockSpec((offsets.shape[0],), lambda g, a, b: (0,)),
            pl.BlockSpec((1,), lambda g, a, b: (0,)),
            pl.BlockSpec((m, bk), lambda g, a, b: (0, a)),
            pl.BlockSpec((m, bn), lambda g, a, b: (0, b)),
        ],
        out_specs=pl.BlockSpec((None, bk, bn), lambda g, a, b: (g, a, b)),
        out_shape=jax.ShapeDtypeStruct((groups, k, n), dtype),
        compiler_params=_params(cfg),
        interpret=cfg.interpret,
        name=NAMES[2],
    )(offsets, first, x, dy)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _grouped(x, w, offsets, first, cfg: _Config):
    return _gmm(x, w, offsets, first, cfg)


def _grouped_fwd(x, w, offsets, first, cfg: _Config):
    return _gmm(x, w, offsets, first, cfg), (x, w, offsets, first)


def _grouped_bwd(cfg: _Config, residuals, dy):
    x, w, offsets, first = residuals
    dy = dy.astype(x.dtype)
    dx = _gmm(dy, w, offsets, first, cfg, transpose=True)
    dw = _tgmm(x, dy, offsets, first, w.shape[0], cfg, w.dtype)
    return dx, dw, None, None


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def gmm(
    x_mk: jax.Array,
    w_gkn: jax.Array,
    group_sizes: jax.Array,
    *,
    first=None,
    tile: int = TILE,
    block_k: int = BLOCK_K,
    block_n: int = BLOCK_N,
    num_warps: int | None = None,
    num_stages: int = 2,
    interpret: bool = False,
) -> jax.Array:
    """`[M, K] x [G, K, N] -> [M, N]` in x's dtype: each contiguous group of rows
    (`group_sizes`, int `[G_all]`) times its group's matrix, differentiable in x and w (the
    module docstring). `w_gkn` holds groups `first, first + 1, ...` (`first` None: 0, and then
    G may be the number of groups): rows of the other groups are zeros, as in
    `grouped_matmul.tiled`. `tile`: rows per tile (a power of two >= 16; clipped to M's)."""
    m, k = x_mk.shape
    g, _, n = w_gkn.shape
    for name, size in (("tile", tile), ("block_k", block_k), ("block_n", block_n)):
        if size < MIN_BLOCK or size & (size - 1):
            raise ValueError(f"grouped_matmul_gpu.gmm: {name}={size} must be a power of two >= 16")
    tile = min(tile, _pow2_at_least(m))
    block_k = min(block_k, _pow2_at_least(k))
    block_n = min(block_n, _pow2_at_least(n))
    warps = num_warps or (8 if tile * max(block_n, block_k) >= 128 * 128 else 4)
    cfg = _Config(tile, block_k, block_n, warps, num_stages, interpret)
    dtype = jnp.result_type(x_mk.dtype, w_gkn.dtype)
    sizes = group_sizes.astype(jnp.int32)
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(sizes, dtype=jnp.int32)])
    first = jnp.zeros((1,), jnp.int32) if first is None else jnp.reshape(first, (1,))
    m_pad, k_pad, n_pad = _round_up(m, tile), _round_up(k, block_k), _round_up(n, block_n)
    x, w = x_mk.astype(dtype), w_gkn.astype(dtype)
    if (m_pad, k_pad) != (m, k):  # no copy of x (or of w below) where nothing is padded
        x = jnp.pad(x, ((0, m_pad - m), (0, k_pad - k)))
    if (k_pad, n_pad) != (k, n):
        w = jnp.pad(w, ((0, 0), (0, k_pad - k), (0, n_pad - n)))
    y = _grouped(x, w, offsets, first.astype(jnp.int32), cfg)
    if (m_pad, n_pad) != (m, n):
        y = y[:m, :n]
    return y.astype(x_mk.dtype)

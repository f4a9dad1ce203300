"""Grouped matmuls for the mixture-of-experts layers (`jaxrl.models.moe`), by the platform a
program is compiled for.

`grouped_matmul(x_mk, w_gkn, group_sizes_g)`: the rows of `x_mk` lie in G contiguous groups
(`group_sizes_g`, summing to M), and each group is multiplied by its own matrix,

    out[r, :] = x[r, :] @ w[g(r), :, :]        g(r): the group of row r

which is `jax.lax.ragged_dot(x_mk, w_gkn, group_sizes_g)`. How it runs:

- **CPU** (and any program whose attention does not trace to a kernel form,
  `attention_forms.kernel_platform()` None): `jax.lax.ragged_dot`, as before (JAX lowers it for
  the CPU as a masked dense product: tiny models only).
- **TPU** ("auto" in a TPU program, or the "pallas_tpu" form): the Pallas Mosaic megablox
  kernels (`jax.experimental.pallas.ops.tpu.megablox`): `gmm` (forward, and the gradient of x
  with the weights transposed in the kernel) and `tgmm` (the weights' gradient, one `[K, N]`
  block per group), through megablox's custom VJP; Pallas interpret mode off a TPU (how the CPU
  tests check them). XLA:TPU compiles `ragged_dot`'s weights' gradient densely (every row
  through every group: G = 128 times its work; 43x for forward and both gradients together),
  which the kernels avoid. Row tiles by `tile_rows`.
- **GPU** ("auto" in a GPU program, or the "pallas_gpu" form): the Pallas Triton kernels of
  `jaxrl.models.grouped_matmul_gpu` (forward, the gradient of x with the weights read
  transposed, the weights' gradient per group; its custom VJP), each row tile multiplied by its
  group's matrix read in the kernel (a tile that two groups share visited once per group, rows
  of the other group masked): exact, nothing gathered, at most `(M + (G - 1) tile) / M` times
  the grouped work (tile `tile_rows(M, G, TILE_TRITON)`); Pallas interpret mode off a GPU.
  Dtypes the kernels do not take (not bf16 / f16 / f32) run `tiled`, plain XLA over row tiles
  that each belong to one group (a batched matmul against the tiles' gathered matrices,
  `[visits, K, N]`): exact, the same bound of work. XLA:GPU compiles `jax.lax.ragged_dot` and
  its gradient densely (every row masked against every group: `[G, M, K]` intermediates, G
  times the work); its `xla_gpu_experimental_use_ragged_dot_*` flags changed nothing
  deviceless, and JAX's Mosaic GPU grouped-matmul kernels cannot trace the weights' gradient
  without a GPU attached. docs/scale.md ("Mixture of experts") has the figures.

Sharded (installed logical-axis rules and a mesh, `jaxrl.infra.sharding`), the kernel runs per
device (`jax.shard_map`; the partitioner cannot split a kernel call; `_per_device`): the rows
split as `act_batch` says (the rows are in group order, so a device's rows are a contiguous
range: its group sizes are the global ones clipped to that range); groups split over the rows'
axes gathered (the trainer: experts and batch over fsdp, gathered layer by layer as FSDP
gathers dense weights), groups split over other axes kept split (the generator: experts over
tp; each device multiplies its own groups' rows, the results added); K and N split as `w_axes`
say (a split K gives partial sums, added). Exact: no row is dropped or padded into another
group's result.

`routed_experts` is `MoEMLP._experts` with each device sorting its own tokens (the global sort
makes every device gather the whole micro-batch's sorted rows under FSDP: docs/scale.md,
"Mixture of experts"); the model uses it in GPU and TPU programs in the trainer's layout
(`routes_per_device`: experts gathered on every device). CPU programs and the generator's
layout (experts split over tp) keep the global sort.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax.core import spmd as flax_spmd

from jaxrl.infra import sharding as ax
from jaxrl.models import attention_forms

# Tile sizes (rows, contraction, output columns) of the megablox kernels, each clipped to its
# dimension: up to 512 rows (`tile_rows`), 1024-wide blocks of K and N (Qwen3-30B-A3B's
# 2048 x 768 experts: two blocks of K, one of N).
TILE_M, TILE_K, TILE_N = 512, 1024, 1024
TILE_ROWS = 256  # rows per tile of the `tiled` form (GPU dtypes the Triton kernels do not take)
TILE_TRITON = 128  # rows per tile of the Triton kernels (GPU) at most
_SUBLANES = 16  # a tile of rows is a multiple of this (bf16 packs 16 rows in a TPU vreg)

WEIGHT_AXES = (ax.EXPERTS, ax.EXPERT_EMBED, ax.EXPERT_MLP)


def grouped_matmul(
    x_mk: jax.Array,
    w_gkn: jax.Array,
    group_sizes_g: jax.Array,
    *,
    w_axes: tuple[str | None, str | None, str | None] = WEIGHT_AXES,
    platform: str | None = "auto",
) -> jax.Array:
    """`[M, K] x [G, K, N] -> [M, N]`: each contiguous group of rows times its group's matrix
    (`jax.lax.ragged_dot`'s result, in x's dtype). `w_axes`: the logical axes of `w_gkn` (for
    the per-device split under installed rules). `platform`: "auto" (the platform the program
    traced now is compiled for, `attention_forms.kernel_platform`), "tpu" (megablox; interpret
    mode off a TPU), "gpu" (`tiled`), or None / "cpu" (`ragged_dot`)."""
    if platform == "auto":
        platform = attention_forms.kernel_platform()
    group_sizes_g = group_sizes_g.astype(jnp.int32)
    if platform == "tpu" and megablox_supports(x_mk.dtype, w_gkn.dtype):
        interpret = attention_forms.decode_kernel.platform() != "tpu"
        local = lambda x, w, g, first: megablox(x, w, g, interpret=interpret, first=first)  # noqa: E731
    elif platform == "gpu":
        local = _gpu_local(x_mk.dtype, w_gkn.dtype)
    else:
        return jax.lax.ragged_dot(x_mk, w_gkn, group_sizes_g)
    return _per_device(local, x_mk, w_gkn, group_sizes_g, w_axes)


def triton_supports(*dtypes) -> bool:
    """Whether the Triton kernels (`grouped_matmul_gpu`) multiply these dtypes (bfloat16,
    float16 and float32; others take the `tiled` form)."""
    floats = (jnp.bfloat16, jnp.float16, jnp.float32)
    return all(jnp.dtype(d) in tuple(map(jnp.dtype, floats)) for d in dtypes)


def _gpu_local(*dtypes):
    """`local(x, w, group_sizes, first)` of a GPU program: the Triton kernels
    (`grouped_matmul_gpu.gmm`, interpret mode off a GPU) at `tile_rows(M, G, TILE_TRITON)`, or
    `tiled` for dtypes they do not take."""
    if not triton_supports(*dtypes):
        return lambda x, w, g, first: tiled(  # noqa: E731
            x, w, g, tile=tile_rows(x.shape[0], g.shape[0]), first=first
        )
    from jaxrl.models import grouped_matmul_gpu

    interpret = attention_forms.decode_kernel.platform() != "gpu"

    def local(x, w, g, first):
        tile = tile_rows(x.shape[0], g.shape[0], TILE_TRITON)
        return grouped_matmul_gpu.gmm(x, w, g, first=first, tile=tile, interpret=interpret)

    return local


def tile_rows(m: int, groups: int, most: int = TILE_ROWS) -> int:
    """Rows per tile for `m` rows in `groups` groups (the `tiled` form; megablox's row tile with
    `most=TILE_M`): the largest power of two at most `m / (8 groups)` (the tiles that groups
    share then add at most an eighth of the rows), 16 to `most`. Smaller tiles fetch each
    group's matrix more often; larger ones multiply more rows that belong to another group (a
    decode step's 512 rows in 512-row tiles: every expert's tile, 32x the rows)."""
    tile = 1 << max(int(m // (8 * groups)).bit_length() - 1, 0)
    return int(min(max(tile, _SUBLANES), most))


def megablox_supports(*dtypes) -> bool:
    """Whether megablox multiplies these dtypes (bfloat16 and float32 only)."""
    return all(jnp.dtype(d) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)) for d in dtypes)


def megablox(x_mk, w_gkn, group_sizes_g, *, interpret: bool = False, first=None) -> jax.Array:
    """The megablox grouped matmul (differentiable: megablox's `gmm` / `tgmm` VJP) on one
    device's rows. M is padded to a multiple of the row tile with zero rows counted into the
    last group (they add nothing to its weights' gradient) and cut off. `w_gkn` may hold groups
    `first, first + 1, ...` only (megablox's `group_offset`): rows of the others are zeros."""
    from jax.experimental.pallas.ops.tpu.megablox import ops

    m, k = x_mk.shape
    n = w_gkn.shape[2]
    tm = min(tile_rows(m, group_sizes_g.shape[0], TILE_M), _round_up(m, _SUBLANES))
    pad = _round_up(m, tm) - m
    if pad:
        x_mk = jnp.pad(x_mk, ((0, pad), (0, 0)))
        group_sizes_g = group_sizes_g.at[-1].add(pad)
    tiling = (tm, min(TILE_K, k), min(TILE_N, n))
    dtype = jnp.result_type(x_mk.dtype, w_gkn.dtype)
    with jax.named_scope("grouped_matmul"):
        out = ops.gmm(
            x_mk.astype(dtype), w_gkn.astype(dtype), group_sizes_g, dtype, tiling,
            None if first is None else jnp.asarray(first, jnp.int32), None, False, interpret,
        )  # fmt: skip
    return out[:m].astype(x_mk.dtype)


def tiled(x_mk, w_gkn, group_sizes_g, *, tile: int = TILE_ROWS, first=0) -> jax.Array:
    """The grouped matmul in plain XLA over row tiles that each belong to one group: the rows
    cut into `tile`-row tiles, a tile that two groups share visited once per group (at most
    `M / tile + G - 1` visits), each visit's rows outside its group masked to zero, then one
    batched matmul of the visits against their groups' matrices (gathered, `[visits, K, N]`)
    and a scatter-add of the results into the rows. Exact (the masked rows add zeros), with
    `2 (M + (G - 1) tile) K N` FLOPs at most, not the dense form's `2 G M K N`; differentiable
    as any XLA program (the gathers' transposes add the visits' products into x's rows and
    the groups' matrices). `w_gkn` may hold groups `first, first + 1, ...` of `group_sizes_g`
    only (experts split over devices): rows of the other groups are zeros."""
    m, k = x_mk.shape
    g, _, n = w_gkn.shape
    tiles = -(-m // tile)
    visits = tiles + g - 1
    first = 0 if first is None else first
    ends = jax.lax.dynamic_slice_in_dim(jnp.cumsum(group_sizes_g), first, g)
    starts = ends - jax.lax.dynamic_slice_in_dim(group_sizes_g, first, g)
    group_sizes_g = ends - starts
    first = starts // tile
    count = jnp.where(group_sizes_g > 0, (ends - 1) // tile - first + 1, 0)
    before = jnp.cumsum(count) - count  # visits of the groups before each group
    v = jnp.arange(visits)
    group = jnp.clip(jnp.searchsorted(before + count, v, side="right"), 0, g - 1)
    valid = v < jnp.sum(count)
    tile_of = jnp.where(valid, first[group] + v - before[group], 0)
    rows_vt = tile_of[:, None] * tile + jnp.arange(tile)[None, :]  # [visits, tile]
    inside = valid[:, None] & (rows_vt >= starts[group][:, None]) & (rows_vt < ends[group][:, None])
    x_pad = jnp.pad(x_mk, ((0, tiles * tile - m), (0, 0)))
    x_vtk = jnp.where(inside[..., None], jnp.take(x_pad, rows_vt, axis=0), 0)
    w_vkn = jnp.take(w_gkn, group, axis=0)
    y_vtn = jnp.einsum("vtk,vkn->vtn", x_vtk, w_vkn, preferred_element_type=jnp.float32)
    y_vtn = jnp.where(inside[..., None], y_vtn, 0).astype(x_mk.dtype)
    out = (
        jnp.zeros((tiles * tile, n), x_mk.dtype)
        .at[rows_vt.reshape(-1)]
        .add(y_vtn.reshape(-1, n), indices_are_sorted=True)
    )
    return out[:m]


def local_group_sizes(group_sizes_g: jax.Array, start, rows: int) -> jax.Array:
    """The sizes of the groups within rows `[start, start + rows)` of rows in group order: each
    global group clipped to the range (they sum to `rows` when the global sizes sum to the
    whole)."""
    ends = jnp.cumsum(group_sizes_g)
    starts = ends - group_sizes_g
    clip = lambda v: jnp.clip(v, start, start + rows)  # noqa: E731
    return (clip(ends) - clip(starts)).astype(jnp.int32)


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _mapped(logical: str | None, size: int, rules, mesh) -> tuple[str, ...]:
    """The mesh axes `logical` maps to under `rules`, () where none or where they do not divide
    `size`."""
    if logical is None:
        return ()
    (target,) = ax.logical_to_pspec((logical,), rules)
    names = (target,) if isinstance(target, str) else tuple(target or ())
    if not names or size % math.prod(mesh.shape[n] for n in names):
        return ()
    return names


def _per_device(local, x_mk, w_gkn, group_sizes_g, w_axes) -> jax.Array:
    """`local(x, w, group_sizes, first)` on each device's shard, directly without rules or a
    mesh. The rows split as `act_batch` says (each device's group sizes clipped to its rows);
    the matrices split along K and N as `w_axes` say (a split K: each device's partial sum,
    added outside the `shard_map`, which keeps the gradient plain). Groups split over mesh axes
    that do not split the rows (the generator's experts over tp, its rows over dp) stay split:
    each device multiplies the rows of its own groups (`first`: its first group; zeros for the
    other rows) and the devices' results are added. Groups split over the rows' axes (the
    trainer's experts and batch over fsdp) are gathered: every device holds every group."""
    rules = flax_spmd.get_logical_axis_rules()
    mesh = jax.sharding.get_abstract_mesh()
    if not rules or mesh.empty:
        return local(x_mk, w_gkn, group_sizes_g, None)
    m, k = x_mk.shape
    g, _, n = w_gkn.shape
    k_axes = _mapped(w_axes[1], k, rules, mesh)
    n_axes = _mapped(w_axes[2], n, rules, mesh)
    taken = k_axes + n_axes
    rows = tuple(a for a in _mapped(ax.ACT_BATCH, m, rules, mesh) if a not in taken)
    groups = _mapped(w_axes[0], g, rules, mesh)
    if not groups or set(groups) & set(rows + taken):
        groups = ()
    spec = lambda *axes: jax.sharding.PartitionSpec(*(a or None for a in axes))  # noqa: E731

    def body(x, w, sizes):
        if rows:
            r = x.shape[0]
            sizes = local_group_sizes(sizes, jax.lax.axis_index(rows) * r, r)
        first = jax.lax.axis_index(groups) * w.shape[0] if groups else None
        return local(x, w, sizes, first)[None]  # a partial sum where K or the groups are split

    partial = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(spec(rows, k_axes), spec(groups, k_axes, n_axes), spec(None)),
        out_specs=spec(groups + k_axes, rows, n_axes),
        check_vma=False,
    )(x_mk, w_gkn, group_sizes_g)
    return partial[0] if partial.shape[0] == 1 else jnp.sum(partial, axis=0, dtype=partial.dtype)


def sorted_swiglu(x_ne, weights_nk, experts_nk, gate_gef, up_gef, down_gfe, matmul, down=None):
    """Every token through its k experts' SwiGLU, weighted and summed: the (token, expert) pairs
    sorted by expert (stable), `matmul(x, w, group_sizes)` for the three grouped matmuls
    (`down` for the down projection, if given), then unsorted. `MoEMLP._experts` (all the
    tokens, `grouped_matmul`) and `routed_experts` (each device's own) both run it."""
    n, k = experts_nk.shape
    flat = experts_nk.reshape(n * k)
    order = jnp.argsort(flat, stable=True)  # pair p = order[i] is the i-th in expert order
    sizes = jnp.bincount(flat, length=gate_gef.shape[0]).astype(jnp.int32)
    x_sorted = jnp.take(x_ne, order // k, axis=0)
    hidden = jax.nn.silu(matmul(x_sorted, gate_gef, sizes)) * matmul(x_sorted, up_gef, sizes)
    y_sorted = (down or matmul)(hidden, down_gfe, sizes)
    inverse = jnp.argsort(order)  # pair p sits at row inverse[p] of the sorted rows
    y_nke = jnp.take(y_sorted, inverse, axis=0).reshape(n, k, -1)
    return jnp.sum(y_nke * weights_nk[..., None], axis=1)


def routes_per_device(num_experts: int, rows: int) -> bool:
    """Whether `routed_experts` applies to a layer traced now: no sharding installed, or the
    trainer's layout (the experts unsplit, or split only over mesh axes that also split the
    `rows` tokens: gathered on every device). The generator's layout (experts over tp, tokens
    over dp: each device holds some experts) keeps the global sort, each device multiplying
    its own experts' rows."""
    rules = flax_spmd.get_logical_axis_rules()
    mesh = jax.sharding.get_abstract_mesh()
    if not rules or mesh.empty:
        return True
    experts = _mapped(ax.EXPERTS, num_experts, rules, mesh)
    return set(experts) <= set(_mapped(ax.ACT_BATCH, rows, rules, mesh))


def routed_experts(x_ne, weights_nk, experts_nk, gate_gef, up_gef, down_gfe, platform="auto"):
    """`MoEMLP._experts` with the token sort per device: each device sorts its own tokens'
    (token, expert) pairs by expert, runs the three grouped matmuls on them against every
    expert's weights (gathered over the expert axis; each expert's MLP width split as
    `expert_mlp` says, the down projection's partial sums added) and unsorts, so no device holds
    or gathers another's tokens. `MoEMLP._experts` sorts all the tokens of a step at once: under
    FSDP every device then gathers the whole batch's `[N k, E]` sorted rows (docs/scale.md,
    "Mixture of experts"). The same sums as `_experts` (within rounding: the partial sums of a
    split K add in another order). Experts are gathered on every device (the trainer's layout,
    `routes_per_device`); `MoEMLP._experts` uses it in GPU and TPU programs where that holds."""
    if platform == "auto":
        platform = attention_forms.kernel_platform()
    if platform == "tpu" and megablox_supports(x_ne.dtype, gate_gef.dtype):
        interpret = attention_forms.decode_kernel.platform() != "tpu"
        matmul = lambda x, w, g: megablox(x, w, g, interpret=interpret)  # noqa: E731
    elif platform == "gpu":
        gpu_local = _gpu_local(x_ne.dtype, gate_gef.dtype)
        matmul = lambda x, w, g: gpu_local(x, w, g, None)  # noqa: E731
    else:
        matmul = jax.lax.ragged_dot

    def local(x, weights, experts, gate, up, down):
        return sorted_swiglu(x, weights, experts, gate, up, down, matmul)

    rules = flax_spmd.get_logical_axis_rules()
    mesh = jax.sharding.get_abstract_mesh()
    if not rules or mesh.empty:
        return local(x_ne, weights_nk, experts_nk, gate_gef, up_gef, down_gfe)
    mlp = _mapped(ax.EXPERT_MLP, gate_gef.shape[2], rules, mesh)
    rows = tuple(a for a in _mapped(ax.ACT_BATCH, x_ne.shape[0], rules, mesh) if a not in mlp)
    spec = lambda *axes: jax.sharding.PartitionSpec(*(a or None for a in axes))  # noqa: E731
    partial = jax.shard_map(
        lambda *a: local(*a)[None],  # a partial sum where the MLP width is split
        mesh=mesh,
        in_specs=(
            spec(rows),
            spec(rows),
            spec(rows),
            spec(None, None, mlp),
            spec(None, None, mlp),
            spec(None, mlp, None),
        ),
        out_specs=spec(mlp, rows),
        check_vma=False,
    )(x_ne, weights_nk, experts_nk, gate_gef, up_gef, down_gfe)
    return partial[0] if partial.shape[0] == 1 else jnp.sum(partial, axis=0, dtype=partial.dtype)

"""Fused (flash) attention for TPUs: Pallas kernels on the Mosaic backend, forward and backward,
over the library's segment / prefix masks (training and prefill). The TPU counterpart of
`jaxrl.models.gpu_attention`, with the same public contract.

Maths. For query head h (kv head h // G, G = H / K query heads per kv head), scale 1 / sqrt(D),

    s[b, h, q, k]  = q[b, q, h] . key[b, k, h // G] / sqrt(D)
    p[b, h, q, k]  = softmax_k(s | mask[b, q, k])                (fp32)
    out[b, q, h]   = sum_k p[b, h, q, k] value[b, k, h // G]

computed tile by tile with an online softmax (running row maximum m and sum l in VMEM scratch,
rescaled by exp(m_old - m_new) at each kv block), so the `[B, H, T, T]` scores never exist in
memory. The forward also returns lse = m + log l per query row (fp32), kept as `[B, H, T]`, the
only residual besides q, key, value, the ids and the output. The backward recomputes
p = exp(s - lse):

    dv = sum_q p^T dout,   ds = p (dout . value^T - delta),   delta[q] = out[q] . dout[q]
    dq = scale sum_k ds key,   dk = scale sum_q ds^T q

Mask (`jaxrl.models.masks`), per token from two int32 arrays `[B, T]`:

    segment[b, l]  >= 1 for the k-th sequence of row b, 0 on padding / the unused tail
    prefix[b, l]   the segment of the prompt of token l's unit (== segment on plain layouts)
    mask[b, q, k]  = k <= q and segment[b, k] > 0 and
                     (segment[b, k] == segment[b, q] or segment[b, k] == prefix[b, q])

A padded batch (left or right padding) is segment = prefix = valid, a packed row one segment per
sequence, the shared-prompt layout a prompt segment and its completions with prefix = the
prompt's segment (a completion sees its prompt and itself, never a sibling). A query that sees
no key (padding) gets output 0, lse 0 and zero gradients: masked scores are a finite -1e30 and
their probabilities are zeroed, so nothing is NaN.

Shapes: q `[B, T, H, D]`, key / value `[B, T, K, D]`, out `[B, T, H, D]` in q's dtype. Inside
the wrapper they are transposed to `[B, H, T, D]` / `[B, K, T, D]`, so that a block is a
`(block, D)` tile of one head: its last dim is the whole head dim (any D satisfies Mosaic's
(8, 128) tiling) and the sequence is on sublanes. Grouped query attention indexes kv head
h // G in the block index maps; K / V are never repeated in memory. Per-token values (segment,
prefix, lse, delta) travel in a row form `[..., 8, T]` (repeated over the 8 sublanes, 32 bytes a
token) read as `(8, block)` tiles: a `(1, block)` row where keys (or, in the dk / dv kernel's
transposed tile, queries) lie on lanes, and transposed in the kernel into a `(block, 1)` column
where they lie on sublanes (a column form in HBM would pad every token to 128 lanes).

Kernels (grids in order; the leading axes "parallel", the last "arbitrary", accumulating in
VMEM scratch):

- forward, grid (B, H, T / block_q, T / block_k): a q block, m / l `(block_q, 128)` and the
  fp32 output accumulator `(block_q, D)` in scratch, one kv block per step; at the last step
  out = acc / l and lse, written as `(8, block_q)` rows (a transpose of the `(block_q, 128)`
  statistics).
- dq, grid (B, H, T / block_q_bwd, T / block_k_bwd): the same walk, an fp32 dq accumulator.
- dk / dv, grid (B, K, T / block_k_bwd, G, T / block_q_bwd): a kv block walks the G query
  heads of its kv head and, per head, its q blocks, accumulating dk and dv in fp32 scratch
  (summed over the G heads in place: no atomics, no per-query-head copy of dk / dv).

The dk / dv kernel works on the transposed tile s^T = key q^T `(block_k, block_q)` (keys on
sublanes, queries on lanes), so lse, delta (`[B, H, T]`, computed by XLA from out and dout) and
the query ids are rows and every matmul is a plain or rhs-transposed one; the forward and dq
kernels work on s = q key^T and take their per-query columns by transposing `(8, block_q)` rows.

Block skipping. A tile (q block, kv block) is visited only where the mask has a visible pair in
it (`block_visits`: the mask reduced per tile in XLA, one q block of `[B, block_q, T]` compares
at a time): kv blocks entirely after a q block (causal upper tiles), blocks of padding, of
other packed sequences, and a completion's siblings (shared prompts) are skipped.
The visited tiles' indices reach the kernels by scalar prefetch (`pltpu.PrefetchScalarGridSpec`,
in SMEM: per q block, or per kv block for dk / dv, the count of its tiles then their indices,
`[B, n, 1 + m]` int32). Grid step n works on the n-th visited tile; the steps past the count do
no compute and their block index maps repeat the last visited tile, so Pallas fetches nothing
for them (what remains of a skipped tile is a grid step's overhead). A block with no visited
tile writes zeros. The lists take 4 (1 + T / block_k) T / block_q bytes of SMEM per row (66 KiB
at T = 32768 with 256 blocks); a batch whose lists exceed `SMEM_LIST_BYTES` runs as several
kernel calls of fewer rows each (outputs concatenated), and a single row that exceeds it is
refused (larger blocks fix it).

Blocks: powers of two >= 8; the default 256 everywhere (not tuned on a TPU: the largest that
keeps the `(256, 256)` fp32 tiles of the backward well inside the default scoped VMEM, with 4x
fewer grid steps and SMEM list entries than 128). Compiled for a TPU (not interpret mode), a
block must be a multiple of 128 (the lane width: the row forms are read as `(8, block)` tiles)
or cover the whole padded sequence.

Padding rule. T is padded inside the wrapper to a multiple of the largest block (tokens of
segment 0 and prefix 0: never visible, their queries see nothing) and the output sliced back; a
T below a block shrinks the block to the next power of two >= 8. JAX differentiates the pads,
slices and transposes, so the gradients are those of the unpadded call.

Precision: the dots take the inputs' dtype (bf16 in training; p and ds are rounded to it before
their dots) and accumulate in fp32 (`preferred_element_type`); fp32 inputs multiply at full
precision (`Precision.HIGHEST`, the MXU's multi-pass fp32). Softmax statistics, lse, delta and
the dq / dk / dv accumulators are fp32; outputs and gradients are cast to the inputs' dtypes.

`interpret=None` runs the kernels compiled by Mosaic when the program is compiled for a TPU
(`jaxrl.models.decode_kernel.platform`) and in Pallas interpret mode elsewhere (how the CPU tests
check them against `jaxrl.models.gpu_attention.dense_reference`). `flash_self_attention` takes a
`SegmentMask` and runs `flash_attention` per device inside `jax.shard_map` under the installed
sharding rules (batch over `act_batch`, heads over `act_heads` / `act_kv_heads`, as
`gpu_attention.flash_self_attention` does).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxrl.models.decode_kernel import platform
from jaxrl.models.kernel_sharding import self_attention_per_device
from jaxrl.models.tpu_attention_tiles import block_visits, visit_lists, visited

MASKED = -1e30  # a masked score: finite, so exp(MASKED - m) is 0 and never NaN
LANES, SUBLANES = 128, 8
MIN_BLOCK = SUBLANES
SMEM_LIST_BYTES = 512 * 1024  # the visited-tile lists of one call (SMEM: 1 MiB on v5p)
NT = (((1,), (1,)), ((), ()))  # dot_general: a b^T
NN = (((1,), (0,)), ((), ()))  # dot_general: a b


@dataclasses.dataclass(frozen=True)
class _Config:
    scale: float
    block_q: int
    block_k: int
    block_q_bwd: int
    block_k_bwd: int
    interpret: bool


def _dot(a, b, dims):
    """`lax.dot_general` accumulating in fp32; fp32 operands at full precision (the MXU's
    multi-pass fp32), bf16 ones at the MXU's native precision."""
    fp32 = a.dtype == jnp.float32 and b.dtype == jnp.float32
    precision = lax.Precision.HIGHEST if fp32 else None
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _column(ref):
    """`(block, 1)` from an `(8, block)` tile of a row form (a transpose in the kernel: a column
    in HBM would take 128 lanes a token)."""
    return ref[...].T[:, :1]


def _lanes(x, n: int):
    """`(rows, n)` from `(rows, 128)` whose lanes are all equal."""
    if n <= LANES:
        return x[:, :n]
    if n % LANES == 0:
        return jnp.tile(x, (1, n // LANES))
    return jnp.broadcast_to(x[:, :1], (x.shape[0], n))


def _visible(i, j, block_q, block_k, seg_q_ref, pre_q_ref, seg_k_ref):
    """`mask[q, k]` of tile (q block i, kv block j), `(block_q, block_k)` (the module
    docstring's rule), from `(8, block)` tiles of the ids' row forms."""
    shape = (block_q, block_k)
    q_pos = i * block_q + lax.broadcasted_iota(jnp.int32, shape, 0)
    k_pos = j * block_k + lax.broadcasted_iota(jnp.int32, shape, 1)
    seg_k = seg_k_ref[:1, :]
    seg_q, pre_q = _column(seg_q_ref), _column(pre_q_ref)
    return (k_pos <= q_pos) & (seg_k > 0) & ((seg_k == seg_q) | (seg_k == pre_q))


def _forward_kernel(
    lists_ref, q_ref, k_ref, v_ref, seg_q_ref, pre_q_ref, seg_k_ref, o_ref, lse_ref,
    m_ref, l_ref, acc_ref,
    *, scale, block_q, block_k, num_q, num_k,
):  # fmt: skip
    b, i, step = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    run, j = visited(lists_ref, b, i, step, num_q, num_k)

    @pl.when(step == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, MASKED, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(run)
    def _tile():
        s = _dot(q_ref[...], k_ref[...], NT) * scale
        visible = _visible(i, j, block_q, block_k, seg_q_ref, pre_q_ref, seg_k_ref)
        s = jnp.where(visible, s, MASKED)
        m_prev, l_prev = m_ref[...], l_ref[...]
        m_next = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))  # (block_q, 128)
        p = jnp.where(visible, jnp.exp(s - _lanes(m_next, block_k)), 0.0)
        alpha = jnp.exp(m_prev - m_next)
        l_ref[...] = alpha * l_prev + p.sum(axis=1, keepdims=True)
        m_ref[...] = m_next
        v = v_ref[...]
        pv = _dot(p.astype(v.dtype), v, NN)
        acc_ref[...] = _lanes(alpha, pv.shape[1]) * acc_ref[...] + pv

    @pl.when(step == num_k - 1)
    def _finish():
        total = l_ref[...]
        seen = total > 0.0
        total = jnp.where(seen, total, 1.0)
        o_ref[...] = (acc_ref[...] / _lanes(total, o_ref.shape[-1])).astype(o_ref.dtype)
        lse = jnp.where(seen, m_ref[...] + jnp.log(total), 0.0)  # (block_q, 128), lanes equal
        lse_ref[...] = lse.T[:SUBLANES, :]  # the row form the backward reads


def _transposed_probabilities(
    q, k, v, do, lse_ref, delta_ref, seg_q_ref, pre_q_ref, seg_k_ref, i, j,
    *, scale, block_q, block_k,
):  # fmt: skip
    """p^T and ds^T `(block_k, block_q)` of tile (q block i, kv block j) for dk / dv: keys on
    sublanes, queries on lanes, so lse, delta and the query ids are `(1, block_q)` rows."""
    st = _dot(k, q, NT) * scale
    shape = (block_k, block_q)
    k_pos = j * block_k + lax.broadcasted_iota(jnp.int32, shape, 0)
    q_pos = i * block_q + lax.broadcasted_iota(jnp.int32, shape, 1)
    seg_k = _column(seg_k_ref)
    seg_q, pre_q = seg_q_ref[:1, :], pre_q_ref[:1, :]
    visible = (k_pos <= q_pos) & (seg_k > 0) & ((seg_k == seg_q) | (seg_k == pre_q))
    pt = jnp.where(visible, jnp.exp(st - lse_ref[:1, :]), 0.0)
    dpt = _dot(v, do, NT)
    return pt, pt * (dpt - delta_ref[:1, :])


def _dq_kernel(
    lists_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, seg_q_ref, pre_q_ref, seg_k_ref,
    dq_ref,
    acc_ref,
    *, scale, block_q, block_k, num_q, num_k,
):  # fmt: skip
    b, i, step = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    run, j = visited(lists_ref, b, i, step, num_q, num_k)

    @pl.when(step == 0)
    def _init():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(run)
    def _tile():
        q, k, v, do = q_ref[...], k_ref[...], v_ref[...], do_ref[...]
        s = _dot(q, k, NT) * scale
        visible = _visible(i, j, block_q, block_k, seg_q_ref, pre_q_ref, seg_k_ref)
        p = jnp.where(visible, jnp.exp(s - _column(lse_ref)), 0.0)
        ds = p * (_dot(do, v, NT) - _column(delta_ref))
        acc_ref[...] += _dot(ds.astype(k.dtype), k, NN)

    @pl.when(step == num_k - 1)
    def _finish():
        dq_ref[...] = (acc_ref[...] * scale).astype(dq_ref.dtype)


def _dkdv_kernel(
    lists_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, seg_q_ref, pre_q_ref, seg_k_ref,
    dk_ref, dv_ref,
    dk_acc_ref, dv_acc_ref,
    *, scale, block_q, block_k, num_q, num_k, groups,
):  # fmt: skip
    b, j, g, step = pl.program_id(0), pl.program_id(2), pl.program_id(3), pl.program_id(4)
    run, i = visited(lists_ref, b, j, step, num_k, num_q)

    @pl.when((g == 0) & (step == 0))
    def _init():
        dk_acc_ref[...] = jnp.zeros(dk_acc_ref.shape, jnp.float32)
        dv_acc_ref[...] = jnp.zeros(dv_acc_ref.shape, jnp.float32)

    @pl.when(run)
    def _tile():
        q, do = q_ref[...], do_ref[...]
        pt, dst = _transposed_probabilities(
            q, k_ref[...], v_ref[...], do, lse_ref, delta_ref, seg_q_ref, pre_q_ref, seg_k_ref,
            i, j, scale=scale, block_q=block_q, block_k=block_k,
        )  # fmt: skip
        dv_acc_ref[...] += _dot(pt.astype(do.dtype), do, NN)
        dk_acc_ref[...] += _dot(dst.astype(q.dtype), q, NN)

    @pl.when((g == groups - 1) & (step == num_q - 1))
    def _finish():
        dk_ref[...] = (dk_acc_ref[...] * scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_acc_ref[...].astype(dv_ref.dtype)


def _rows(x):
    """`[..., 8, T]` from `[..., T]`: repeated over the sublanes (read as a row of keys)."""
    return jnp.broadcast_to(x[..., None, :], (*x.shape[:-1], SUBLANES, x.shape[-1]))


def _params(*semantics):
    return pltpu.CompilerParams(dimension_semantics=semantics)


def _forward(q, k, v, segment, prefix, cfg: _Config):
    """out `[B, H, T, D]`, lse `[B, H, T]` from q `[B, H, T, D]`, key / value `[B, K, T, D]`."""
    b, h, t, d = q.shape
    groups = h // k.shape[1]
    bq, bk = cfg.block_q, cfg.block_k
    nq, nk = t // bq, t // bk
    lists = visit_lists(block_visits(segment, prefix, bq, bk))

    def kv_map(b, h, i, n, lists):
        return (b, h // groups, visited(lists, b, i, n, nq, nk)[1], 0)

    def ids_k_map(b, h, i, n, lists):
        return (b, 0, visited(lists, b, i, n, nq, nk)[1])

    kernel = functools.partial(
        _forward_kernel, scale=cfg.scale, block_q=bq, block_k=bk, num_q=nq, num_k=nk
    )
    out, lse = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(b, h, nq, nk),
            in_specs=[
                pl.BlockSpec((None, None, bq, d), lambda b, h, i, n, lists: (b, h, i, 0)),
                pl.BlockSpec((None, None, bk, d), kv_map),
                pl.BlockSpec((None, None, bk, d), kv_map),
                pl.BlockSpec((None, SUBLANES, bq), lambda b, h, i, n, lists: (b, 0, i)),
                pl.BlockSpec((None, SUBLANES, bq), lambda b, h, i, n, lists: (b, 0, i)),
                pl.BlockSpec((None, SUBLANES, bk), ids_k_map),
            ],
            out_specs=[
                pl.BlockSpec((None, None, bq, d), lambda b, h, i, n, lists: (b, h, i, 0)),
                pl.BlockSpec((None, None, SUBLANES, bq), lambda b, h, i, n, lists: (b, h, 0, i)),
            ],
            scratch_shapes=[
                pltpu.VMEM((bq, LANES), jnp.float32),
                pltpu.VMEM((bq, LANES), jnp.float32),
                pltpu.VMEM((bq, d), jnp.float32),
            ],
        ),
        out_shape=[
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((b, h, SUBLANES, t), jnp.float32),
        ],
        compiler_params=_params("parallel", "parallel", "parallel", "arbitrary"),
        interpret=cfg.interpret,
        name="tpu_flash_attention_forward",
    )(lists, q, k, v, _rows(segment), _rows(prefix), _rows(segment))
    return out, lse[:, :, 0]


def _backward(q, k, v, segment, prefix, out, lse, do, cfg: _Config):
    b, h, t, d = q.shape
    kv = k.shape[1]
    groups = h // kv
    bq, bk = cfg.block_q_bwd, cfg.block_k_bwd
    nq, nk = t // bq, t // bk
    do = do.astype(q.dtype)
    visits = block_visits(segment, prefix, bq, bk)
    kv_lists, q_lists = visit_lists(visits), visit_lists(visits.transpose(0, 2, 1))
    delta = jnp.einsum("bhtd,bhtd->bht", out.astype(jnp.float32), do.astype(jnp.float32))
    seg_rows = _rows(segment)
    operands = (q, k, v, do, _rows(lse), _rows(delta), seg_rows, _rows(prefix), seg_rows)

    def kv_map(b, h, i, n, lists):
        return (b, h // groups, visited(lists, b, i, n, nq, nk)[1], 0)

    def ids_k_map(b, h, i, n, lists):
        return (b, 0, visited(lists, b, i, n, nq, nk)[1])

    q_tile = pl.BlockSpec((None, None, bq, d), lambda b, h, i, n, lists: (b, h, i, 0))
    q_stat = pl.BlockSpec((None, None, SUBLANES, bq), lambda b, h, i, n, lists: (b, h, 0, i))
    q_ids = pl.BlockSpec((None, SUBLANES, bq), lambda b, h, i, n, lists: (b, 0, i))
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, scale=cfg.scale, block_q=bq, block_k=bk, num_q=nq, num_k=nk),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(b, h, nq, nk),
            in_specs=[
                q_tile,
                pl.BlockSpec((None, None, bk, d), kv_map),
                pl.BlockSpec((None, None, bk, d), kv_map),
                q_tile,
                q_stat,
                q_stat,
                q_ids,
                q_ids,
                pl.BlockSpec((None, SUBLANES, bk), ids_k_map),
            ],
            out_specs=q_tile,
            scratch_shapes=[pltpu.VMEM((bq, d), jnp.float32)],
        ),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=_params("parallel", "parallel", "parallel", "arbitrary"),
        interpret=cfg.interpret,
        name="tpu_flash_attention_dq",
    )(kv_lists, *operands)

    def q_map(b, g, j, m, n, lists):
        return (b, g * groups + m, visited(lists, b, j, n, nk, nq)[1], 0)

    def stat_map(b, g, j, m, n, lists):
        return (b, g * groups + m, 0, visited(lists, b, j, n, nk, nq)[1])

    def ids_q_map(b, g, j, m, n, lists):
        return (b, 0, visited(lists, b, j, n, nk, nq)[1])

    kv_tile = pl.BlockSpec((None, None, bk, d), lambda b, g, j, m, n, lists: (b, g, j, 0))
    dk, dv = pl.pallas_call(
        functools.partial(
            _dkdv_kernel,
            scale=cfg.scale,
            block_q=bq,
            block_k=bk,
            num_q=nq,
            num_k=nk,
            groups=groups,
        ),  # fmt: skip
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(b, kv, nk, groups, nq),
            in_specs=[
                pl.BlockSpec((None, None, bq, d), q_map),
                kv_tile,
                kv_tile,
                pl.BlockSpec((None, None, bq, d), q_map),
                pl.BlockSpec((None, None, SUBLANES, bq), stat_map),
                pl.BlockSpec((None, None, SUBLANES, bq), stat_map),
                pl.BlockSpec((None, SUBLANES, bq), ids_q_map),
                pl.BlockSpec((None, SUBLANES, bq), ids_q_map),
                pl.BlockSpec((None, SUBLANES, bk), lambda b, g, j, m, n, lists: (b, 0, j)),
            ],
            out_specs=[kv_tile, kv_tile],
            scratch_shapes=[pltpu.VMEM((bk, d), jnp.float32), pltpu.VMEM((bk, d), jnp.float32)],
        ),
        out_shape=[
            jax.ShapeDtypeStruct(k.shape, k.dtype),
            jax.ShapeDtypeStruct(v.shape, v.dtype),
        ],
        compiler_params=_params("parallel", "parallel", "parallel", "arbitrary", "arbitrary"),
        interpret=cfg.interpret,
        name="tpu_flash_attention_dkdv",
    )(q_lists, *operands)
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _attention(q, k, v, segment, prefix, cfg: _Config):
    return _forward(q, k, v, segment, prefix, cfg)[0]


def _attention_fwd(q, k, v, segment, prefix, cfg: _Config):
    out, lse = _forward(q, k, v, segment, prefix, cfg)
    return out, (q, k, v, segment, prefix, out, lse)


def _attention_bwd(cfg: _Config, residuals, do):
    q, k, v, segment, prefix, out, lse = residuals
    dq, dk, dv = _backward(q, k, v, segment, prefix, out, lse, do, cfg)
    return dq, dk, dv, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _check_block(name: str, block: int) -> None:
    if block < MIN_BLOCK or block & (block - 1):
        raise ValueError(
            f"flash_attention: {name}={block} must be a power of two >= {MIN_BLOCK}; "
            "pass e.g. 128 or 256"
        )


def flash_attention(
    q_bthd: jax.Array,
    k_btkd: jax.Array,
    v_btkd: jax.Array,
    segment_bt: jax.Array,
    prefix_bt: jax.Array | None = None,
    *,
    interpret: bool | None = None,
    block_q: int = 256,
    block_k: int = 256,
    block_q_bwd: int = 256,
    block_k_bwd: int = 256,
) -> jax.Array:
    """Masked causal attention `[B, T, H, D]` of q `[B, T, H, D]` over key / value `[B, T, K, D]`
    (H a multiple of K), the mask given by `segment_bt` and `prefix_bt` (int `[B, T]`; prefix
    None means prefix = segment), differentiable in q, key and value (see the module docstring).
    `interpret=None`: Mosaic when compiled for a TPU, interpret mode elsewhere."""
    b, t, h, d = q_bthd.shape
    if k_btkd.shape != v_btkd.shape or k_btkd.shape[:2] != (b, t) or k_btkd.shape[3] != d:
        raise ValueError(
            f"flash_attention: key {k_btkd.shape} and value {v_btkd.shape} must both be "
            f"[B, T, K, D] = [{b}, {t}, K, {d}] for q {q_bthd.shape}"
        )
    kv = k_btkd.shape[2]
    if h % kv:
        raise ValueError(f"flash_attention: {h} query heads are not a multiple of {kv} kv heads")
    if prefix_bt is None:
        prefix_bt = segment_bt
    if segment_bt.shape != (b, t) or prefix_bt.shape != (b, t):
        raise ValueError(
            f"flash_attention: segment {segment_bt.shape} and prefix {prefix_bt.shape} "
            f"must be [B, T] = [{b}, {t}]"
        )
    names = ("block_q", "block_k", "block_q_bwd", "block_k_bwd")
    requested = (block_q, block_k, block_q_bwd, block_k_bwd)
    for name, block in zip(names, requested, strict=True):
        _check_block(name, block)
    if interpret is None:
        from jaxrl.models.decode_kernel import platform

        interpret = platform() != "tpu"

    cap = max(MIN_BLOCK, _next_power_of_2(t))  # a short sequence shrinks the blocks
    blocks = [min(block, cap) for block in requested]
    t_pad = -(-t // max(blocks)) * max(blocks)
    if not interpret:
        for name, block in zip(names, blocks, strict=True):
            if block % LANES and block != t_pad:
                raise ValueError(
                    f"flash_attention: {name}={block} must be a multiple of {LANES} on a TPU "
                    f"(Mosaic's lane tiling) or cover the padded sequence ({t_pad})"
                )
    cfg = _Config(d**-0.5, *blocks, interpret)

    def heads_first(x):
        x = x if t_pad == t else jnp.pad(x, ((0, 0), (0, t_pad - t), (0, 0), (0, 0)))
        return x.transpose(0, 2, 1, 3)

    def pad_ids(x):
        x = x.astype(jnp.int32)
        return x if t_pad == t else jnp.pad(x, ((0, 0), (0, t_pad - t)))

    rows = _rows_per_call(t_pad, blocks)
    if rows == 0:
        raise ValueError(
            f"flash_attention: the visited-tile lists of one row at T={t_pad} with blocks "
            f"{dict(zip(names, blocks, strict=True))} exceed {SMEM_LIST_BYTES} bytes of SMEM; "
            "pass larger blocks (e.g. 512)"
        )
    args = [heads_first(x) for x in (q_bthd, k_btkd, v_btkd)]
    args += [pad_ids(segment_bt), pad_ids(prefix_bt)]
    outs = [
        _attention(*(x[start : start + rows] for x in args), cfg) for start in range(0, b, rows)
    ]
    out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=0)
    return out.transpose(0, 2, 1, 3)[:, :t]


def _rows_per_call(t: int, blocks) -> int:
    """How many batch rows one kernel call takes: their visited-tile lists (scalar prefetch)
    must fit `SMEM_LIST_BYTES`; a larger batch runs as several calls."""
    block_q, block_k, block_q_bwd, block_k_bwd = blocks
    per_row = 4 * max(
        (t // block_q) * (1 + t // block_k),
        (t // block_q_bwd) * (1 + t // block_k_bwd),
        (t // block_k_bwd) * (1 + t // block_q_bwd),
    )
    return SMEM_LIST_BYTES // per_row


def flash_self_attention(q_bthd, k_btkd, v_btkd, mask) -> jax.Array:
    """`flash_attention` under the installed sharding rules, per device inside `jax.shard_map`
    (`jaxrl.models.kernel_sharding.self_attention_per_device`). `mask`: a
    `jaxrl.models.masks.SegmentMask`. Interpret mode off a TPU
    (`jaxrl.models.decode_kernel.platform`), which is how its numerics are tested on the CPU."""
    local = functools.partial(_flash_local, interpret=platform() != "tpu")
    return self_attention_per_device(local, q_bthd, k_btkd, v_btkd, mask)


def _flash_local(q, k, v, segment, prefix, *, interpret: bool) -> jax.Array:
    return flash_attention(q, k, v, segment, prefix, interpret=interpret)

"""Fused (flash) attention for NVIDIA GPUs: Pallas kernels on the Triton backend, forward and
backward, over the library's segment / prefix masks (training and prefill).

Maths. For query head h (kv head h // G, G = H / K query heads per kv head), scale 1 / sqrt(D),

    s[b, h, q, k]  = q[b, q, h] . key[b, k, h // G] / sqrt(D)
    p[b, h, q, k]  = softmax_k(s | mask[b, q, k])                (fp32)
    out[b, q, h]   = sum_k p[b, h, q, k] value[b, k, h // G]

computed block by block with an online softmax (running row maximum m and sum l, in base 2:
exp(x) = 2 ** (x log2 e)), so the `[B, H, T, T]` scores never exist in memory. The forward also
returns lse = m + log2 l per query row (`[B, H, T]`, fp32), the only residual besides the output.

Mask (`jaxrl.rl.packing.segment_mask`), per token from two int32 arrays `[B, T]`:

    segment[b, l]  >= 1 for the k-th sequence of row b, 0 on padding / the unused tail
    prefix[b, l]   the segment of the prompt of token l's unit (== segment on plain layouts)
    mask[b, q, k]  = k <= q and segment[b, k] > 0 and
                     (segment[b, k] == segment[b, q] or segment[b, k] == prefix[b, q])

A padded batch (left or right padding) is segment = prefix = valid (1 real, 0 padding; positions
are the caller's), a packed row one segment per sequence, the shared-prompt layout a prompt
segment and its completions with prefix = the prompt's segment (a completion sees its prompt and
itself, never a sibling). A query that sees no key (padding) gets output 0, lse 0 and zero
gradients: masked scores are a finite -1e30 and their probabilities are zeroed, so nothing is NaN.

Shapes: q `[B, T, H, D]`, key / value `[B, T, K, D]`, out `[B, T, H, D]` in q's dtype. Grouped
query attention indexes kv head h // G in the kernels' block index maps and loops; K / V are
never repeated in memory.

Kernels and blocks (powers of two, >= 16; defaults chosen for an H100 at D = 128, from the
register counts ptxas reports for sm_90a: no spills, 8 warps from 64 x 64 tiles at D = 128):

- forward, grid (B, H, T / block_q): a q block stays in registers and loops over its kv blocks
  of size block_k; block_q = 128, block_k = 64.
- dq, grid (B, H, T / block_q_bwd): the same loop, dq = scale sum_k ds[q, k] key[k] with
  ds = p (dp - delta), dp = dout . value, delta[q] = out[q] . dout[q] (computed outside, fp32).
- dk / dv, grid (B, K, T / block_k_bwd): a kv block loops over the G query heads of its kv head
  and, per head, over its q blocks: dv = sum p^T dout, dk = scale sum ds^T q, summed over the G
  query heads in registers (no atomics, no per-query-head copy of dk / dv).
  block_q_bwd = block_k_bwd = 64.

Block skipping. A tile (q block, kv block) is visited only where the mask has a visible pair in
it (`block_visits`: the mask reduced per tile, one fused XLA reduction over [B, T, T] compares,
nothing of that size stored): kv blocks entirely after a q block (causal), blocks of padding,
of other packed sequences, and a completion's siblings (shared prompts) are skipped. Each
kernel reads, per q block (forward, dq) or kv block (dk / dv), the count of its tiles and their
indices (`[B, n, 1 + m]` int32) and loops over those alone; a block with none writes zeros.

Padding rule. T is padded inside the wrapper to a multiple of the largest block (tokens of
segment 0 and prefix 0: never visible, their queries see nothing) and the output sliced back; a T
below a block shrinks the block to the next power of two >= 16. D is zero-padded to the next
power of two >= 16 (Triton's dot needs dims >= 16; zero columns change no score, the scale stays
1 / sqrt(D) of the real D) and sliced back; D > 256 is refused. JAX differentiates the pads and
slices, so the gradients are those of the unpadded call.

Precision: the dots take the inputs' dtype (bf16 in training; p and ds are rounded to it before
their dots) and accumulate in fp32; fp32 inputs multiply in TF32 on the GPU (Triton's default
precision, as XLA's), exactly in interpret mode.

`interpret=True` runs the same kernels in Pallas interpret mode (any backend: how the CPU tests
check them against a dense reference).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

LOG2E = math.log2(math.e)
MASKED = -1e30  # a masked score (base 2): finite, so exp2(MASKED - m) is 0 and never NaN
MIN_BLOCK = 16  # Triton's dot needs every dim >= 16
MAX_HEAD_DIM = 256


@dataclasses.dataclass(frozen=True)
class _Config:
    scale: float
    block_q: int
    block_k: int
    block_q_bwd: int
    block_k_bwd: int
    num_warps: int | None
    num_stages: int
    interpret: bool


def _visible(q_pos, k_pos, seg_q, pre_q, seg_k):
    """`mask[q, k]` of one (q block, kv block) tile (the module docstring's rule)."""
    seg_k = seg_k[None, :]
    same = (seg_k == seg_q[:, None]) | (seg_k == pre_q[:, None])
    return (k_pos[None, :] <= q_pos[:, None]) & (seg_k > 0) & same


def _scores(q, k, q_pos, k_pos, seg_q, pre_q, seg_k, scale):
    """Base-2 scores `q k^T scale log2 e` of one tile, MASKED where not visible, and the mask."""
    s = plgpu.dot(q, k, trans_b=True) * (scale * LOG2E)
    visible = _visible(q_pos, k_pos, seg_q, pre_q, seg_k)
    return jnp.where(visible, s, MASKED), visible


def _forward_kernel(
    visits_ref, q_ref, k_ref, v_ref, seg_q_ref, pre_q_ref, seg_ref, o_ref, lse_ref,
    *, scale, block_q, block_k,
):  # fmt: skip
    i = pl.program_id(2)
    q = q_ref[...]
    seg_q, pre_q = seg_q_ref[...], pre_q_ref[...]
    q_pos = i * block_q + jnp.arange(block_q)

    def body(n, carry):
        acc, m, total = carry
        j = visits_ref[n + 1]
        keys = pl.ds(j * block_k, block_k)
        k, v = k_ref[keys, :], v_ref[keys, :]
        k_pos = j * block_k + jnp.arange(block_k)
        s, visible = _scores(q, k, q_pos, k_pos, seg_q, pre_q, seg_ref[keys], scale)
        m_next = jnp.maximum(m, s.max(axis=1))
        p = jnp.where(visible, jnp.exp2(s - m_next[:, None]), 0.0)
        correction = jnp.exp2(m - m_next)
        total = correction * total + p.sum(axis=1)
        acc = correction[:, None] * acc + plgpu.dot(p.astype(v.dtype), v)
        return acc, m_next, total

    acc = jnp.zeros(q.shape, jnp.float32)
    m = jnp.full((block_q,), MASKED, jnp.float32)
    total = jnp.zeros((block_q,), jnp.float32)
    acc, m, total = lax.fori_loop(0, visits_ref[0], body, (acc, m, total))
    seen = total > 0.0
    total = jnp.where(seen, total, 1.0)
    o_ref[...] = (acc / total[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen, m + jnp.log2(total), 0.0)


def _dq_kernel(
    visits_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, seg_q_ref, pre_q_ref, seg_ref,
    dq_ref,
    *, scale, block_q, block_k,
):  # fmt: skip
    i = pl.program_id(2)
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]
    seg_q, pre_q = seg_q_ref[...], pre_q_ref[...]
    q_pos = i * block_q + jnp.arange(block_q)

    def body(n, dq):
        j = visits_ref[n + 1]
        keys = pl.ds(j * block_k, block_k)
        k, v = k_ref[keys, :], v_ref[keys, :]
        k_pos = j * block_k + jnp.arange(block_k)
        s, _ = _scores(q, k, q_pos, k_pos, seg_q, pre_q, seg_ref[keys], scale)
        p = jnp.exp2(s - lse[:, None])
        ds = p * (plgpu.dot(do, v, trans_b=True) - delta[:, None])
        return dq + plgpu.dot(ds.astype(k.dtype), k)

    dq = lax.fori_loop(0, visits_ref[0], body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _dkdv_kernel(
    visits_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, seg_ref, pre_ref, seg_k_ref,
    dk_ref, dv_ref,
    *, scale, block_q, block_k, groups,
):  # fmt: skip
    kv_head, j = pl.program_id(1), pl.program_id(2)
    k, v = k_ref[...], v_ref[...]
    seg_k = seg_k_ref[...]
    k_pos = j * block_k + jnp.arange(block_k)

    def head(g, carry):
        h = kv_head * groups + g

        def body(n, carry):
            dk, dv = carry
            i = visits_ref[n + 1]
            queries = pl.ds(i * block_q, block_q)
            q, do = q_ref[queries, h, :], do_ref[queries, h, :]
            lse, delta = lse_ref[h, queries], delta_ref[h, queries]
            q_pos = i * block_q + jnp.arange(block_q)
            s, _ = _scores(q, k, q_pos, k_pos, seg_ref[queries], pre_ref[queries], seg_k, scale)
            p = jnp.exp2(s - lse[:, None])
            dv = dv + plgpu.dot(p.astype(do.dtype), do, trans_a=True)
            ds = p * (plgpu.dot(do, v, trans_b=True) - delta[:, None])
            dk = dk + plgpu.dot(ds.astype(q.dtype), q, trans_a=True)
            return dk, dv

        return lax.fori_loop(0, visits_ref[0], body, carry)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(0, groups, head, (zeros, zeros))
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _params(cfg: _Config, block_a: int, block_b: int, d: int):
    warps = cfg.num_warps or (8 if block_a * block_b * d >= 64 * 64 * 128 else 4)
    return plgpu.CompilerParams(num_warps=warps, num_stages=cfg.num_stages)


def block_visits(segment, prefix, block_q: int, block_k: int) -> jax.Array:
    """`visits[b, i, j]`: does some query of q block i see some key of kv block j (bool
    `[B, T / block_q, T / block_k]`, the mask reduced over each tile; one fused XLA reduction)."""
    b, t = segment.shape
    nq, nk = t // block_q, t // block_k
    pos = jnp.arange(t)
    seg_q, pre_q = (x.reshape(b, nq, block_q, 1, 1) for x in (segment, prefix))
    seg_k = segment.reshape(b, 1, 1, nk, block_k)
    causal = pos.reshape(1, 1, 1, nk, block_k) <= pos.reshape(1, nq, block_q, 1, 1)
    visible = causal & (seg_k > 0) & ((seg_k == seg_q) | (seg_k == pre_q))
    return visible.any(axis=(2, 4))


def _visit_lists(visits) -> jax.Array:
    """`[..., 1 + M]` int32 from `visits [..., M]`: the count of visited blocks, then their
    indices in increasing order (the unvisited after them, never read)."""
    order = jnp.argsort(~visits, axis=-1, stable=True).astype(jnp.int32)
    count = visits.sum(axis=-1, keepdims=True, dtype=jnp.int32)
    return jnp.concatenate([count, order], axis=-1)


def _forward(q, k, v, segment, prefix, cfg: _Config):
    b, t, h, d = q.shape
    kv = k.shape[2]
    groups = h // kv
    bq, bk = cfg.block_q, cfg.block_k
    visits = _visit_lists(block_visits(segment, prefix, bq, bk))
    kernel = functools.partial(_forward_kernel, scale=cfg.scale, block_q=bq, block_k=bk)
    return pl.pallas_call(
        kernel,
        grid=(b, h, t // bq),
        in_specs=[
            pl.BlockSpec((None, None, 1 + t // bk), lambda b, h, i: (b, i, 0)),
            pl.BlockSpec((None, bq, None, d), lambda b, h, i: (b, i, h, 0)),
            pl.BlockSpec((None, t, None, d), lambda b, h, i: (b, 0, h // groups, 0)),
            pl.BlockSpec((None, t, None, d), lambda b, h, i: (b, 0, h // groups, 0)),
            pl.BlockSpec((None, bq), lambda b, h, i: (b, i)),
            pl.BlockSpec((None, bq), lambda b, h, i: (b, i)),
            pl.BlockSpec((None, t), lambda b, h, i: (b, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, bq, None, d), lambda b, h, i: (b, i, h, 0)),
            pl.BlockSpec((None, None, bq), lambda b, h, i: (b, h, i)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((b, h, t), jnp.float32),
        ],
        compiler_params=_params(cfg, bq, bk, d),
        interpret=cfg.interpret,
        name="flash_attention_forward",
    )(visits, q, k, v, segment, prefix, segment)


def _backward(q, k, v, segment, prefix, out, lse, do, cfg: _Config):
    b, t, h, d = q.shape
    kv = k.shape[2]
    groups = h // kv
    bq, bk = cfg.block_q_bwd, cfg.block_k_bwd
    do = do.astype(q.dtype)
    delta = jnp.einsum("bthd,bthd->bht", out.astype(jnp.float32), do.astype(jnp.float32))
    visits = block_visits(segment, prefix, bq, bk)
    kv_lists, q_lists = _visit_lists(visits), _visit_lists(visits.transpose(0, 2, 1))

    dq = pl.pallas_call(
        functools.partial(_dq_kernel, scale=cfg.scale, block_q=bq, block_k=bk),
        grid=(b, h, t // bq),
        in_specs=[
            pl.BlockSpec((None, None, 1 + t // bk), lambda b, h, i: (b, i, 0)),
            pl.BlockSpec((None, bq, None, d), lambda b, h, i: (b, i, h, 0)),
            pl.BlockSpec((None, t, None, d), lambda b, h, i: (b, 0, h // groups, 0)),
            pl.BlockSpec((None, t, None, d), lambda b, h, i: (b, 0, h // groups, 0)),
            pl.BlockSpec((None, bq, None, d), lambda b, h, i: (b, i, h, 0)),
            pl.BlockSpec((None, None, bq), lambda b, h, i: (b, h, i)),
            pl.BlockSpec((None, None, bq), lambda b, h, i: (b, h, i)),
            pl.BlockSpec((None, bq), lambda b, h, i: (b, i)),
            pl.BlockSpec((None, bq), lambda b, h, i: (b, i)),
            pl.BlockSpec((None, t), lambda b, h, i: (b, 0)),
        ],
        out_specs=pl.BlockSpec((None, bq, None, d), lambda b, h, i: (b, i, h, 0)),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=_params(cfg, bq, bk, d),
        interpret=cfg.interpret,
        name="flash_attention_dq",
    )(kv_lists, q, k, v, do, lse, delta, segment, prefix, segment)

    kernel = functools.partial(_dkdv_kernel, scale=cfg.scale, block_q=bq, block_k=bk, groups=groups)
    dk, dv = pl.pallas_call(
        kernel,
        grid=(b, kv, t // bk),
        in_specs=[
            pl.BlockSpec((None, None, 1 + t // bq), lambda b, g, j: (b, j, 0)),
            pl.BlockSpec((None, t, h, d), lambda b, g, j: (b, 0, 0, 0)),
            pl.BlockSpec((None, bk, None, d), lambda b, g, j: (b, j, g, 0)),
            pl.BlockSpec((None, bk, None, d), lambda b, g, j: (b, j, g, 0)),
            pl.BlockSpec((None, t, h, d), lambda b, g, j: (b, 0, 0, 0)),
            pl.BlockSpec((None, h, t), lambda b, g, j: (b, 0, 0)),
            pl.BlockSpec((None, h, t), lambda b, g, j: (b, 0, 0)),
            pl.BlockSpec((None, t), lambda b, g, j: (b, 0)),
            pl.BlockSpec((None, t), lambda b, g, j: (b, 0)),
            pl.BlockSpec((None, bk), lambda b, g, j: (b, j)),
        ],
        out_specs=[
            pl.BlockSpec((None, bk, None, d), lambda b, g, j: (b, j, g, 0)),
            pl.BlockSpec((None, bk, None, d), lambda b, g, j: (b, j, g, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct(k.shape, k.dtype),
            jax.ShapeDtypeStruct(v.shape, v.dtype),
        ],
        compiler_params=_params(cfg, bq, bk, d),
        interpret=cfg.interpret,
        name="flash_attention_dkdv",
    )(q_lists, q, k, v, do, lse, delta, segment, prefix, segment)
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
            f"flash_attention: {name}={block} must be a power of two >= {MIN_BLOCK} "
            "(Triton's tiles); pass e.g. 64 or 128"
        )


def flash_attention(
    q_bthd: jax.Array,
    k_btkd: jax.Array,
    v_btkd: jax.Array,
    segment_bt: jax.Array,
    prefix_bt: jax.Array | None = None,
    *,
    interpret: bool = False,
    block_q: int = 128,
    block_k: int = 64,
    block_q_bwd: int = 64,
    block_k_bwd: int = 64,
    num_warps: int | None = None,
    num_stages: int = 2,
) -> jax.Array:
    """Masked causal attention `[B, T, H, D]` of q `[B, T, H, D]` over key / value `[B, T, K, D]`
    (H a multiple of K), the mask given by `segment_bt` and `prefix_bt` (int `[B, T]`; prefix
    None means prefix = segment), differentiable in q, key and value (see the module docstring).
    """
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
    if d > MAX_HEAD_DIM:
        raise ValueError(f"flash_attention: head_dim {d} > {MAX_HEAD_DIM} is not supported")
    for name, block in [
        ("block_q", block_q), ("block_k", block_k),
        ("block_q_bwd", block_q_bwd), ("block_k_bwd", block_k_bwd),
    ]:  # fmt: skip
        _check_block(name, block)

    cap = max(MIN_BLOCK, _next_power_of_2(t))  # a short sequence shrinks the blocks
    blocks = [min(block, cap) for block in (block_q, block_k, block_q_bwd, block_k_bwd)]
    t_pad = -(-t // max(blocks)) * max(blocks)
    d_pad = max(MIN_BLOCK, _next_power_of_2(d))
    cfg = _Config(d**-0.5, *blocks, num_warps, num_stages, interpret)

    def pad(x):
        if (t_pad, d_pad) == (t, d):
            return x
        return jnp.pad(x, ((0, 0), (0, t_pad - t), (0, 0), (0, d_pad - d)))

    def pad_ids(x):
        x = x.astype(jnp.int32)
        return x if t_pad == t else jnp.pad(x, ((0, 0), (0, t_pad - t)))

    out = _attention(
        pad(q_bthd), pad(k_btkd), pad(v_btkd), pad_ids(segment_bt), pad_ids(prefix_bt), cfg
    )
    return out[:, :t, :, :d]


def flash_self_attention(q_bthd, k_btkd, v_btkd, mask) -> jax.Array:
    """`flash_attention` under the installed sharding rules, per device inside `jax.shard_map`
    (`jaxrl.models.kernel_sharding.self_attention_per_device`). `mask`: a
    `jaxrl.models.masks.SegmentMask`. Interpret mode off a GPU
    (`jaxrl.models.decode_kernel.platform`), which is how its numerics are tested on the CPU."""
    # Imported here: bench/gpu_attention.py loads this file alone.
    from jaxrl.models.decode_kernel import platform
    from jaxrl.models.kernel_sharding import self_attention_per_device

    local = functools.partial(_flash_local, interpret=platform() != "gpu")
    return self_attention_per_device(local, q_bthd, k_btkd, v_btkd, mask)


def _flash_local(q, k, v, segment, prefix, *, interpret: bool) -> jax.Array:
    return flash_attention(q, k, v, segment, prefix, interpret=interpret)


def dense_reference(q_bthd, k_btkd, v_btkd, segment_bt, prefix_bt=None) -> jax.Array:
    """What `flash_attention` computes, densely: the `[B, H, T, T]` scores in fp32 under the
    module docstring's mask, K / V repeated per query head, rows that see no key 0. For tests
    and `bench/gpu_attention.py`."""
    prefix_bt = segment_bt if prefix_bt is None else prefix_bt
    q, k, v = (x.astype(jnp.float32) for x in (q_bthd, k_btkd, v_btkd))
    t = segment_bt.shape[-1]
    visible = (segment_bt[:, :, None] == segment_bt[:, None, :]) | (
        prefix_bt[:, :, None] == segment_bt[:, None, :]
    )
    mask_bqk = jnp.tril(jnp.ones((t, t), bool))[None] & visible & (segment_bt[:, None, :] > 0)
    g = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") / math.sqrt(q.shape[-1])
    seen_bq = mask_bqk.any(-1)
    s = jnp.where(mask_bqk[:, None] | ~seen_bq[:, None, :, None], s, -jnp.inf)
    out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v, precision="highest")
    return jnp.where(seen_bq[:, :, None, None], out, 0.0)

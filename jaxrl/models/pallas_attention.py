"""Causal self-attention through the Pallas TPU splash-attention kernel (`attention_impl="pallas"`).

    out[b, t, h] = sum_s softmax_s(q[b, t, h] . k[b, s, h // G] / sqrt(D) | s <= t, valid[b, s])
                   v[b, s, h // G]

with G = H / K query heads per KV head (grouped-query attention, handled by the kernel itself).
Padding is expressed as segment ids (1 real token, 0 padding): a real query sees only real keys
at or before it, exactly the `causal & valid` mask of the XLA path. Padding queries attend to
padding keys (never an empty row); their outputs are garbage that every caller masks out.

The kernel runs per example (`jax.vmap`) on each device's shard inside `jax.shard_map`: the
batch split as the rules' `act_batch` says, the heads as `act_heads` / `act_kv_heads` (tp), the
sequence whole. On a non-TPU mesh (CPU tests) the same kernel runs in Pallas interpret mode,
which is how its numerics are checked against the XLA path.

Used for self-attention over a whole sequence (training, the engine's prefill); decode steps
(one query against a cache) and the static sampler's prefill (a cache longer than the prompt)
stay on the XLA path. Sequence lengths must be multiples of 128 (the kernel's lane width).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax.core import spmd as flax_spmd

from jaxrl.infra import sharding as ax

LANES = 128


def _platform() -> str:
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty:
        return mesh.abstract_device.platform
    return jax.default_backend()


def _kernel(num_heads: int, q_len: int, kv_len: int, interpret: bool):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    block_q, block_kv = min(512, q_len), min(512, kv_len)
    blocks = sk.BlockSizes(
        block_q=block_q,
        block_kv=block_kv,
        block_kv_compute=block_kv,
        block_q_dkv=block_q,
        block_kv_dkv=block_kv,
        block_kv_dkv_compute=block_kv,
        block_q_dq=block_q,
        block_kv_dq=block_kv,
    )
    mask = sm.MultiHeadMask([sm.CausalMask((q_len, kv_len)) for _ in range(num_heads)])
    return sk.make_splash_mha(
        mask, block_sizes=blocks, head_shards=1, q_seq_shards=1, interpret=interpret
    )


def _local_attention(q_bthd, k_bskd, v_bskd, valid_bs, *, interpret: bool):
    """Attention of one device's shard (no collectives)."""
    _, t, h, d = q_bthd.shape
    s = k_bskd.shape[1]
    kernel = _kernel(h, t, s, interpret)
    from jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_kernel import (
        SegmentIds,
    )

    scale = 1.0 / (d**0.5)
    q_bhtd = jnp.swapaxes(q_bthd * jnp.asarray(scale, q_bthd.dtype), 1, 2)
    k_bksd = jnp.swapaxes(k_bskd, 1, 2)
    v_bksd = jnp.swapaxes(v_bskd, 1, 2)
    ids_bs = valid_bs.astype(jnp.int32)

    def one(q, k, v, ids):
        return kernel(q, k, v, segment_ids=SegmentIds(q=ids[-t:], kv=ids))

    out_bhtd = jax.vmap(one)(q_bhtd, k_bksd, v_bksd, ids_bs)
    return jnp.swapaxes(out_bhtd, 1, 2).astype(q_bthd.dtype)


def splash_self_attention(
    q_bthd: jax.Array, k_bskd: jax.Array, v_bskd: jax.Array, valid_bs: jax.Array
) -> jax.Array:
    """Causal attention `[B, T, H, D]` of `q` over keys `[B, S, K, D]` (S = T) where
    `valid_bs` marks real tokens; sharded by the installed rules (see the module docstring)."""
    t, s = q_bthd.shape[1], k_bskd.shape[1]
    if t != s or t % LANES:
        raise ValueError(
            f"attention_impl='pallas' needs self-attention over a multiple of {LANES} tokens "
            f"(query length {t}, key length {s}); pad the sequence (e.g. prompt and completion "
            "lengths that are multiples of 128) or use attention_impl='xla'"
        )
    interpret = _platform() != "tpu"
    local = functools.partial(_local_attention, interpret=interpret)
    rules = flax_spmd.get_logical_axis_rules()
    mesh = jax.sharding.get_abstract_mesh()
    if not rules or mesh.empty:
        return local(q_bthd, k_bskd, v_bskd, valid_bs)
    spec = lambda *axes: ax.logical_to_pspec(axes, rules)
    q_spec = spec(ax.ACT_BATCH, None, ax.ACT_HEADS, None)
    kv_spec = spec(ax.ACT_BATCH, None, ax.ACT_KV_HEADS, None)
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(q_spec, kv_spec, kv_spec, spec(ax.ACT_BATCH, None)),
        out_specs=q_spec,
        check_vma=False,
    )(q_bthd, k_bskd, v_bskd, valid_bs)

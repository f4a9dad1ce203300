"""Running the library's Pallas kernels per device: the partitioner cannot split a kernel call,
so under installed logical-axis rules each kernel runs inside `jax.shard_map` on its device's
shard, the dimensions split as the rules say. Shared by the GPU and TPU kernels
(`gpu_attention`, `tpu_attention`, `decode_kernel`, `decode_kernel_tpu`)."""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
from flax.core import spmd as flax_spmd

from jaxrl.infra import sharding as ax


def self_attention_per_device(local: Callable, q_bthd, k_btkd, v_btkd, mask) -> jax.Array:
    """`local(q, k, v, segment, prefix)` (a fused self-attention over the per-token mask,
    `mask` a `jaxrl.models.masks.SegmentMask`) on each device's shard: the batch split as
    `act_batch` says, the query and kv heads as `act_heads` / `act_kv_heads`, the sequence
    whole; a dimension the mapped axes do not divide (the engine's prefill of one prompt on a
    dp mesh) stays whole, and the heads stay whole unless query and kv heads both split (a
    query head's kv head must be on its device). Directly without rules or a mesh."""
    segment, prefix = mask.segment_bt, mask.prefix_bt
    prefix = segment if prefix is None else prefix
    rules = flax_spmd.get_logical_axis_rules()
    mesh = jax.sharding.get_abstract_mesh()
    if not rules or mesh.empty:
        return local(q_bthd, k_btkd, v_btkd, segment, prefix)

    def split(logical, size):
        (mapped,) = ax.logical_to_pspec((logical,), rules)
        names = (mapped,) if isinstance(mapped, str) else tuple(mapped or ())
        return mapped if size % math.prod(mesh.shape[n] for n in names) == 0 else None

    batch = split(ax.ACT_BATCH, q_bthd.shape[0])
    heads = split(ax.ACT_HEADS, q_bthd.shape[2])
    kv_heads = split(ax.ACT_KV_HEADS, k_btkd.shape[2])
    if (heads is None) != (kv_heads is None):
        heads = kv_heads = None
    P = jax.sharding.PartitionSpec
    q_spec, kv_spec = P(batch, None, heads, None), P(batch, None, kv_heads, None)
    ids_spec = P(batch)
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(q_spec, kv_spec, kv_spec, ids_spec, ids_spec),
        out_specs=q_spec,
        check_vma=False,
    )(q_bthd, k_btkd, v_btkd, segment, prefix)


def decode_per_device(local: Callable, layer_1, q_bkgd, k_cache, v_cache, visible_bc) -> jax.Array:
    """`local(layer_1, q, keys, values, visible)` (a decode kernel: q `[B, K, G, D]` over a
    cache `[[L,] B, C, K, D]`, visibility `[B, C]`) on each device's shard: rows as
    `act_batch`, KV heads as `act_kv_heads`, positions and layers whole. Directly without rules
    or a mesh."""
    rules = flax_spmd.get_logical_axis_rules()
    mesh = jax.sharding.get_abstract_mesh()
    if not rules or mesh.empty:
        return local(layer_1, q_bkgd, k_cache, v_cache, visible_bc)
    spec = lambda *axes: ax.logical_to_pspec(axes, rules)  # noqa: E731
    q_spec = spec(ax.ACT_BATCH, ax.ACT_KV_HEADS, None, None)
    lead = (None,) * (k_cache.ndim - 4)
    kv_spec = spec(*lead, ax.ACT_BATCH, None, ax.ACT_KV_HEADS, None)
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(spec(None), q_spec, kv_spec, kv_spec, spec(ax.ACT_BATCH, None)),
        out_specs=q_spec,
        check_vma=False,
    )(layer_1, q_bkgd, k_cache, v_cache, visible_bc)

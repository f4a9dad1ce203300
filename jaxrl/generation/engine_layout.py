"""The engine's weights layout and decode form (`jaxrl.generation.engine_programs`): whether its
programs run on a per-layer copy of scanned weights (`unrolls`, the module docstring there), and
the note a GPU or TPU engine prints when its decode steps cannot use the in-place kernel, and the
buckets its programs' shapes are rounded up to."""

from __future__ import annotations

import bisect
import sys
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx

from jaxrl.generation import quantize
from jaxrl.infra import sharding as ax
from jaxrl.models.config import ModelConfig
from jaxrl.models.scan import unstack_layers
from jaxrl.models.transformer import Transformer, kernel_platform

LAYER_LAYOUTS = ("auto", "stacked", "unrolled")


def note_xla_decode(config: ModelConfig, capacity: int) -> None:
    """Says on stderr, when a decode program for a GPU or TPU is traced, that its steps run in
    the XLA form (a copied prefix) because the decode kernel cannot take this cache, and what
    would let it (`transformer.in_place_decode`'s rule); silent where XLA was asked for."""
    target = kernel_platform()
    if target is None or config.attention_impl not in (None, "pallas"):
        return
    need = (
        "a cache length that is a multiple of 16 and a power-of-2 head dim"
        if target == "gpu"
        else "a cache length that is a multiple of 128 (or one block of at most 512) and a "
        "head dim that is a multiple of 128"
    )
    print(
        f"[engine] decode over a cache of {capacity} positions (head dim {config.head_dim}) "
        f"runs in the XLA form, a copied prefix each call: the {target.upper()} decode kernel "
        f"needs {need}",
        file=sys.stderr,
    )


def pure_params(params):
    return nnx.to_pure_dict(params) if isinstance(params, nnx.State) else params


def unstacker(config: ModelConfig, mesh, rules, num_layers: int, quantized: str | None = None):
    """The jitted per-layer copy of scanned weights (`unrolls`), laid out by `rules` on `mesh`
    as the unrolled model's params; `quantized`: of a tree whose kernels are already
    `QuantizedKernel`s of that format (`jaxrl.generation.quantize`)."""
    unrolled = config.replace(scan_layers=False)
    out = None
    if mesh is not None:
        abstract = nnx.state(nnx.eval_shape(lambda: Transformer(unrolled, rngs=nnx.Rngs(0))))
        out = nnx.to_pure_dict(ax.param_shardings(abstract, mesh, rules))
        if quantized is not None:
            out = quantize.quantized_shardings(out, unrolled, quantized, stacked=False)
    return jax.jit(lambda p: unstack_layers(pure_params(p), num_layers), out_shardings=out)


# "auto" makes the per-layer copy where the weights take at most this share of a device's memory
# (Llama 3 8B at TP 4 on an H100: 5%; 70B at TP 8: 21%); above it (405B at TP 8 on an H200: 67%)
# the second copy would cost the KV cache's room, and the engine decodes over the stacked weights.
UNROLL_SHARE = 0.25


def device_memory(devices) -> int | None:
    """Bytes of one device's memory: its allocator's limit, or for a device described without
    the hardware (plans) its GPU system's figure; None where neither is known."""
    from jaxrl.infra import gpu

    try:
        limit = (devices[0].memory_stats() or {}).get("bytes_limit")
    except Exception:  # deviceless topology devices have no allocator
        limit = None
    if limit:
        return int(limit)
    try:
        return gpu.device_spec(devices).hbm_bytes
    except Exception:
        return None


def unrolls(graphdef, config: ModelConfig, mesh, rules, layer_layout: str) -> bool:
    """Whether the engine runs its model with per-layer weights (module docstring): scanned
    layers of a plain `Transformer`, and "unrolled", or "auto" on a GPU mesh (else the default
    backend's) where the weights take at most `UNROLL_SHARE` of a device's memory."""
    if layer_layout not in LAYER_LAYOUTS:
        raise ValueError(f"layer_layout={layer_layout!r}; use one of {LAYER_LAYOUTS}")
    devices = list(mesh.devices.flat) if mesh is not None else jax.local_devices()[:1]
    wanted = layer_layout == "unrolled" or (layer_layout == "auto" and devices[0].platform == "gpu")
    if not config.scan_layers or not wanted:
        return False
    graph, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
    if graphdef != graph:  # a wrapped model (adapters) keeps its own layout
        return False
    if layer_layout == "unrolled":
        return True
    leaves = jax.tree.leaves(abstract)
    if mesh is not None:
        shardings = jax.tree.leaves(ax.param_shardings(abstract, mesh, rules))
        shapes = [s.shard_shape(x.shape) for x, s in zip(leaves, shardings, strict=True)]
    else:
        shapes = [x.shape for x in leaves]
    weights = sum(
        int(np.prod(shape)) * x.dtype.itemsize for shape, x in zip(shapes, leaves, strict=True)
    )
    memory = device_memory(devices)
    return memory is None or weights <= UNROLL_SHARE * memory


def bucket(n: int, buckets: Sequence[int], cap: int) -> int:
    """The smallest of `buckets` that holds `n`, capped at `cap` (`cap` past the last)."""
    i = bisect.bisect_left(buckets, n)
    return min(buckets[i] if i < len(buckets) else cap, cap)


def extend_row_buckets(active: int, lo: int = 8) -> tuple[int, ...]:
    """Row counts of an extension of continued rows among `active` slots: lo, 2 lo, ... up to
    all. Every bucketed row runs (rlbench-tiny, span 128: 8 rows add 7 ms to a 51 ms call, 32
    rows 33 ms); a smaller `lo` pays less where a forward costs its tokens, for more programs."""
    return pow2_buckets(min(lo, active), active)


def pow2_buckets(lo: int, hi: int) -> tuple[int, ...]:
    """lo, 2 lo, 4 lo, ... below hi, then hi."""
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    return (*out, hi)

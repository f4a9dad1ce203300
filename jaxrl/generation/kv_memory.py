"""What a KV cache costs, what the devices hold, and a refusal before an allocation cannot fit.

A decode engine keeps one cache of `slots x positions x layers x 2 (keys, values) x kv_heads x
head_dim` values. On a real model that is the largest allocation generation makes (SmolLM2-135M,
256 slots over its 8,192-token context in fp32: 96.6 GB), so it is checked against the memory
its devices have free before it is made, and a cache that cannot fit is refused with the figures
and the settings that shrink it, instead of an out-of-memory error (or the OOM killer) mid-run.

Free memory: on an accelerator, each device's `memory_stats()` (`bytes_limit - bytes_in_use`),
against that device's shard of the cache; on the CPU the devices share the host's memory, so the
whole cache (every device's shard) is held against the host's available memory
(`MemAvailable`). Where neither is known the check passes.
"""

from __future__ import annotations

import math

import jax
import numpy as np

from jaxrl.models.config import ModelConfig

# Share of the free memory a cache may take: the rest is left for activations (the decode
# step's logits, prefill's attention) and the allocator's slack.
CACHE_SHARE = 0.9


def cache_bytes(model_config: ModelConfig, slots: int, positions: int) -> int:
    """Bytes of a `[slots, positions]` KV cache of `model_config` (all layers, keys and values)."""
    c = model_config
    itemsize = np.dtype(c.jnp_dtype).itemsize
    return 2 * c.num_layers * slots * positions * c.num_kv_heads * c.head_dim * itemsize


def host_available_bytes() -> int | None:
    """The host's available memory (Linux `MemAvailable`), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def free_bytes(devices) -> tuple[int | None, str]:
    """(free bytes, what they are) for an allocation spread over `devices`: the host's available
    memory for CPU devices (shared by all of them), else the least free memory of one device."""
    devices = list(devices)
    if all(d.platform == "cpu" for d in devices):
        return host_available_bytes(), "the host's available memory"
    free = []
    for d in devices:
        stats = d.memory_stats() or {}
        if "bytes_limit" not in stats:
            return None, ""
        free.append(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    return min(free), f"free on each {devices[0].device_kind}"


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def check_cache_fits(
    model_config: ModelConfig,
    slots: int,
    positions: int,
    abstract_cache=None,
    devices=None,
) -> None:
    """Raises ValueError, with the figures and the fix, when a `[slots, positions]` cache would
    take more than `CACHE_SHARE` of the free memory of `devices` (default: the first local
    device). `abstract_cache`: the cache's ShapeDtypeStructs with shardings over `devices`,
    whose per-device shard is what each device holds (on the CPU all of them hold it in the
    host's memory, replicas included)."""
    devices = list(devices) if devices is not None else jax.local_devices()[:1]
    total = cache_bytes(model_config, slots, positions)
    free, what = free_bytes(devices)
    if free is None:
        return
    leaves = jax.tree.leaves(abstract_cache)
    cpu = devices[0].platform == "cpu"
    need = total
    if leaves and all(getattr(x, "sharding", None) is not None for x in leaves):
        shard = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in leaves)
        need = shard * len(devices) if cpu else shard
    if need <= CACHE_SHARE * free:
        return
    c = model_config
    detail = ""
    if need != total:
        held = f"held by the {len(devices)} devices, replicas included" if cpu else "a device"
        detail = f" ({_gb(need)} {held})"
    raise ValueError(
        f"the engine's KV cache needs {_gb(total)}{detail}: {slots} slots x {positions} "
        f"positions x {c.num_layers} layers x 2 (keys, values) x {c.num_kv_heads} KV heads x "
        f"{c.head_dim} x {np.dtype(c.jnp_dtype).name}, but {what} is {_gb(free)}. Lower the "
        "slots (num_slots=, GeneratorConfig.slots) or the cache length (max_total_len=, "
        "GeneratorConfig.max_len; leave it unset to size the cache from the requests: prompt + "
        "max_new_tokens), or run in bfloat16 (PolicySpec.dtype)"
    )

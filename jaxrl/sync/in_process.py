"""Weight sync in one process: trainer layout -> generator layout, device to device.

`WeightSync(trainer_shardings, generator_shardings)` is built once; `push(trainer_params, version)`
returns the generator's copy of the params, laid out, cast and stamped, with no host round trip.

What JAX 0.10.2 does (each point checked on CPU devices under the transfer guards):

- `jax.device_put(x, s)` copies device to device, shard by shard, only when every destination
  device's slice equals a slice some source device already holds (replicated destinations
  included: each replica is copied from some holder). Otherwise, even when a source shard merely
  *contains* the slice, or the source is fully replicated, it gathers the whole array through the
  host (it trips `jax.transfer_guard_host_to_device("disallow_explicit")`; on CPU only that one:
  device buffers are host memory, reads are zero-copy and the device-to-host guard never fires).
- Slicing a single-device array with Python indices sends the start indices from the host (the
  guard rejects it); cuts here are jitted with static bounds.
- `jax.device_put(..., donate=True)` segfaults on CPU for multi-device sources and is a no-op for
  single-device ones, so temporaries are freed with `Array.delete()`. `may_alias=False` is ignored
  when a destination device holds the slice already (colocated roles), so such leaves go through
  single-device copies, which honour it.
- XLA:CPU collectives are slow next to plain d2d copies, and get worse when device threads
  outnumber cores. Fresh CPU buffers of 32 MB and more are mmapped, so every push also pays page
  faults (`GLIBC_TUNABLES=glibc.malloc.mmap_max=0` keeps freed pages for reuse). Figures:
  docs/benchmarks.md, "Measurements behind design choices".

Two transports; both only ever copy device to device:

- "reshard" (the design's two steps; default on GPU/TPU, where collectives ride NVLink/ICI):
  when some generator slice is not already inside a trainer shard, one jit per chunk casts and
  reshards on the trainer mesh to a *shadow* layout: the generator's block grid, coarsened per
  dimension (gcd) until its block count divides the trainer device count (the rest replicates),
  with the device arrangement overlapping the trainer's own blocks most. Then a batched
  `device_put` to the generator shardings is slice for slice. Every input and output of one jit
  must list its devices in the same order, so a shadow is never a mesh over a reordered device
  list (that raised "incompatible devices for jitted computation" for fsdp 2 x tp 2 -> tp 4):
  it is a `NamedSharding` over `factor_mesh`, the trainer's devices in the trainer's order split
  into prime-sized axes, and the arrangements tried (`factor_groupings`) are the ways to hand
  those axes, in any order, to the shadow's dimensions: every transposition, merge or split of
  the trainer mesh axes, each one legal as a jit output.
- "assemble" (default on CPU, faster there): no collectives. Each generator block is tiled by the
  trainer shards it intersects; each tile is cut on its trainer device if needed, copied d2d to
  the first generator device holding the block, and joined there by one jitted `jnp.block`;
  replicas are copied from that device. This is LlamaRL's DDMA pattern: every trainer shard goes
  straight to the generator devices that need it.
In both, blocks equal to a source shard go through one batched `device_put`, blocks inside a
larger shard are cut and copied, arrays are put together with
`jax.make_array_from_single_device_arrays` (no copy), and casts run first, on the trainer.

Peak memory: pause-and-swap per chunk (default, `strategy="swap"`). Leaves are grouped in order
into chunks whose extra bytes on any one device (new generator shards, tiles before joining,
casts, shadows, cuts) stay within `chunk_bytes`; a chunk's old generator buffers are deleted as
soon as its new ones are complete. Peak = params + one chunk per device (a leaf bigger than
`chunk_bytes` is a chunk by itself; `SyncPlan` reports the real bound). Why: generator memory
bounds the KV cache and batch, and the generator pauses between batches to take new weights
anyway (as in LlamaRL); a double buffer would spend a second copy of the params to save a pause
of a fraction of a second. `strategy="double_buffer"` (peak = 2x params) serves a caller that
samples from the old weights during a push and frees them (`GeneratorParams.delete`) after.

Contract. `push(trainer_params, version, previous)` returns `(GeneratorParams(version, params),
SyncMetrics)` only after every array is complete; the generator swaps its reference in one
assignment and stamps every rollout with `GeneratorParams.version`, so behaviour log-probs are
reproducible from exactly the weights of that version. Under "swap", `previous` is consumed: the
generator must not sample from it once `push` starts (a later use raises "Array has been
deleted"). If a push fails midway under "swap" the error says the generator holds no complete
params and must be pushed again; under "double_buffer" `previous` is untouched.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl.sync.plan import (
    DEFAULT_CHUNK_BYTES,
    GeneratorParams,
    LeafRoute,
    ShardingPair,
    SyncMetrics,
    SyncPlan,
    cast_sources,
    check_options,
    cut_block,
    join_tiles,
    push_in_chunks,
    route_leaf,
    routed_plan,
)

TRANSPORTS = ("auto", "reshard", "assemble")


class WeightSync:
    """Pushes params from the trainer's shardings to the generator's, device to device.

    Args:
      trainer_shardings: pytree of shardings, one per params leaf (e.g. from `param_shardings`).
      generator_shardings: same structure, on the generator's devices.
      generator_dtype: dtype of the generator's floating-point params (None: unchanged).
      chunk_bytes: bound on the extra bytes one chunk adds to any one device.
      strategy: "swap" (peak = params + one chunk) or "double_buffer" (peak = 2x params).
      transport: "reshard", "assemble", or "auto" (assemble on CPU, reshard elsewhere).
    """

    def __init__(
        self,
        trainer_shardings: Any,
        generator_shardings: Any,
        *,
        generator_dtype=None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        strategy: str = "swap",
        transport: str = "auto",
    ):
        check_options(strategy, transport, TRANSPORTS, chunk_bytes)
        self.trees = ShardingPair(trainer_shardings, generator_shardings)
        if transport == "auto" and self.trees.trainer:
            transport = "assemble" if self.trees.platform == "cpu" else "reshard"
        self.transport = transport
        self.generator_dtype = None if generator_dtype is None else jnp.dtype(generator_dtype)
        self.chunk_bytes = int(chunk_bytes)
        self.strategy = strategy
        self._plans: dict[tuple, SyncPlan] = {}
        self._jits: dict[tuple, Callable] = {}

    def plan(self, params: Any) -> SyncPlan:
        """The routes and chunks for params of these shapes and dtypes (computed once)."""
        leaves = self.trees.leaves(params, "params")
        key = tuple((tuple(x.shape), jnp.dtype(x.dtype)) for x in leaves)
        if key not in self._plans:
            route = functools.partial(
                route_leaf, target_dtype=self.generator_dtype, transport=self.transport
            )
            self._plans[key] = SyncPlan(**routed_plan(self.trees, key, route, self.chunk_bytes))
        return self._plans[key]

    def push(
        self,
        trainer_params: Any,
        version: int,
        previous: GeneratorParams | None = None,
        *,
        on_chunk: Callable[[int], None] | None = None,
    ) -> tuple[GeneratorParams, SyncMetrics]:
        """Copies `trainer_params` into the generator layout and stamps them with `version`.

        `previous` (the generator's current params) is freed chunk by chunk under "swap" and left
        alone under "double_buffer". `on_chunk(i)` runs at each chunk's high-water mark (new
        shards complete, old shards and temporaries not yet freed): a hook for memory probes.
        """
        return push_in_chunks(self, trainer_params, version, previous, on_chunk)

    def move_chunk(self, routes, leaves, new) -> list[jax.Array]:
        """Moves one chunk into `new`; returns the temporaries to free after the high-water
        mark."""
        made = [r for r in routes if r.resharded or r.cast]
        sources, temporaries = cast_sources(self._jits, routes, made, leaves)
        direct = [r.index for r in routes if not r.blocks]
        arrived = jax.device_put(
            [sources[i] for i in direct], [self.trees.generator[i] for i in direct], may_alias=False
        )
        results = dict(zip(direct, arrived, strict=True))
        for route in routes:
            if route.blocks:
                results[route.index] = self._assemble(route, sources[route.index], temporaries)
        jax.block_until_ready([results[r.index] for r in routes])
        for route in routes:
            new[route.index] = results[route.index]
        return temporaries

    def _assemble(self, route: LeafRoute, source: jax.Array, temporaries: list) -> jax.Array:
        """Tiles to each block's first target (d2d), joined there, copied to the replicas."""
        shards = {shard.device: shard.data for shard in source.addressable_shards}
        cuts: dict[tuple, jax.Array] = {}
        pieces, destinations = [], []
        for delivery in route.blocks:
            for tile in delivery.tiles:
                piece = shards[tile.source_device]
                if tile.cut is not None:
                    key = (tile.source_device, tile.cut)
                    if key not in cuts:
                        cuts[key] = cut_block(piece, *tile.cut)
                        temporaries.append(cuts[key])
                    piece = cuts[key]
                pieces.append(piece)
                destinations.append(delivery.targets[0])
        moved = iter(jax.device_put(pieces, destinations, may_alias=False))
        first = []
        for delivery in route.blocks:
            tiles = [next(moved) for _ in delivery.tiles]
            if len(tiles) > 1:
                temporaries.extend(tiles)
                first.append(join_tiles(tiles, delivery.grid))
            else:
                first.append(tiles[0])
        replicas = [(b, t) for b, d in zip(first, route.blocks, strict=True) for t in d.targets[1:]]
        copies = jax.device_put([b for b, _ in replicas], [t for _, t in replicas], may_alias=False)
        by_device = {d.targets[0]: b for b, d in zip(first, route.blocks, strict=True)}
        by_device.update(zip((t for _, t in replicas), copies, strict=True))
        sharding = self.trees.generator[route.index]
        arrays = [by_device[d] for d in sharding.devices_indices_map(route.shape)]
        return jax.make_array_from_single_device_arrays(route.shape, sharding, arrays)

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

import collections
import dataclasses
import functools
import itertools
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

STRATEGIES = ("swap", "double_buffer")
TRANSPORTS = ("auto", "reshard", "assemble")
DEFAULT_CHUNK_BYTES = 64 << 20

Block = tuple[tuple[int, int], ...]  # per dimension [start, stop)


@dataclasses.dataclass(frozen=True)
class GeneratorParams:
    """The generator's params and the policy version they are the weights of."""

    version: int
    params: Any

    def delete(self) -> None:
        """Frees the device buffers (double buffer: once no batch samples from them any more)."""
        for leaf in jax.tree.leaves(self.params):
            if not leaf.is_deleted():
                leaf.delete()


@dataclasses.dataclass(frozen=True)
class SyncMetrics:
    """One push. `bytes_moved` counts every byte written to generator devices (replicas
    included); `params_bytes` is one copy of the params in the generator dtype."""

    version: int
    bytes_moved: int
    params_bytes: int
    seconds: float
    num_chunks: int
    peak_extra_bytes: int  # planned bound per device: the largest chunk's footprint

    @property
    def gbps(self) -> float:
        return self.bytes_moved / self.seconds / 1e9


@dataclasses.dataclass(frozen=True)
class Tile:
    """Part of a generator block held by one source shard; `cut` is (start, limit) inside that
    shard, or None when the tile is the whole shard."""

    source_device: jax.Device
    cut: tuple[tuple[int, ...], tuple[int, ...]] | None


@dataclasses.dataclass(frozen=True)
class BlockDelivery:
    """One distinct generator block: tiles (row-major over `grid`) joined on `targets[0]`, then
    copied to the other targets (replicas)."""

    targets: tuple[jax.Device, ...]
    tiles: tuple[Tile, ...]
    grid: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class LeafRoute:
    """How one parameter travels (module docstring)."""

    index: int  # position among the flattened leaves
    path: str
    shape: tuple[int, ...]
    dtype: Any  # generator dtype
    source_sharding: Sharding  # the trainer's, or a shadow layout on the trainer devices
    resharded: bool  # source is a shadow layout (collectives on the trainer mesh)
    cast: bool
    blocks: tuple[BlockDelivery, ...]  # empty: one slice-for-slice device_put does it all
    extra_bytes: dict[int, int]  # device id -> bytes this leaf adds there during its chunk
    moved_bytes: int

    @property
    def kind(self) -> str:
        tiles = [t for b in self.blocks for t in b.tiles]
        how = "device_put" if not tiles else "joined" if len(tiles) > len(self.blocks) else "cut"
        how = how if how != "cut" or any(t.cut for t in tiles) else "copied"
        return how + (" after shadow" if self.resharded else "")


@dataclasses.dataclass(frozen=True)
class SyncPlan:
    routes: tuple[LeafRoute, ...]
    chunks: tuple[tuple[int, ...], ...]  # leaf indices
    chunk_extra_bytes: tuple[int, ...]  # per chunk, max over devices
    params_bytes: int
    bytes_moved: int

    @property
    def peak_extra_bytes(self) -> int:
        return max(self.chunk_extra_bytes, default=0)


def live_bytes_by_device() -> dict[int, int]:
    """Bytes of live jax arrays per device id (each device buffer counted once)."""
    seen: set[tuple[int, int]] = set()
    totals: dict[int, int] = collections.defaultdict(int)
    for array in jax.live_arrays():
        if array.is_deleted():
            continue
        for shard in array.addressable_shards:
            key = (shard.device.id, shard.data.unsafe_buffer_pointer())
            if key not in seen:
                seen.add(key)
                totals[shard.device.id] += shard.data.nbytes
    return dict(totals)


def _blocks(sharding: Sharding, shape: tuple[int, ...]) -> dict[jax.Device, Block]:
    return {
        device: tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))
        for device, index in sharding.devices_indices_map(shape).items()
    }


def _intersect(a: Block, b: Block) -> Block | None:
    out = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b, strict=True))
    return out if all(start < stop for start, stop in out) else None


def _volume(block: Block) -> int:
    return math.prod(stop - start for start, stop in block)


def _grid(blocks: Sequence[Block], shape: tuple[int, ...], what: str) -> tuple[int, ...]:
    """Blocks along each dimension; the blocks must split every dimension evenly."""
    grid = []
    for dim, size in enumerate(shape):
        spans = {block[dim] for block in blocks}
        if size % len(spans) or any(b - a != size // len(spans) for a, b in spans):
            raise ValueError(
                f"{what}: dimension {dim} (size {size}) is split unevenly {sorted(spans)}; "
                "weight sync needs every sharded dimension divisible by its mesh axes."
            )
        grid.append(len(spans))
    return tuple(grid)


def _prime_factors(n: int) -> list[int]:
    factors, p = [], 2
    while n > 1:
        while n % p == 0:
            factors.append(p)
            n //= p
        p += 1
    return factors


def device_order(sharding: Sharding) -> tuple[jax.Device, ...]:
    """The sharding's device assignment: the order a jit over it lists its devices in. Every
    input and output sharding of one jit must have the same one."""
    if isinstance(sharding, NamedSharding):
        return tuple(sharding.mesh.devices.flat)
    order = getattr(sharding, "_device_assignment", None)  # no public reader
    return tuple(order) if order else tuple(sorted(sharding.device_set, key=lambda d: d.id))


@functools.cache
def factor_mesh(devices: tuple[jax.Device, ...], shape: tuple[int, ...]) -> Mesh:
    """`devices` (in this order) as a mesh of prime-sized axes, each a factor of one axis of
    `shape` (major first). A layout on this mesh keeps the device order, so a jit may take
    inputs on the original layout and write outputs on it; and any way of splitting the
    devices into a grid that follows the original axes (transposed, merged, split) is one."""
    sizes = [p for n in shape for p in _prime_factors(n)] or [1]
    grid = np.asarray(devices, dtype=object).reshape(sizes)
    return Mesh(grid, tuple(f"f{i}" for i in range(len(sizes))))


def factor_groupings(
    mesh: Mesh, sizes: Sequence[int], limit: int = 720
) -> list[tuple[tuple[str, ...], ...]]:
    """Ways to give each entry of `sizes` (which multiply to the mesh size) a tuple of the
    factor mesh's axes, major first, whose sizes multiply to it. The mesh's own axis order comes
    first; at most `limit` axis orders are tried (all of them up to 6 factor axes, i.e. 64
    devices of size-2 factors)."""
    axes = [(name, n) for name, n in zip(mesh.axis_names, mesh.devices.shape, strict=True) if n > 1]
    found: dict[tuple, None] = {}
    for order in itertools.islice(itertools.permutations(axes), limit):
        groups, position = [], 0
        for size in sizes:
            group, product = [], 1
            while product < size and position < len(order):
                group.append(order[position][0])
                product *= order[position][1]
                position += 1
            if product != size:
                break
            groups.append(tuple(group))
        else:
            if position == len(order):
                found[tuple(groups)] = None
    return list(found)


def _spec_entry(axes: tuple[str, ...]):
    return None if not axes else axes[0] if len(axes) == 1 else axes


def _overlap(candidate: Sharding, current: dict[jax.Device, Block], shape) -> int:
    total = 0
    for device, block in _blocks(candidate, shape).items():
        common = _intersect(block, current[device])
        total += 0 if common is None else _volume(common)
    return total


@functools.cache
def _shadow_sharding(
    trainer_sharding: Sharding, generator_grid: tuple[int, ...], shape: tuple[int, ...]
) -> NamedSharding:
    """A layout on the trainer devices, in the trainer's device order (one jit reshards into
    it), whose blocks are generator blocks or unions of them: the generator's block grid,
    coarsened per dimension (gcd) until its block count divides the trainer device count (the
    rest replicates), with the device arrangement that overlaps the trainer's own blocks most
    (fewest bytes through the collectives)."""
    grid, left = [], len(trainer_sharding.device_set)
    for g in generator_grid:
        grid.append(math.gcd(g, left))
        left //= grid[-1]
    order = device_order(trainer_sharding)
    shape_of = (
        trainer_sharding.mesh.devices.shape
        if isinstance(trainer_sharding, NamedSharding)
        else (len(order),)
    )
    mesh = factor_mesh(order, shape_of)
    current = _blocks(trainer_sharding, shape)
    best, best_overlap = None, -1
    for groups in factor_groupings(mesh, (left, *grid)):
        candidate = NamedSharding(mesh, PartitionSpec(*map(_spec_entry, groups[1:])))
        overlap = _overlap(candidate, current, shape)
        if overlap > best_overlap:
            best, best_overlap = candidate, overlap
    return best


def _deliveries(
    source_blocks: dict[jax.Device, Block], gen_blocks: dict[jax.Device, Block]
) -> tuple[BlockDelivery, ...]:
    """For each distinct generator block: its targets and the source tiles that make it up."""
    targets: dict[Block, list[jax.Device]] = collections.defaultdict(list)
    for device, block in gen_blocks.items():
        targets[block].append(device)
    holders: dict[Block, list[jax.Device]] = collections.defaultdict(list)
    for device, block in source_blocks.items():
        holders[block].append(device)
    reads: collections.Counter = collections.Counter()
    deliveries = []
    for gen_block, devices in targets.items():
        tiles, starts = [], []
        for source_block in sorted(holders):  # row-major over the tile grid
            common = _intersect(source_block, gen_block)
            if common is None:
                continue
            device = min(holders[source_block], key=lambda d: (reads[d], d.id))  # spread reads
            reads[device] += 1
            offset = [start for start, _ in source_block]
            cut = (
                tuple(a - o for (a, _), o in zip(common, offset, strict=True)),
                tuple(b - o for (_, b), o in zip(common, offset, strict=True)),
            )
            tiles.append(Tile(device, None if common == source_block else cut))
            starts.append([start for start, _ in common])
        grid = tuple(len(set(column)) for column in zip(*starts, strict=True)) if starts else ()
        deliveries.append(BlockDelivery(tuple(devices), tuple(tiles), grid))
    return tuple(deliveries)


def _route(index, path, shape, dtype, trainer, generator, target_dtype, transport) -> LeafRoute:
    shape = tuple(shape)
    floating = jnp.issubdtype(dtype, jnp.floating)
    out_dtype = jnp.dtype(target_dtype if target_dtype is not None and floating else dtype)
    trainer_blocks = _blocks(trainer, shape)
    gen_blocks = _blocks(generator, shape)
    covered = all(
        any(_intersect(tb, gb) == gb for tb in trainer_blocks.values())
        for gb in gen_blocks.values()
    )
    source, source_blocks = trainer, trainer_blocks
    if transport == "reshard" and not covered:
        grid = _grid(list(gen_blocks.values()), shape, f"generator sharding of {path} {shape}")
        source = _shadow_sharding(trainer, grid, shape)
        source_blocks = _blocks(source, shape)
    cast = out_dtype != jnp.dtype(dtype)
    # device_put ignores may_alias=False when a generator device is also a source device
    # (colocated), and would alias buffers we free; single-device copies honour it.
    colocated = bool(set(gen_blocks) & set(source_blocks))
    exact = set(gen_blocks.values()) <= set(source_blocks.values()) and not colocated
    blocks = () if exact else _deliveries(source_blocks, gen_blocks)
    extra: dict[int, int] = collections.defaultdict(int)
    if source is not trainer or cast:  # a jit writes a new source array
        for device, block in source_blocks.items():
            extra[device.id] += _volume(block) * out_dtype.itemsize
    for device, block in gen_blocks.items():
        extra[device.id] += _volume(block) * out_dtype.itemsize
    cuts = set()
    for delivery in blocks:
        block_bytes = _volume(gen_blocks[delivery.targets[0]]) * out_dtype.itemsize
        if len(delivery.tiles) > 1:  # the tiles wait on targets[0] until joined
            extra[delivery.targets[0].id] += block_bytes
        for tile in delivery.tiles:
            if tile.cut is not None and (tile.source_device, tile.cut) not in cuts:
                cuts.add((tile.source_device, tile.cut))
                volume = math.prod(b - a for a, b in zip(*tile.cut, strict=True))
                extra[tile.source_device.id] += volume * out_dtype.itemsize
    return LeafRoute(
        index=index,
        path=path,
        shape=shape,
        dtype=out_dtype,
        source_sharding=source,
        resharded=source is not trainer,
        cast=cast,
        blocks=blocks,
        extra_bytes=dict(extra),
        moved_bytes=sum(_volume(b) for b in gen_blocks.values()) * out_dtype.itemsize,
    )


def _pack_chunks(routes: Sequence[LeafRoute], chunk_bytes: int):
    """Greedy, in order: a chunk grows while its largest per-device footprint fits."""
    chunks: list[list[int]] = []
    footprints: list[int] = []
    usage: collections.Counter = collections.Counter()
    for i, route in enumerate(routes):
        grown = usage + collections.Counter(route.extra_bytes)
        if not chunks or max(grown.values(), default=0) > chunk_bytes:
            chunks.append([])
            footprints.append(0)
            grown = collections.Counter(route.extra_bytes)
        chunks[-1].append(i)
        footprints[-1] = max(grown.values(), default=0)
        usage = grown
    return tuple(map(tuple, chunks)), tuple(footprints)


_JITS: dict[tuple, Callable] = {}


def _cut(array: jax.Array, start: tuple[int, ...], limit: tuple[int, ...]) -> jax.Array:
    key = ("cut", start, limit)  # static bounds: Python indices would come from the host
    if key not in _JITS:
        _JITS[key] = jax.jit(lambda x: jax.lax.slice(x, start, limit))
    return _JITS[key](array)


def _join(tiles: Sequence[jax.Array], grid: tuple[int, ...]) -> jax.Array:
    """`jnp.block` of row-major `tiles` over `grid`, on the tiles' device."""

    def nest(flat, dims):
        if not dims:
            return flat[0]
        step = len(flat) // dims[0]
        return [nest(flat[j * step : (j + 1) * step], dims[1:]) for j in range(dims[0])]

    key = ("join", grid)
    if key not in _JITS:
        _JITS[key] = jax.jit(lambda *xs: jnp.block(nest(list(xs), grid)))
    return _JITS[key](*tiles)


def cast_sources(
    jits: dict, routes: Sequence, made: Sequence, leaves: list[jax.Array]
) -> tuple[dict[int, jax.Array], list[jax.Array]]:
    """A chunk's source arrays on the trainer: the params themselves, except the `made` routes,
    cast and / or resharded to their `source_sharding` (laid out in the trainer's device order)
    by one jit per trainer device order (cached in `jits`). Returns (sources by leaf index, the
    new arrays, which the caller frees)."""
    sources = {r.index: leaves[r.index] for r in routes}
    groups: dict[tuple, list] = collections.defaultdict(list)
    for route in made:
        groups[device_order(leaves[route.index].sharding)].append(route)
    new = []
    for order, group in groups.items():
        for route in group:
            if device_order(route.source_sharding) != order:
                raise AssertionError(  # the planners build every layout in the trainer's order
                    f"{route.path}: the layout {route.source_sharding} lists the trainer's "
                    "devices in another order; one jit cannot reshard into it."
                )
        key = tuple((r.index, r.shape, r.dtype, r.source_sharding) for r in group)
        if key not in jits:
            dtypes = [r.dtype for r in group]
            jits[key] = jax.jit(
                lambda xs, dtypes=dtypes: [x.astype(d) for x, d in zip(xs, dtypes, strict=True)],
                out_shardings=[r.source_sharding for r in group],
            )
        outs = jits[key]([leaves[r.index] for r in group])
        sources.update(zip((r.index for r in group), outs, strict=True))
        new.extend(outs)
    return sources, new


def push_in_chunks(
    sync, plan, leaves, old, previous, version: int, start: float, move_chunk, on_chunk
) -> tuple[GeneratorParams, SyncMetrics]:
    """The push loop every transport shares. Checks the trainer layout, then per chunk:
    `move_chunk(routes, leaves, new)` (fills `new`, returns temporaries) -> `on_chunk(i)` at the
    high-water mark -> frees the temporaries and, under "swap", the previous version's leaves of
    the chunk. On failure, frees what arrived and says whether the generator still holds
    complete weights."""
    for route, leaf, expected in zip(plan.routes, leaves, sync._trainer, strict=True):
        if not leaf.sharding.is_equivalent_to(expected, leaf.ndim):
            raise ValueError(
                f"trainer param {route.path} has sharding {leaf.sharding}, but this weight sync "
                f"was built for {expected}; rebuild it with the trainer's shardings."
            )
    new: list[jax.Array | None] = [None] * len(leaves)
    done = 0
    try:
        for i, chunk in enumerate(plan.chunks):
            routes = [plan.routes[j] for j in chunk]
            temporaries = move_chunk(routes, leaves, new)
            if on_chunk is not None:
                on_chunk(i)
            for array in temporaries:
                if not array.is_deleted():
                    array.delete()
            if old is not None and sync.strategy == "swap":
                for route in routes:
                    old[route.index].delete()
            done += 1
    except Exception as err:
        for array in new:
            if array is not None and not array.is_deleted():
                array.delete()
        if old is not None and sync.strategy == "swap" and done:
            raise RuntimeError(
                f"weight push of version {version} failed after {done} of "
                f"{len(plan.chunks)} chunks; the generator's previous params (version "
                f"{previous.version}) are partly freed, so it holds no complete weights: "
                "push again before sampling."
            ) from err
        raise
    metrics = SyncMetrics(
        version=version,
        bytes_moved=plan.bytes_moved,
        params_bytes=plan.params_bytes,
        seconds=time.perf_counter() - start,
        num_chunks=len(plan.chunks),
        peak_extra_bytes=plan.peak_extra_bytes,
    )
    return GeneratorParams(version, jax.tree.unflatten(sync._treedef, new)), metrics


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
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy={strategy!r}; expected one of {STRATEGIES}.")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport={transport!r}; expected one of {TRANSPORTS}.")
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes={chunk_bytes} must be positive.")
        with_paths, self._treedef = jax.tree_util.tree_flatten_with_path(trainer_shardings)
        gen_leaves, gen_treedef = jax.tree.flatten(generator_shardings)
        if gen_treedef != self._treedef:
            raise ValueError(
                "trainer and generator shardings have different tree structures:\n"
                f"  trainer:   {self._treedef}\n  generator: {gen_treedef}"
            )
        self._paths = [jax.tree_util.keystr(p) for p, _ in with_paths]
        self._trainer = [s for _, s in with_paths]
        self._generator = gen_leaves
        for path, t, g in zip(self._paths, self._trainer, self._generator, strict=True):
            if not (isinstance(t, Sharding) and isinstance(g, Sharding)):
                raise TypeError(f"{path}: expected jax Shardings, got {t!r} and {g!r}.")
        if transport == "auto" and self._trainer:
            on_cpu = next(iter(self._trainer[0].device_set)).platform == "cpu"
            transport = "assemble" if on_cpu else "reshard"
        self.transport = transport
        self.generator_dtype = None if generator_dtype is None else jnp.dtype(generator_dtype)
        self.chunk_bytes = int(chunk_bytes)
        self.strategy = strategy
        self._plans: dict[tuple, SyncPlan] = {}
        self._jits: dict[tuple, Callable] = {}

    def plan(self, params: Any) -> SyncPlan:
        """The routes and chunks for params of these shapes and dtypes (computed once)."""
        leaves = self._leaves(params, "params")
        key = tuple((tuple(x.shape), jnp.dtype(x.dtype)) for x in leaves)
        if key not in self._plans:
            routes = tuple(
                _route(i, path, shape, dtype, t, g, self.generator_dtype, self.transport)
                for i, (path, (shape, dtype), t, g) in enumerate(
                    zip(self._paths, key, self._trainer, self._generator, strict=True)
                )
            )
            chunks, footprints = _pack_chunks(routes, self.chunk_bytes)
            self._plans[key] = SyncPlan(
                routes=routes,
                chunks=chunks,
                chunk_extra_bytes=footprints,
                params_bytes=sum(math.prod(r.shape) * r.dtype.itemsize for r in routes),
                bytes_moved=sum(r.moved_bytes for r in routes),
            )
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
        start = time.perf_counter()
        leaves = self._leaves(trainer_params, "trainer_params")
        plan = self.plan(trainer_params)
        old = self._check_previous(previous, plan, version)
        return push_in_chunks(
            self, plan, leaves, old, previous, version, start, self._move_chunk, on_chunk
        )

    def _leaves(self, params: Any, what: str) -> list[jax.Array]:
        leaves, treedef = jax.tree.flatten(params)
        if treedef != self._treedef:
            raise ValueError(
                f"{what} do not have the structure of the shardings given to WeightSync:\n"
                f"  {what}: {treedef}\n  shardings: {self._treedef}"
            )
        return leaves

    def _check_previous(self, previous, plan: SyncPlan, version: int):
        if not isinstance(version, int | np.integer) or version < 0:
            raise ValueError(f"version={version!r} must be a non-negative int.")
        if previous is None:
            return None
        if version <= previous.version:
            raise ValueError(
                f"pushing version {version} over version {previous.version}: policy versions "
                "must increase."
            )
        old = self._leaves(previous.params, "previous.params")
        for route, leaf in zip(plan.routes, old, strict=True):
            if leaf.is_deleted():
                raise ValueError(
                    f"previous params (version {previous.version}) were already freed "
                    f"({route.path}); under 'swap' a push consumes them, so pass the params "
                    "the last push returned."
                )
            if (tuple(leaf.shape), leaf.dtype) != (route.shape, route.dtype):
                raise ValueError(
                    f"previous {route.path}: {leaf.aval}, not {route.dtype}{list(route.shape)}"
                )
        return old

    def _move_chunk(self, routes, leaves, new) -> list[jax.Array]:
        """Moves one chunk into `new`; returns the temporaries to free after the high-water
        mark."""
        made = [r for r in routes if r.resharded or r.cast]
        sources, temporaries = cast_sources(self._jits, routes, made, leaves)
        direct = [r.index for r in routes if not r.blocks]
        arrived = jax.device_put(
            [sources[i] for i in direct], [self._generator[i] for i in direct], may_alias=False
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
                        cuts[key] = _cut(piece, *tile.cut)
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
                first.append(_join(tiles, delivery.grid))
            else:
                first.append(tiles[0])
        replicas = [(b, t) for b, d in zip(first, route.blocks, strict=True) for t in d.targets[1:]]
        copies = jax.device_put([b for b, _ in replicas], [t for _, t in replicas], may_alias=False)
        by_device = {d.targets[0]: b for b, d in zip(first, route.blocks, strict=True)}
        by_device.update(zip((t for _, t in replicas), copies, strict=True))
        sharding = self._generator[route.index]
        arrays = [by_device[d] for d in sharding.devices_indices_map(route.shape)]
        return jax.make_array_from_single_device_arrays(route.shape, sharding, arrays)

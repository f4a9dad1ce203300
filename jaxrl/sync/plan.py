"""Planning a weight push: which bytes go from which trainer device to which generator device.

The transports (`in_process.WeightSync`, `cross_process.CrossProcessWeightSync`; read
`in_process`'s docstring for what JAX does and the two in-process transports) share this
module: the tree checks (`ShardingPair`), block geometry (`device_blocks`, `intersect`,
`volume`), the per-leaf routes (`route_leaf`: shadow layouts, tiles, cuts), chunking under a
per-device byte bound (`pack_chunks`), the cast / reshard jits (`cast_sources`) and the chunked
push loop with its failure handling (`push_in_chunks`).
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


def device_blocks(sharding: Sharding, shape: tuple[int, ...]) -> dict[jax.Device, Block]:
    return {
        device: tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))
        for device, index in sharding.devices_indices_map(shape).items()
    }


def intersect(a: Block, b: Block) -> Block | None:
    out = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b, strict=True))
    return out if all(start < stop for start, stop in out) else None


def volume(block: Block) -> int:
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


def spec_entry(axes: tuple[str, ...]):
    return None if not axes else axes[0] if len(axes) == 1 else axes


def block_overlap(candidate: Sharding, current: dict[jax.Device, Block], shape) -> int:
    total = 0
    for device, block in device_blocks(candidate, shape).items():
        common = intersect(block, current[device])
        total += 0 if common is None else volume(common)
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
    current = device_blocks(trainer_sharding, shape)
    best, best_overlap = None, -1
    for groups in factor_groupings(mesh, (left, *grid)):
        candidate = NamedSharding(mesh, PartitionSpec(*map(spec_entry, groups[1:])))
        overlap = block_overlap(candidate, current, shape)
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
            common = intersect(source_block, gen_block)
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


def route_leaf(index, path, shape, dtype, trainer, generator, target_dtype, transport) -> LeafRoute:
    shape = tuple(shape)
    floating = jnp.issubdtype(dtype, jnp.floating)
    out_dtype = jnp.dtype(target_dtype if target_dtype is not None and floating else dtype)
    trainer_blocks = device_blocks(trainer, shape)
    gen_blocks = device_blocks(generator, shape)
    covered = all(
        any(intersect(tb, gb) == gb for tb in trainer_blocks.values()) for gb in gen_blocks.values()
    )
    source, source_blocks = trainer, trainer_blocks
    if transport == "reshard" and not covered:
        grid = _grid(list(gen_blocks.values()), shape, f"generator sharding of {path} {shape}")
        source = _shadow_sharding(trainer, grid, shape)
        source_blocks = device_blocks(source, shape)
    cast = out_dtype != jnp.dtype(dtype)
    # device_put ignores may_alias=False when a generator device is also a source device
    # (colocated), and would alias buffers we free; single-device copies honour it.
    colocated = bool(set(gen_blocks) & set(source_blocks))
    exact = set(gen_blocks.values()) <= set(source_blocks.values()) and not colocated
    blocks = () if exact else _deliveries(source_blocks, gen_blocks)
    extra: dict[int, int] = collections.defaultdict(int)
    if source is not trainer or cast:  # a jit writes a new source array
        for device, block in source_blocks.items():
            extra[device.id] += volume(block) * out_dtype.itemsize
    for device, block in gen_blocks.items():
        extra[device.id] += volume(block) * out_dtype.itemsize
    cuts = set()
    for delivery in blocks:
        block_bytes = volume(gen_blocks[delivery.targets[0]]) * out_dtype.itemsize
        if len(delivery.tiles) > 1:  # the tiles wait on targets[0] until joined
            extra[delivery.targets[0].id] += block_bytes
        for tile in delivery.tiles:
            if tile.cut is not None and (tile.source_device, tile.cut) not in cuts:
                cuts.add((tile.source_device, tile.cut))
                cut_size = math.prod(b - a for a, b in zip(*tile.cut, strict=True))
                extra[tile.source_device.id] += cut_size * out_dtype.itemsize
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
        moved_bytes=sum(volume(b) for b in gen_blocks.values()) * out_dtype.itemsize,
    )


def pack_chunks(routes: Sequence[LeafRoute], chunk_bytes: int):
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


def routed_plan(trees: ShardingPair, key: tuple, make_route: Callable, chunk_bytes: int) -> dict:
    """The fields every sync plan has, for leaves of shapes and dtypes `key`: one route per leaf
    (`make_route(i, path, shape, dtype, trainer sharding, generator sharding)`), the routes in
    chunks of at most `chunk_bytes` extra bytes a device, the params' and the moved bytes."""
    routes = tuple(
        make_route(i, path, shape, dtype, t, g)
        for i, (path, (shape, dtype), t, g) in enumerate(
            zip(trees.paths, key, trees.trainer, trees.generator, strict=True)
        )
    )
    chunks, footprints = pack_chunks(routes, chunk_bytes)
    return dict(
        routes=routes,
        chunks=chunks,
        chunk_extra_bytes=footprints,
        params_bytes=sum(math.prod(r.shape) * r.dtype.itemsize for r in routes),
        bytes_moved=sum(r.moved_bytes for r in routes),
    )


_JITS: dict[tuple, Callable] = {}


def cut_block(array: jax.Array, start: tuple[int, ...], limit: tuple[int, ...]) -> jax.Array:
    key = ("cut", start, limit)  # static bounds: Python indices would come from the host
    if key not in _JITS:
        _JITS[key] = jax.jit(lambda x: jax.lax.slice(x, start, limit))
    return _JITS[key](array)


def join_tiles(tiles: Sequence[jax.Array], grid: tuple[int, ...]) -> jax.Array:
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
    transport, trainer_params, version: int, previous, on_chunk
) -> tuple[GeneratorParams, SyncMetrics]:
    """The push every transport shares (`transport`: `trees`, `strategy`, `plan(params)` and
    `move_chunk(routes, leaves, new)`, which fills `new` and returns temporaries). Checks the
    params, the previous version and the trainer layout, then per chunk: `move_chunk` ->
    `on_chunk(i)` at the high-water mark -> frees the temporaries and, under "swap", the
    previous version's leaves of the chunk. On failure, frees what arrived and says whether
    the generator still holds complete weights."""
    start = time.perf_counter()
    trees, strategy = transport.trees, transport.strategy
    leaves = trees.leaves(trainer_params, "trainer_params")
    plan = transport.plan(trainer_params)
    old = trees.check_previous(previous, plan, version)
    for route, leaf, expected in zip(plan.routes, leaves, trees.trainer, strict=True):
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
            temporaries = transport.move_chunk(routes, leaves, new)
            if on_chunk is not None:
                on_chunk(i)
            for array in temporaries:
                if not array.is_deleted():
                    array.delete()
            if old is not None and strategy == "swap":
                for route in routes:
                    old[route.index].delete()
            done += 1
    except Exception as err:
        for array in new:
            if array is not None and not array.is_deleted():
                array.delete()
        if old is not None and strategy == "swap" and done:
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
    return GeneratorParams(version, jax.tree.unflatten(trees.treedef, new)), metrics


def check_options(strategy: str, transport: str, transports: Sequence[str], chunk_bytes: int):
    """Raises ValueError naming the choices when a transport's options are unknown."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r}; expected one of {STRATEGIES}.")
    if transport not in transports:
        raise ValueError(f"transport={transport!r}; expected one of {tuple(transports)}.")
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes={chunk_bytes} must be positive.")


class ShardingPair:
    """The trainer's and the generator's shardings of one params tree, flattened in one order
    (`paths`, `trainer`, `generator`: one entry per leaf), and the checks every transport makes
    of the params it is handed."""

    def __init__(self, trainer_shardings: Any, generator_shardings: Any):
        with_paths, self.treedef = jax.tree_util.tree_flatten_with_path(trainer_shardings)
        gen_leaves, gen_treedef = jax.tree.flatten(generator_shardings)
        if gen_treedef != self.treedef:
            raise ValueError(
                "trainer and generator shardings have different tree structures:\n"
                f"  trainer:   {self.treedef}\n  generator: {gen_treedef}"
            )
        self.paths = [jax.tree_util.keystr(p) for p, _ in with_paths]
        self.trainer = [s for _, s in with_paths]
        self.generator = gen_leaves
        for path, t, g in zip(self.paths, self.trainer, self.generator, strict=True):
            if not (isinstance(t, Sharding) and isinstance(g, Sharding)):
                raise TypeError(f"{path}: expected jax Shardings, got {t!r} and {g!r}.")

    @property
    def platform(self) -> str | None:
        """The trainer devices' platform (None: no params)."""
        return next(iter(self.trainer[0].device_set)).platform if self.trainer else None

    def leaves(self, params: Any, what: str) -> list[jax.Array]:
        leaves, treedef = jax.tree.flatten(params)
        if treedef != self.treedef:
            raise ValueError(
                f"{what} do not have the structure of the shardings given to WeightSync:\n"
                f"  {what}: {treedef}\n  shardings: {self.treedef}"
            )
        return leaves

    def check_previous(self, previous, plan, version: int):
        """The leaves of `previous` (None: no previous version), checked to be the live
        generator params of an older version, laid out as `plan` writes them."""
        if not isinstance(version, int | np.integer) or version < 0:
            raise ValueError(f"version={version!r} must be a non-negative int.")
        if previous is None:
            return None
        if version <= previous.version:
            raise ValueError(
                f"pushing version {version} over version {previous.version}: policy versions "
                "must increase."
            )
        old = self.leaves(previous.params, "previous.params")
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

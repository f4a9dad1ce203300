"""Weight sync across processes: trainer layout -> generator layout when the roles' devices
belong to different JAX processes (multi-controller: every process runs `push` alike).

`CrossProcessWeightSync(trainer_shardings, generator_shardings)` has the interface, contract
and metrics of the in-process `jaxrl.sync.in_process.WeightSync` (read its docstring first):
`push(trainer_params, version, previous) -> (GeneratorParams, SyncMetrics)`, pause-and-swap per
chunk or a double buffer, an optional cast on the trainer, and no host round trip.
`make_weight_sync` picks this class in a multi-process job and `WeightSync` otherwise.

What JAX 0.10.2 does across processes (checked with 2 and 3 local processes on CPU, gloo):

- A layout-changing `jax.device_put` across processes fails ("Cannot reshard an input that is
  not fully addressable" on the receiving process, "... must be a Device or a Sharding which
  represents addressable devices" on the sending one). A same-layout one between different
  devices works only through the transfer server (`jax_cross_host_transfer_socket_address`,
  set by `jaxrl.infra.distributed.initialize`) and only when source and destination live on
  different sets of processes ("For a cross-host reshard in multi-controller JAX, input and
  target sharding should have the same set of devices" when both roles span both processes).
  Single-device arrays always qualify, so transport "device_put" moves every piece as a
  single-device array (the receiving process names the remote source with an empty
  `make_array_from_single_device_arrays`).
- Transfers are matched by a counter, not by name: every process must issue every cross-process
  `device_put`, in the same order, including processes that neither send nor receive it (they
  get an empty array back); a process that skips one hangs the next. Several cross-process
  arrays in *one* `device_put` call are unsafe: two pieces from the same source device arrived
  swapped (silently wrong values) and pieces in both directions hung. So: one call per piece.
- The sender's `device_put` returns at once and the receiver pulls later. If the sender then
  enters a device collective that spans the receiver's devices (`sync_global_devices`, a jit)
  before the receiver is done, both hang: the sender's CPU threads wait in the collective and
  never serve the pull. Each chunk therefore ends with a coordination-service barrier (no
  device work), which also keeps the sources alive until they are read.
- The first transfer between two processes can take ~2 s (the transfer server's connection
  set-up); later ones take milliseconds.
- A union mesh over trainer + generator devices with a leading `role` axis and
  `lax.ppermute(x, "role", [(0, 1)])` inside `shard_map` moves each trainer device's block to
  its partner generator device (gloo on CPU, NCCL send/recv on GPU, ICI on TPU). Donating the
  input makes the outputs alias the input buffers (checked: same buffer pointers), so the
  generator's new shards land in the zero buffers made for them and nothing else is allocated.
- Neither transport trips `jax.transfer_guard` (host-to-device or device-to-host, "disallow
  explicit") on any process: no host round trip as JAX counts it (on CPU, bytes between
  processes go through TCP sockets, the transfer server's or gloo's).

Both transports first do the design's step (1) on the trainer's devices (one jit per chunk:
cast, and reshard to the generator's block layout), then move data across:

- "device_put": the in-process planner's routes (`plan.route_leaf`, transport "reshard"):
  a shadow layout only when some generator block is not inside one trainer shard. Then, on
  each process, the first generator device of each distinct block gets it as pieces (cut on
  the trainer if need be, joined on the generator) from holders on its own process when there
  are any, and that process's replicas copy it locally: a block crosses to a process at most
  once. Any device counts.
- "ppermute": the *mirror* layout (the generator's mesh shape and specs, on the trainer's
  devices in the trainer's device order, as the in-process shadow; each generator device
  paired with a trainer device, same process first), then one jitted `shard_map` per chunk
  over the union mesh. Needs disjoint roles and a trainer device
  count that is a multiple of the generator's; every replica crosses (one collective).

Default ("auto"): "ppermute" on GPU and TPU, where it is NCCL / ICI point-to-point, device to
device, one collective per chunk with no per-piece Python, while the JAX 0.10.2 transfer server
(sockets through host memory, for backends without native cross-host transfers) would be the
slow path. On CPU both are TCP through host memory; "device_put" is the default there because
it sends each distinct block once, handles any device counts, and measured as fast or faster
(docs/benchmarks.md, "Measurements behind design choices"; bench/results/sync_xproc.md).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

from jaxrl.infra import distributed
from jaxrl.sync.in_process import WeightSync
from jaxrl.sync.plan import (
    DEFAULT_CHUNK_BYTES,
    GeneratorParams,
    ShardingPair,
    SyncMetrics,
    block_overlap,
    cast_sources,
    check_options,
    cut_block,
    device_blocks,
    device_order,
    factor_groupings,
    factor_mesh,
    intersect,
    join_tiles,
    push_in_chunks,
    route_leaf,
    routed_plan,
    spec_entry,
    volume,
)

TRANSPORTS = ("auto", "device_put", "ppermute")
_INSTANCES = itertools.count()  # same order on every process: names the barriers


@dataclasses.dataclass(frozen=True)
class Piece:
    """One single-device copy: `source_device`'s block (cut to `cut` if set) to `target`."""

    source_device: jax.Device
    cut: tuple[tuple[int, ...], tuple[int, ...]] | None
    shape: tuple[int, ...]
    target: jax.Device


@dataclasses.dataclass(frozen=True)
class Block:
    """One generator block on `target`: `pieces` joined row-major over `grid`, or (a replica)
    a copy of the block on `copy_from`, a generator device of the same process."""

    target: jax.Device
    pieces: tuple[Piece, ...]
    grid: tuple[int, ...]
    copy_from: jax.Device | None = None


@dataclasses.dataclass(frozen=True)
class CrossRoute:
    """How one parameter travels (module docstring)."""

    index: int
    path: str
    shape: tuple[int, ...]
    dtype: Any  # generator dtype
    source_sharding: Sharding  # the trainer's, or a shadow / mirror layout on its devices
    made: bool  # the source is a new array (cast and / or reshard on the trainer)
    blocks: tuple[Block, ...]  # "device_put"
    union_sharding: NamedSharding | None  # "ppermute"
    extra_bytes: dict[int, int]
    moved_bytes: int
    cross_process_bytes: int


@dataclasses.dataclass(frozen=True)
class CrossPlan:
    routes: tuple[CrossRoute, ...]
    chunks: tuple[tuple[int, ...], ...]
    chunk_extra_bytes: tuple[int, ...]
    params_bytes: int
    bytes_moved: int
    cross_process_bytes: int

    @property
    def peak_extra_bytes(self) -> int:
        return max(self.chunk_extra_bytes, default=0)


def default_transport(platform: str) -> str:
    """ "auto": "device_put" on CPU, "ppermute" on GPU / TPU (module docstring)."""
    return "device_put" if platform == "cpu" else "ppermute"


def _piece_blocks(source_blocks, gen_blocks, itemsize: int) -> tuple[tuple[Block, ...], int]:
    """Each generator device's block: on each process, its first device holding that block
    gets it from the source shards intersecting it (a holder on its own process first, then
    the least-read one), the others copy it from there. Returns (blocks, cross bytes)."""
    holders: dict[tuple, list[jax.Device]] = collections.defaultdict(list)
    for device, block in source_blocks.items():
        holders[block].append(device)
    reads: collections.Counter = collections.Counter()
    first: dict[tuple, jax.Device] = {}  # (block, process) -> the device that receives it
    out, cross = [], 0
    for target, gen_block in gen_blocks.items():
        if (gen_block, target.process_index) in first:
            out.append(Block(target, (), (), first[(gen_block, target.process_index)]))
            continue
        first[(gen_block, target.process_index)] = target
        pieces, starts = [], []
        for source_block in sorted(holders):  # row-major over the piece grid
            common = intersect(source_block, gen_block)
            if common is None:
                continue
            device = min(
                holders[source_block],
                key=lambda d: (d.process_index != target.process_index, reads[d], d.id),
            )
            reads[device] += 1
            offset = [start for start, _ in source_block]
            cut = (
                tuple(a - o for (a, _), o in zip(common, offset, strict=True)),
                tuple(b - o for (_, b), o in zip(common, offset, strict=True)),
            )
            shape = tuple(b - a for a, b in common)
            pieces.append(Piece(device, None if common == source_block else cut, shape, target))
            starts.append([start for start, _ in common])
            if device.process_index != target.process_index:
                cross += volume(common) * itemsize
        grid = tuple(len(set(column)) for column in zip(*starts, strict=True)) if starts else ()
        out.append(Block(target, tuple(pieces), grid))
    return tuple(out), cross


@functools.cache
def _mirror(trainer: Sharding, generator: NamedSharding, shape: tuple[int, ...]):
    """The generator's layout on the trainer's devices, in the trainer's device order (one jit
    reshards into it): the trainer devices arranged as (k, *generator mesh shape), row 0 paired
    position by position with the generator devices. Of the arrangements that follow the
    trainer mesh's axes, the one with the most same-process pairs, then the most overlap with
    the trainer's own blocks. Returns (mirror sharding, row 0 as an array of devices)."""
    gen_mesh = generator.mesh
    order = device_order(trainer)
    n_t, n_g = len(order), gen_mesh.devices.size
    if n_t % n_g:
        raise ValueError(
            f"transport 'ppermute' pairs each of the {n_g} generator devices with a trainer "
            f"device and needs the trainer's device count ({n_t}) to be a multiple of it; use "
            "transport='device_put' (any device counts) or change the meshes."
        )
    mesh_shape = trainer.mesh.devices.shape if isinstance(trainer, NamedSharding) else (n_t,)
    mesh = factor_mesh(order, mesh_shape)
    current = device_blocks(trainer, shape)
    best, best_score = None, None
    for groups in factor_groupings(mesh, (n_t // n_g, *gen_mesh.devices.shape)):
        by_axis = dict(zip(gen_mesh.axis_names, groups[1:], strict=True))

        def entry(e, by_axis=by_axis):
            names = () if e is None else (e,) if isinstance(e, str) else tuple(e)
            return spec_entry(tuple(a for n in names for a in by_axis[n]))

        mirror = NamedSharding(mesh, PartitionSpec(*map(entry, generator.spec)))
        axes = [a for g in groups for a in g]
        axes += [a for a in mesh.axis_names if a not in axes]  # size-1 axes
        arranged = np.transpose(mesh.devices, [mesh.axis_names.index(a) for a in axes])
        row = arranged.reshape((n_t // n_g, *gen_mesh.devices.shape))[0]
        same = sum(
            t.process_index == g.process_index
            for t, g in zip(row.flat, gen_mesh.devices.flat, strict=True)
        )
        score = (same, block_overlap(mirror, current, shape))
        if best_score is None or score > best_score:
            best, best_score = (mirror, row), score
    return best


class CrossProcessWeightSync:
    """`WeightSync` for trainer and generator devices spread over several processes.

    Args: as `WeightSync` (trainer_shardings, generator_shardings, generator_dtype,
      chunk_bytes, strategy), plus
      transport: "device_put", "ppermute" or "auto" (module docstring).
      barrier_timeout_s: how long a chunk waits for the other processes ("device_put").
    Every process must build it with the same arguments and call `push` alike.
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
        barrier_timeout_s: float = 300.0,
    ):
        check_options(strategy, transport, TRANSPORTS, chunk_bytes)
        self.trees = ShardingPair(trainer_shardings, generator_shardings)
        for path, g in zip(self.trees.paths, self.trees.generator, strict=True):
            if transport == "ppermute" and not isinstance(g, NamedSharding):
                raise TypeError(f"{path}: transport 'ppermute' needs NamedShardings, got {g!r}.")
        if transport == "auto" and self.trees.trainer:
            transport = default_transport(self.trees.platform)
        self.transport = transport
        self.generator_dtype = None if generator_dtype is None else jnp.dtype(generator_dtype)
        self.chunk_bytes = int(chunk_bytes)
        self.strategy = strategy
        self.barrier_timeout_s = barrier_timeout_s
        self._name = f"jaxrl_weight_sync_{next(_INSTANCES)}"
        self._barriers = itertools.count()  # unique barrier names, the same on every process
        self._plans: dict[tuple, CrossPlan] = {}
        self._jits: dict[tuple, Callable] = {}

    def plan(self, params: Any) -> CrossPlan:
        """Routes and chunks for params of these shapes and dtypes (computed once)."""
        leaves = self.trees.leaves(params, "params")
        key = tuple((tuple(x.shape), jnp.dtype(x.dtype)) for x in leaves)
        if key not in self._plans:
            make = self._ppermute_route if self.transport == "ppermute" else self._put_route
            fields = routed_plan(self.trees, key, make, self.chunk_bytes)
            self._plans[key] = CrossPlan(
                **fields, cross_process_bytes=sum(r.cross_process_bytes for r in fields["routes"])
            )
            self._check_transfer_server(self._plans[key])
        return self._plans[key]

    def _put_route(self, index, path, shape, dtype, trainer, generator) -> CrossRoute:
        local = route_leaf(
            index, path, shape, dtype, trainer, generator, self.generator_dtype, "reshard"
        )
        gen_blocks = device_blocks(generator, local.shape)
        source_blocks = device_blocks(local.source_sharding, local.shape)
        blocks, cross = _piece_blocks(source_blocks, gen_blocks, local.dtype.itemsize)
        return CrossRoute(
            index=index,
            path=path,
            shape=local.shape,
            dtype=local.dtype,
            source_sharding=local.source_sharding,
            made=local.resharded or local.cast,
            blocks=blocks,
            union_sharding=None,
            extra_bytes=local.extra_bytes,
            moved_bytes=local.moved_bytes,
            cross_process_bytes=cross,
        )

    def _ppermute_route(self, index, path, shape, dtype, trainer, generator) -> CrossRoute:
        shape = tuple(shape)
        floating = jnp.issubdtype(dtype, jnp.floating)
        cast = self.generator_dtype is not None and floating
        out_dtype = jnp.dtype(self.generator_dtype if cast else dtype)
        gen_mesh = generator.mesh
        shared = set(trainer.device_set) & set(gen_mesh.devices.flat)
        if shared:
            raise ValueError(
                f"{path}: transport 'ppermute' needs disjoint trainer and generator devices, "
                f"but {sorted(d.id for d in shared)} are in both; colocated roles share "
                "processes, so use the in-process WeightSync."
            )
        mirror, row = _mirror(trainer, generator, shape)
        union = Mesh(np.stack([row, gen_mesh.devices]), ("role", *gen_mesh.axis_names))
        gen_blocks = device_blocks(generator, shape)
        block_bytes = {d.id: volume(b) * out_dtype.itemsize for d, b in gen_blocks.items()}
        extra = collections.Counter(block_bytes)  # zero buffers, then (aliased) new shards
        for device, block in device_blocks(mirror, shape).items():
            extra[device.id] += volume(block) * out_dtype.itemsize
        pairs = zip(row.flat, gen_mesh.devices.flat, strict=True)
        return CrossRoute(
            index=index,
            path=path,
            shape=shape,
            dtype=out_dtype,
            source_sharding=mirror,
            made=True,
            blocks=(),
            union_sharding=NamedSharding(union, generator.spec),
            extra_bytes=dict(extra),
            moved_bytes=sum(block_bytes.values()),
            cross_process_bytes=sum(
                block_bytes[g.id] for t, g in pairs if t.process_index != g.process_index
            ),
        )

    def _check_transfer_server(self, plan: CrossPlan) -> None:
        if self.transport != "device_put" or not plan.cross_process_bytes:
            return
        from jax._src import xla_bridge  # the flag has no public reader

        if not xla_bridge.CROSS_HOST_TRANSFER_SOCKET_ADDRESS.value:
            raise RuntimeError(
                "cross-process weight sync with transport 'device_put' needs a transfer server "
                "in every process (jax_cross_host_transfer_socket_address), set before JAX "
                "starts: call jaxrl.infra.distributed.initialize (it sets one unless "
                "DistributedConfig.transfer_address='off'), or use transport='ppermute'."
            )

    def push(
        self,
        trainer_params: Any,
        version: int,
        previous: GeneratorParams | None = None,
        *,
        on_chunk: Callable[[int], None] | None = None,
    ) -> tuple[GeneratorParams, SyncMetrics]:
        """As `WeightSync.push`; every process calls it with its view of the same arrays."""
        return push_in_chunks(self, trainer_params, version, previous, on_chunk)

    def move_chunk(self, routes, leaves, new) -> list[jax.Array]:
        if self.transport == "ppermute":
            return self._ppermute_chunk(routes, leaves, new)
        return self._put_chunk(routes, leaves, new, f"{self._name}/{next(self._barriers)}")

    def _sources(self, routes, leaves) -> tuple[dict[int, jax.Array], list[jax.Array]]:
        """Step (1) on the trainer: one jit casts and reshards the chunk's made routes."""
        return cast_sources(self._jits, routes, [r for r in routes if r.made], leaves)

    def _put_chunk(self, routes, leaves, new, barrier_name: str) -> list[jax.Array]:
        me = jax.process_index()
        sources, temporaries = self._sources(routes, leaves)
        local_shards = {
            r.index: {s.device: s.data for s in sources[r.index].addressable_shards} for r in routes
        }
        cuts: dict[tuple, jax.Array] = {}

        def piece_array(route: CrossRoute, piece: Piece) -> jax.Array:
            if piece.source_device.process_index != me:  # the remote sender's piece, by name
                sharding = SingleDeviceSharding(piece.source_device)
                return jax.make_array_from_single_device_arrays(
                    piece.shape, sharding, [], dtype=route.dtype
                )
            data = local_shards[route.index][piece.source_device]
            if piece.cut is None:
                return data
            key = (route.index, piece.source_device, piece.cut)
            if key not in cuts:
                cuts[key] = cut_block(data, *piece.cut)
                temporaries.append(cuts[key])
            return cuts[key]

        arrived: dict[tuple[int, int, int], jax.Array] = {}
        received: dict[int, dict[jax.Device, jax.Array]] = {}
        local_in, local_out = [], []
        for route in routes:
            for b, block in enumerate(route.blocks):
                for p, piece in enumerate(block.pieces):
                    src, dst = piece.source_device.process_index, piece.target.process_index
                    if src != dst:  # every process, same order, one call each
                        target = SingleDeviceSharding(
                            piece.target
                        )  # a Sharding: the cross-host path
                        array = jax.device_put(piece_array(route, piece), target)
                        if dst == me:
                            arrived[(route.index, b, p)] = array
                    elif src == me:
                        local_in.append(piece_array(route, piece))
                        local_out.append(((route.index, b, p), piece.target))
        moved = jax.device_put(local_in, [t for _, t in local_out], may_alias=False)
        arrived.update(zip((k for k, _ in local_out), moved, strict=True))
        replicas = []
        for route in routes:
            by_device = {}
            for b, block in enumerate(route.blocks):
                if block.target.process_index != me:
                    continue
                if block.copy_from is not None:
                    replicas.append((route.index, block))
                    continue
                tiles = [arrived[(route.index, b, p)] for p in range(len(block.pieces))]
                if len(tiles) > 1:
                    temporaries.extend(tiles)
                    by_device[block.target] = join_tiles(tiles, block.grid)
                else:
                    by_device[block.target] = tiles[0]
            received[route.index] = by_device
        copies = jax.device_put(
            [received[i][block.copy_from] for i, block in replicas],
            [block.target for _, block in replicas],
            may_alias=False,
        )
        for (i, block), copy in zip(replicas, copies, strict=True):
            received[i][block.target] = copy
        for route in routes:
            by_device = received[route.index]
            sharding = self.trees.generator[route.index]
            arrays = [by_device[d] for d in sharding.addressable_devices_indices_map(route.shape)]
            new[route.index] = jax.make_array_from_single_device_arrays(
                route.shape, sharding, arrays, dtype=route.dtype
            )
        jax.block_until_ready([new[r.index] for r in routes])
        distributed.barrier(barrier_name, self.barrier_timeout_s)
        return temporaries

    def _ppermute_chunk(self, routes, leaves, new) -> list[jax.Array]:
        sources, temporaries = self._sources(routes, leaves)
        key = tuple((r.index, r.shape, r.dtype, r.union_sharding) for r in routes)
        if key not in self._jits:
            shardings = [self.trees.generator[r.index] for r in routes]
            zeros = jax.jit(
                lambda: [jnp.zeros(r.shape, r.dtype) for r in routes], out_shardings=shardings
            )
            moves = []
            for r in routes:
                move = jax.shard_map(
                    lambda x: jax.lax.ppermute(x, "role", [(0, 1)]),
                    mesh=r.union_sharding.mesh,
                    in_specs=r.union_sharding.spec,
                    out_specs=r.union_sharding.spec,
                    check_vma=False,  # the input claims replication over "role"; it is not
                )
                moves.append(move)
            self._jits[key] = (
                zeros,
                jax.jit(
                    lambda xs: [m(x) for m, x in zip(moves, xs, strict=True)],
                    out_shardings=[r.union_sharding for r in routes],
                    donate_argnums=0,
                ),
            )
        zeros, move = self._jits[key]
        unions = []
        for route, blank in zip(routes, zeros(), strict=True):
            shards = {s.device: s.data for s in sources[route.index].addressable_shards}
            shards.update({s.device: s.data for s in blank.addressable_shards})
            union = route.union_sharding
            arrays = [shards[d] for d in union.addressable_devices_indices_map(route.shape)]
            unions.append(
                jax.make_array_from_single_device_arrays(
                    route.shape, union, arrays, dtype=route.dtype
                )
            )
        outs = move(unions)
        for route, out in zip(routes, outs, strict=True):
            sharding = self.trees.generator[route.index]
            mine = {s.device: s.data for s in out.addressable_shards}
            arrays = [mine[d] for d in sharding.addressable_devices_indices_map(route.shape)]
            new[route.index] = jax.make_array_from_single_device_arrays(
                route.shape, sharding, arrays, dtype=route.dtype
            )
        jax.block_until_ready([new[r.index] for r in routes])
        generator_devices = {d for r in routes for d in self.trees.generator[r.index].device_set}
        for out in outs:  # what the trainer's side received: nothing of use
            for shard in out.addressable_shards:
                if shard.device not in generator_devices:
                    shard.data.delete()
        return temporaries


def make_weight_sync(
    trainer_shardings: Any,
    generator_shardings: Any,
    *,
    cross_process_transport: str = "auto",
    barrier_timeout_s: float = 300.0,
    **kwargs,
) -> WeightSync | CrossProcessWeightSync:
    """`CrossProcessWeightSync` in a multi-process job, else the in-process `WeightSync`.

    `kwargs` (generator_dtype, chunk_bytes, strategy, and `transport` for the in-process
    class) go to the chosen class.
    """
    if jax.process_count() == 1:
        return WeightSync(trainer_shardings, generator_shardings, **kwargs)
    kwargs.pop("transport", None)
    return CrossProcessWeightSync(
        trainer_shardings,
        generator_shardings,
        transport=cross_process_transport,
        barrier_timeout_s=barrier_timeout_s,
        **kwargs,
    )

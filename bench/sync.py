"""Weight-sync GB/s across trainer -> generator layouts, next to memcpy and a bare device_put.

For each layout pair: the ~100M-parameter Llama (`llama_100m`, fp32) sits in the trainer layout
(TRAINER_RULES) on devices 0..; `WeightSync` pushes it into the generator layout
(GENERATOR_RULES, or TRAINER_RULES for the same-layout control) on devices 4.. One warm-up push
(compiles; reported as `first_push_s`), then the median of `--repeats` timed pushes, each swapping
out the previous version. Next to it, measured in the same run:

- `memcpy_gbps`: `np.copyto` of the same bytes into a preallocated host buffer (one thread; the
  physical limit here, since CPU "devices" share host memory);
- `memcpy_alloc_gbps`: `np.copy`, i.e. with a fresh allocation, as each push allocates its buffers;
- `device_put_gbps`: a bare `jax.device_put(trainer_params, generator_shardings)` (plus a jitted
  cast when the dtypes differ), and whether it went through the host (`bare_via_host`, checked with
  the transfer guards);
- `peak_extra_mb`: the largest rise in live-array bytes on any one device during a push (probed at
  each chunk's high-water mark), against the plan's bound (`bound_mb`, one chunk) and the params'
  bytes on the largest generator device (`gen_device_mb`). `memory_stats()` peaks where the
  backend has them (not on CPU).

GB/s = bytes written to generator devices (replicas included) / seconds. The first pair runs
with both transports ("assemble", the CPU default, and "reshard", XLA collectives). Values are
random (a push's cost does not depend on them). Timings on a shared 2-core machine swing by 2x
between runs; the ratios are measured interleaved, in one run. Fresh CPU buffers >= 32 MB are
mmapped, so pushes (and `np.copy`) pay page faults; prefixing the command with
`GLIBC_TUNABLES=glibc.malloc.mmap_max=0` keeps freed pages for reuse.

    python -m bench.sync            # ~100M params, 7 layout pairs, about 2 minutes on 2 cores
    python -m bench.sync --smoke    # tiny model, 5 pairs, a few seconds (tests/test_bench_sync.py)

`--cross_process` measures `jaxrl.sync.cross_process` instead: the first pair (fsdp2 tp2 -> dp2
tp2) pushed in this process (8 devices, the in-process figure, transport "assemble") and then
in a 2-process job (`launch.local_cluster`, 4 devices each, gloo) with both cross-process
transports, (split) trainer on process 0 and generator on process 1, (span, not in --smoke)
each role on two devices of each process. Push seconds are the slowest process's; `cross_mb`
are the bytes that cross between processes (the rest are copies inside one process). Results
go to bench/results/sync_xproc.{json,md}.

    python -m bench.sync --cross_process           # ~100M params
    python -m bench.sync --cross_process --smoke   # tiny (tests/test_distributed_bench_sync.py)
"""

from __future__ import annotations

from bench import cpu_devices

cpu_devices.simulate(8)

import argparse  # noqa: E402
import collections  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from bench.common import machine, write_results  # noqa: E402
from jaxrl.infra.mesh import MeshConfig, make_mesh  # noqa: E402
from jaxrl.infra.sharding import (  # noqa: E402
    GENERATOR_RULES,
    TRAINER_RULES,
    param_shardings,
)
from jaxrl.models.presets import llama_100m, rlbench_tiny  # noqa: E402
from jaxrl.models.transformer import Transformer  # noqa: E402
from jaxrl.sync.in_process import WeightSync  # noqa: E402
from jaxrl.sync.plan import live_bytes_by_device  # noqa: E402

MB = 1e6


@dataclasses.dataclass(frozen=True)
class LayoutPair:
    name: str
    trainer: MeshConfig
    generator: MeshConfig
    generator_rules: tuple = GENERATOR_RULES
    generator_dtype: str | None = None
    transport: str = "auto"


def _mesh(axes, sizes, first):
    return MeshConfig(axes, sizes, first_device=first, num_devices=int(np.prod(sizes)))


TRAINER_2X2 = _mesh(("fsdp", "tp"), (2, 2), 0)
TRAINER_FSDP2 = _mesh(("fsdp", "tp"), (2, 1), 0)
PAIRS = (
    LayoutPair("fsdp2 tp2 -> dp2 tp2", TRAINER_2X2, _mesh(("dp", "tp"), (2, 2), 4)),
    LayoutPair(
        "fsdp2 tp2 -> dp2 tp2",
        TRAINER_2X2,
        _mesh(("dp", "tp"), (2, 2), 4),
        transport="reshard",
    ),
    LayoutPair(
        "fsdp2 tp2 -> dp2 tp2, bf16",
        TRAINER_2X2,
        _mesh(("dp", "tp"), (2, 2), 4),
        generator_dtype="bfloat16",
    ),
    LayoutPair("fsdp2 tp2 -> tp2 (4 -> 2)", TRAINER_2X2, _mesh(("dp", "tp"), (1, 2), 4)),
    LayoutPair("fsdp2 -> dp2 tp2 (2 -> 4)", TRAINER_FSDP2, _mesh(("dp", "tp"), (2, 2), 4)),
    LayoutPair("fsdp2 -> tp4 (2 -> 4, finer)", TRAINER_FSDP2, _mesh(("dp", "tp"), (1, 4), 4)),
    LayoutPair(
        "fsdp2 tp2 -> same layout",
        TRAINER_2X2,
        _mesh(("fsdp", "tp"), (2, 2), 4),
        generator_rules=TRAINER_RULES,
    ),
)


def _seconds(fn) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def _memory_stats_peak(devices) -> int | None:
    stats = [d.memory_stats() for d in devices]
    if any(s is None for s in stats):
        return None
    return max(s.get("peak_bytes_in_use", 0) for s in stats)


def _goes_via_host(fn) -> bool:
    try:
        with (
            jax.transfer_guard_host_to_device("disallow_explicit"),
            jax.transfer_guard_device_to_host("disallow_explicit"),
        ):
            jax.block_until_ready(fn())
        return False
    except Exception as err:  # JaxRuntimeError: "Disallowed host-to-device transfer"
        if "Disallowed" not in str(err):
            raise
        return True


def _bytes_by_device(tree) -> dict[int, int]:
    totals: dict[int, int] = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            totals[shard.device.id] = totals.get(shard.device.id, 0) + shard.data.nbytes
    return totals


def measure(pair: LayoutPair, host_params, abstract, repeats: int, chunk_bytes: int) -> dict:
    trainer_mesh, gen_mesh = make_mesh(pair.trainer), make_mesh(pair.generator)
    trainer_shardings = param_shardings(abstract, trainer_mesh, TRAINER_RULES)
    gen_shardings = param_shardings(abstract, gen_mesh, pair.generator_rules)
    params = jax.block_until_ready(jax.device_put(host_params, trainer_shardings))
    sync = WeightSync(
        trainer_shardings,
        gen_shardings,
        generator_dtype=pair.generator_dtype,
        chunk_bytes=chunk_bytes,
        transport=pair.transport,
    )
    plan = sync.plan(params)
    cast = jax.jit(
        lambda p: jax.tree.map(lambda x: x.astype(pair.generator_dtype or x.dtype), p),
        out_shardings=gen_shardings,
    )

    def bare():
        out = jax.device_put(params, gen_shardings)
        return cast(out) if pair.generator_dtype else out

    src = np.ones(plan.bytes_moved // 4, np.float32)
    dst = np.zeros_like(src)
    gen, first = sync.push(params, 0)
    jax.block_until_ready(bare())  # compile the cast
    # Interleaved, so that the load of this shared machine hits every measurement alike.
    times = collections.defaultdict(list)
    for version in range(1, repeats + 1):
        gen, metrics = sync.push(params, version, gen)
        times["push"].append(metrics.seconds)
        times["bare"].append(_seconds(bare))
        times["memcpy"].append(_seconds(lambda: np.copyto(dst, src)))
        times["memcpy_alloc"].append(_seconds(lambda: np.copy(src)))
    seconds = {k: statistics.median(v) for k, v in times.items()}
    gbps = {k: plan.bytes_moved / v / 1e9 for k, v in seconds.items()}

    # Memory probe: live-array bytes per device at every chunk's high-water mark.
    gc.collect()
    before = live_bytes_by_device()
    peaks: dict[int, int] = {}

    def probe(_):
        for device, nbytes in live_bytes_by_device().items():
            peaks[device] = max(peaks.get(device, 0), nbytes - before.get(device, 0))

    with (
        jax.transfer_guard_host_to_device("disallow_explicit"),
        jax.transfer_guard_device_to_host("disallow_explicit"),
    ):
        gen, _ = sync.push(params, repeats + 1, gen, on_chunk=probe)
    gen_device_bytes = max(_bytes_by_device(gen.params).values())
    gen.delete()
    return {
        "pair": pair.name,
        "transport": sync.transport,
        "dtype": pair.generator_dtype or "float32",
        "params_mb": round(plan.params_bytes / MB, 1),
        "moved_mb": round(plan.bytes_moved / MB, 1),
        "chunks": len(plan.chunks),
        "routes": ", ".join(sorted({r.kind for r in plan.routes})),
        "push_s": round(seconds["push"], 4),
        "first_push_s": round(first.seconds, 3),
        "gbps": round(gbps["push"], 2),
        "memcpy_gbps": round(gbps["memcpy"], 2),
        "memcpy_alloc_gbps": round(gbps["memcpy_alloc"], 2),
        "vs_memcpy": round(gbps["push"] / gbps["memcpy"], 2),
        "vs_memcpy_alloc": round(gbps["push"] / gbps["memcpy_alloc"], 2),
        "device_put_gbps": round(gbps["bare"], 2),
        "vs_device_put": round(gbps["push"] / gbps["bare"], 2),
        "bare_via_host": _goes_via_host(bare),
        "peak_extra_mb": round(max(peaks.values(), default=0) / MB, 2),
        "bound_mb": round(plan.peak_extra_bytes / MB, 2),
        "gen_device_mb": round(gen_device_bytes / MB, 1),
        "memory_stats_peak_mb": _memory_stats_peak(jax.devices()),
    }


def _model(args):
    """(abstract params, random host params of that shape, repeats, chunk bytes)."""
    config = rlbench_tiny(num_layers=1) if args.smoke else llama_100m()
    _, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
    # Random values of the model's shapes: what a push costs does not depend on them.
    rng = np.random.default_rng(0)
    host_params = jax.tree.map(lambda a: rng.standard_normal(a.shape, np.float32), abstract)
    repeats = 1 if args.smoke else args.repeats
    chunk_bytes = int((1.0 if args.smoke else args.chunk_mb) * MB)
    return abstract, host_params, repeats, chunk_bytes


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model, a few seconds")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk_mb", type=float, default=64.0)
    parser.add_argument("--cross_process", action="store_true", help="2-process transports")
    parser.add_argument("--xproc_worker", metavar="OUT_JSON", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.xproc_worker:  # one process of the --cross_process job: join it before anything
        return _xproc_worker(args)
    if len(jax.devices()) < 8:
        raise SystemExit(
            f"bench.sync needs 8 devices, JAX sees {len(jax.devices())}; run it with "
            "XLA_FLAGS=--xla_force_host_platform_device_count=8 in a fresh process."
        )
    abstract, host_params, repeats, chunk_bytes = _model(args)
    flags = sys.argv[1:] if argv is None else argv
    command = "python -m bench.sync" + "".join(f" {a}" for a in flags)
    command = os.environ.get("JAXRL_BENCH_COMMAND") or command  # `python -m bench`
    if args.cross_process:
        in_process = measure(PAIRS[0], host_params, abstract, repeats, chunk_bytes)
        del host_params
        gc.collect()
        return _cross_process(args, in_process, abstract, chunk_bytes, command)
    rows = []
    # Smoke: one pair per route kind (joined, resharded, cast, cut, plain device_put).
    pairs = [PAIRS[i] for i in (0, 1, 2, 5, 6)] if args.smoke else PAIRS
    for pair in pairs:
        row = measure(pair, host_params, abstract, repeats, chunk_bytes)
        row["command"] = command
        print(json.dumps(row), flush=True)
        rows.append(row)
        if not args.smoke:  # (the smoke's tiny pairs: `measure` collects before its probe)
            gc.collect()
    columns = [
        ("pair", "layout pair (trainer -> generator)"),
        ("transport", "transport"),
        ("dtype", "gen dtype"),
        ("moved_mb", "moved MB"),
        ("push_s", "push s"),
        ("gbps", "push GB/s"),
        ("memcpy_gbps", "memcpy GB/s"),
        ("vs_memcpy", "push / memcpy"),
        ("memcpy_alloc_gbps", "memcpy+alloc GB/s"),
        ("device_put_gbps", "bare device_put GB/s"),
        ("vs_device_put", "push / bare"),
        ("bare_via_host", "bare via host"),
        ("peak_extra_mb", "peak extra MB/device"),
        ("bound_mb", "bound MB"),
        ("gen_device_mb", "params MB/gen device"),
    ]
    name = "sync_smoke" if args.smoke else "sync"
    params_m = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract)) / 1e6
    note = f"`{command}` on {machine()}; {params_m:.1f}M params, chunk {chunk_bytes / MB:g} MB"
    print(write_results(name, rows, columns, note))
    return rows


# Cross-process (--cross_process) ------------------------------------------------------------

XPROC_LAYOUTS = {
    "split": "trainer = process 0, generator = process 1",
    "span": "each role: 2 devices on each process",
}


def _xproc_worker(args) -> list[dict]:
    """One process of the 2 x 4-device job: every layout x transport; process 0 writes rows."""
    from jax.experimental import multihost_utils

    from jaxrl.infra.distributed import initialize_from_env
    from jaxrl.sync.cross_process import CrossProcessWeightSync

    info = initialize_from_env()
    abstract, host_params, repeats, chunk_bytes = _model(args)
    by_process = [jax.local_devices(process_index=p) for p in range(jax.process_count())]
    rows = []
    for layout in ["split"] if args.smoke else XPROC_LAYOUTS:
        if layout == "split":
            trainer_devices, gen_devices = by_process[0][:4], by_process[1][:4]
        else:
            trainer_devices = by_process[0][:2] + by_process[1][:2]
            gen_devices = by_process[0][2:4] + by_process[1][2:4]
        ids = tuple(jax.devices().index(d) for d in trainer_devices)
        trainer_mesh = make_mesh(dataclasses.replace(PAIRS[0].trainer, device_indices=ids))
        ids = tuple(jax.devices().index(d) for d in gen_devices)
        gen_mesh = make_mesh(dataclasses.replace(PAIRS[0].generator, device_indices=ids))
        trainer_shardings = param_shardings(abstract, trainer_mesh, TRAINER_RULES)
        gen_shardings = param_shardings(abstract, gen_mesh, GENERATOR_RULES)
        params = jax.tree.map(
            lambda x, s: jax.make_array_from_callback(
                x.shape, s, lambda i, x=x: x[i], dtype=x.dtype
            ),
            host_params,
            trainer_shardings,
        )
        for transport in ("device_put", "ppermute"):
            sync = CrossProcessWeightSync(
                trainer_shardings, gen_shardings, chunk_bytes=chunk_bytes, transport=transport
            )
            plan = sync.plan(params)
            src = np.ones(plan.bytes_moved // 4, np.float32)
            dst = np.zeros_like(src)
            memcpy = functools.partial(np.copyto, dst, src)
            gen, first = sync.push(params, 0)
            times = collections.defaultdict(list)
            for version in range(1, repeats + 1):
                gen, metrics = sync.push(params, version, gen)
                times["push"].append(metrics.seconds)
                times["memcpy"].append(_seconds(memcpy))
            gen.delete()
            del src, dst, memcpy
            mine = [statistics.median(times["push"]), first.seconds]
            gathered = multihost_utils.process_allgather(np.asarray(mine, np.float64))
            push_s, first_s = (float(t) for t in np.max(gathered, 0))
            memcpy_s = statistics.median(times["memcpy"])
            rows.append(
                {
                    "layout": f"{layout}: {XPROC_LAYOUTS[layout]}",
                    "processes": jax.process_count(),
                    "transport": transport,
                    "params_mb": round(plan.params_bytes / MB, 1),
                    "moved_mb": round(plan.bytes_moved / MB, 1),
                    "cross_mb": round(plan.cross_process_bytes / MB, 1),
                    "chunks": len(plan.chunks),
                    "push_s": round(push_s, 4),
                    "first_push_s": round(first_s, 3),
                    "gbps": round(plan.bytes_moved / push_s / 1e9, 3),
                    "memcpy_gbps": round(plan.bytes_moved / memcpy_s / 1e9, 2),
                }
            )
            gc.collect()
        jax.tree.map(lambda x: x.delete(), params)
    if info.process_index == 0:
        with open(args.xproc_worker, "w") as f:
            json.dump(rows, f)
    return rows


def _cross_process(args, in_process: dict, abstract, chunk_bytes: int, command: str):
    """Runs the 2-process job, merges its rows with the in-process figure, writes results."""
    import tempfile

    from launch import local_cluster

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        worker = [sys.executable, "-m", "bench.sync", "--xproc_worker", out]
        worker += ["--smoke"] if args.smoke else []
        worker += ["--repeats", str(args.repeats), "--chunk_mb", str(args.chunk_mb)]
        status = local_cluster.run(worker, 2, 4, timeout_s=1800, heartbeat_timeout_s=30)
        if status != 0:
            raise SystemExit(f"the cross-process bench job failed with status {status}")
        with open(out) as f:
            rows = json.load(f)
    baseline = {
        "layout": "in-process: trainer devices 0-3, generator 4-7",
        "processes": 1,
        "transport": in_process["transport"],
        "params_mb": in_process["params_mb"],
        "moved_mb": in_process["moved_mb"],
        "cross_mb": 0.0,
        "chunks": in_process["chunks"],
        "push_s": in_process["push_s"],
        "first_push_s": in_process["first_push_s"],
        "gbps": in_process["gbps"],
        "memcpy_gbps": in_process["memcpy_gbps"],
    }
    rows = [baseline, *rows]
    for row in rows:
        row["vs_in_process"] = round(row["gbps"] / baseline["gbps"], 2)
        row["command"] = command
        print(json.dumps(row), flush=True)
    columns = [
        ("layout", f"{PAIRS[0].name}: placement"),
        ("processes", "processes"),
        ("transport", "transport"),
        ("moved_mb", "moved MB"),
        ("cross_mb", "cross-process MB"),
        ("push_s", "push s"),
        ("gbps", "push GB/s"),
        ("vs_in_process", "vs in-process"),
        ("first_push_s", "first push s"),
        ("memcpy_gbps", "memcpy GB/s"),
    ]
    name = "sync_xproc_smoke" if args.smoke else "sync_xproc"
    params_m = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract)) / 1e6
    note = (
        f"`{command}` on {machine()} (the 2-process job: 2 x 4 CPU devices, gloo); "
        f"{params_m:.1f}M params fp32, chunk {chunk_bytes / MB:g} MB"
    )
    print(write_results(name, rows, columns, note))
    return rows


if __name__ == "__main__":
    main()

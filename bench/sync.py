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
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import argparse  # noqa: E402
import collections  # noqa: E402
import dataclasses  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
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
from jaxrl.weight_sync import WeightSync, live_bytes_by_device  # noqa: E402

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


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model, a few seconds")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk_mb", type=float, default=64.0)
    args = parser.parse_args(argv)
    if len(jax.devices()) < 8:
        raise SystemExit(
            f"bench.sync needs 8 devices, JAX sees {len(jax.devices())}; run it with "
            "XLA_FLAGS=--xla_force_host_platform_device_count=8 in a fresh process."
        )
    config = rlbench_tiny(num_layers=1) if args.smoke else llama_100m()
    repeats = 1 if args.smoke else args.repeats
    chunk_bytes = int((1.0 if args.smoke else args.chunk_mb) * MB)
    command = "python -m bench.sync" + "".join(f" {a}" for a in (argv or []))

    _, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
    # Random values of the model's shapes: what a push costs does not depend on them.
    rng = np.random.default_rng(0)
    host_params = jax.tree.map(lambda a: rng.standard_normal(a.shape, np.float32), abstract)
    rows = []
    # Smoke: one pair per route kind (joined, resharded, cast, cut, plain device_put).
    pairs = [PAIRS[i] for i in (0, 1, 2, 5, 6)] if args.smoke else PAIRS
    for pair in pairs:
        row = measure(pair, host_params, abstract, repeats, chunk_bytes)
        row["command"] = command
        print(json.dumps(row), flush=True)
        rows.append(row)
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


if __name__ == "__main__":
    main()

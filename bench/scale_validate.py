"""The speed-up model (`bench.scale`, `bench.engine_host`) against this machine's `bench.rl` rows,
measured side by side in one run: the CPU proxy's (pinned processes, one device each) and the
8-fake-device setting's sync, async fixed-lag and free-running rows (`bench.rl.FAKE8_MODES`).

Each row runs in its own process, as `bench.rl` runs it (`run_mode` / the proxy's trainer and
generator loops, unchanged; the CPU proxy's processes pinned to their cores, the 8-device rows'
process on all the cores). In that process:

* the machine's constants come from microbenchmarks that are not the workload (`Calibration`): a
  1024^3 float32 matmul (peak FLOP/s), a donated 64 MiB elementwise pass (bandwidth: read +
  write), a chain of 1000 dependent 8 x 8 matmuls (one kernel launch), an empty jitted call
  fetched to the host (one program call), a program that writes a fresh 64 MiB output (one
  page's first touch) and, with several devices, chains of 100 all-reduces over groups of 2, 4
  and 8 devices (one collective's rendezvous). On several devices each microbenchmark runs on all
  of the role's devices at once (each device its own copy), so a constant is the cost of one
  device's unit of work while its siblings run beside it on the shared cores: the 8 fake devices'
  sharing of 2 cores is measured, not assumed. In the sync rows one round runs after every RL
  step (`after_step`, outside the timed step), so the constants and the step see the same load;
  the async rows run 5 rounds before and 5 after (a round between steps would stall or contend
  with the pipeline). Medians.
* the generator's host work (`bench.engine_host.HostCalibration`): the row's own generator
  (engine or static sampler, same slots, mesh and rules) over a tiny model, four batches, in the
  same rounds; its fit gives t_host = c_step + c_call n_calls + c_row n_rowcalls per generate.
* every call the workload makes to its jitted programs (the trainer's RL step, the engine's
  prefill / decode / slot moves, the static sampler) is recorded with its argument shapes (and
  the rows it runs over), and after the run each distinct program is lowered and compiled again
  and read (`jaxrl.infra.hlo_cost.kernels` on `compiled.as_text()`: the per-device program, its
  collectives by group size; `memory_analysis()` for the fresh pages). The call counts per step
  are the workload's schedule (the engine's calls depend on the batch, not on timing); the
  static sampler's decode loop runs `max_new_tokens - 1` times (random weights over 512 tokens
  almost never stop early).

Two comparisons. Per phase, against `bench.rl`'s own medians (wall seconds) and the phase's CPU
seconds: Tg = the generator's calls' t(program) per step + t_host, Tt = t(train step); the step
is Tg + Tt (sync) or max(Tg, Tt + Ts) (async, Ts the weight push, measured); in the async
8-device row the roles' programs take turns on the one runtime (see `phase_row`), so its step,
and its generate phase, are Tg + Tt + Ts. The
reward (~1 ms a step), prompt building and the trainer's collation are not modelled. Per program,
each call timed around the program alone (the recorder blocks on its result; the workload
fetches it next anyway): wall against the model with wall constants, the process's CPU seconds
against the model with CPU-second constants. In the async 8-device row both roles are threads of
one process, so no phase or program has the CPU clock to itself: its CPU columns are left out.
The machine is shared: wall times stretch by however much of the cores other jobs take; CPU
seconds count only this process's work (cache and memory-bus contention still slow it).

    python -m bench.scale_validate --steps 10     # ~10 minutes on 2 quiet cores
    python -m bench.scale_validate --smoke        # 1-layer model, 3 steps: the plumbing only
    python -m bench.scale_validate --turns        # do programs on devices 0-3 and 4-7 overlap?
    python -m bench.scale_validate --summarize    # the committed runs' tables (docs/benchmarks.md)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import sys
import time

from bench.engine_host import HostCalibration, HostCost, rows_of
from bench.scale import (
    Machine,
    ProgramCost,
    StepPrediction,
    fresh_pages,
    program_seconds,
)

ROUNDS_ASYNC = 5


# --- microbenchmarks --------------------------------------------------------------------------


class Calibration:
    """Microbenchmark rounds in this process; `machine()` gives the medians.

    `devices`: the devices the predicted programs run on (default: the first device). With
    several, every microbenchmark runs on all of them at once, as one SPMD program of the same
    per-device size (each device its own matmul, stream, chain, fresh output; no communication),
    so the constants are per device-program while its siblings run beside it on the shared cores:
    wall seconds of one device's unit of work, and the process's CPU seconds for all of them.
    `collectives`: also time all-reduces (`_collective_chains`)."""

    def __init__(self, devices=None, collectives: bool = False):
        import jax
        import jax.numpy as jnp
        import numpy as np
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        devices = list(devices or jax.devices()[:1])
        d = len(devices)
        mesh = jax.sharding.Mesh(np.array(devices), ("d",))
        rows, rep = NamedSharding(mesh, P("d")), NamedSharding(mesh, P())

        def full(shape, value, sharding):  # made in place: nothing is staged on one device
            return jax.jit(lambda: jnp.full(shape, value, jnp.float32), out_shardings=sharding)()

        self.jax, self.rounds = jax, []
        self.collectives = _collective_chains(devices) if collectives else {}
        self.a, self.b = full((d * 1024, 1024), 1.0, rows), full((1024, 1024), 1.0, rep)
        self.matmul = jax.jit(lambda x, y: x @ y)
        self.stream = {"x": full((d * 16 * 1024 * 1024,), 1.0, rows)}
        self.scale = jax.jit(lambda v: v * 0.5 + 1.0, donate_argnums=0)
        self.small, self.w = full((d * 8, 8), 0.1, rows), full((8, 8), 0.1, rep)

        def chain(v, w):
            for _ in range(1000):
                v = v @ w
            return v

        self.chain = jax.jit(chain)
        self.empty = jax.jit(lambda v: v)
        self.fresh_n = 16 * 1024 * 1024  # float32 a device: 64 MiB
        self.fresh = jax.jit(
            lambda v: jnp.broadcast_to(v, (d * self.fresh_n,)) + 1.0, out_shardings=rows
        )
        self.one = jax.device_put(np.float32(1.0), rep)
        from jaxrl.infra.hlo_cost import kernels, totals

        text = self.chain.lower(self.small, self.w).compile().as_text()
        self.chain_kernels = totals(kernels(text))[2]
        self.round()  # compiles and warms up; not kept
        self.rounds.clear()

    def round(self) -> None:
        """One measurement of each constant, in wall seconds and in this process's CPU seconds
        (all its threads: what the work costs, however much of the core others take)."""
        import numpy as np

        block = self.jax.block_until_ready
        wall, cpu = {}, {}

        def timed(key, fn, scale):
            w, c = time.perf_counter(), time.process_time()
            fn()
            wall[key] = scale(time.perf_counter() - w)
            cpu[key] = scale(time.process_time() - c)

        def stream():
            self.stream["x"] = block(self.scale(self.stream["x"]))

        def calls():
            for _ in range(20):
                np.asarray(self.empty(self.small))

        nbytes = 2 * 64 * 1024**2  # read + write, a device
        timed("peak_flops", lambda: block(self.matmul(self.a, self.b)), lambda t: 2 * 1024**3 / t)
        timed("bandwidth", stream, lambda t: nbytes / t)
        timed("launch_s", lambda: block(self.chain(self.small, self.w)),
              lambda t: t / self.chain_kernels)  # fmt: skip
        timed("call_s", calls, lambda t: t / 20)
        pages = self.fresh_n * 4 // 4096
        timed("page_s", lambda: block(self.fresh(self.one)), lambda t: t / pages)
        for g, (fn, x) in self.collectives.items():
            timed(f"collective_{g}", lambda f=fn, v=x: block(f(v)), lambda t: t / COLLECTIVE_CHAIN)
        self.rounds.append((wall, cpu))

    def machine(self, clock: str = "wall") -> Machine:
        """Medians of the rounds; clock "wall" or "cpu"."""
        i = {"wall": 0, "cpu": 1}[clock]
        medians = {k: statistics.median(r[i][k] for r in self.rounds) for k in self.rounds[0][i]}
        groups = tuple(
            (int(k.split("_")[1]), medians.pop(k)) for k in list(medians) if k.startswith("coll")
        )
        return Machine(**medians, collective_s=groups)


COLLECTIVE_CHAIN = 100
COLLECTIVE_GROUPS = (2, 4, 8)


def _collective_chains(devices) -> dict[int, tuple]:
    """Per group size g: a program on `devices`, as a mesh of (devices / g, g),
    that runs `COLLECTIVE_CHAIN` dependent all-reduces of 8 floats a device over the axis of g
    (`shard_map` + `psum`): its time per all-reduce is the cost of one rendezvous of the groups'
    threads, side by side as in the workload's programs (the data is negligible)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n, out = len(devices), {}
    for g in (g for g in COLLECTIVE_GROUPS if n % g == 0):
        mesh = jax.sharding.Mesh(np.array(devices).reshape(n // g, g), ("o", "g"))

        def chain(x):
            for _ in range(COLLECTIVE_CHAIN):
                x = jax.lax.psum(x, "g") * 0.125
            return x

        spec = P(("o", "g"))
        fn = jax.jit(jax.shard_map(chain, mesh=mesh, in_specs=spec, out_specs=spec))
        out[g] = (fn, jax.device_put(jnp.ones((8 * n,)), NamedSharding(mesh, spec)))
    return out


# --- recording the workload's program calls ---------------------------------------------------


def _signature(x) -> tuple:
    """An argument's part of a program's cache key: shape and dtype for an array, the value for
    anything else (static arguments). Never `repr` of an array: printing the params on every
    call cost ~0.17 CPU s a decode call, which the first version of this bench measured as the
    engine's host work."""
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return (tuple(x.shape), x.dtype)
    return (None, repr(x))


class Recorder:
    """Counts calls per (program, argument shapes); lowers each new one when first called (in
    the caller's mesh context), compiles them all in `costs()` after the run."""

    def __init__(self):
        self.calls: dict = {}
        self.phases: dict[str, list[tuple[float, float]]] = {"generate": [], "train": []}

    def timed_phase(self, phase: str, fn):
        """`fn` with each call's (wall, CPU) seconds kept under `phase` (the first: compiles)."""

        def call(*args, **kwargs):
            wall, cpu = time.perf_counter(), time.process_time()
            out = fn(*args, **kwargs)
            self.phases[phase].append((time.perf_counter() - wall, time.process_time() - cpu))
            return out

        return call

    def wrap(self, name: str, fn, default_trips=lambda kwargs: 1):
        import jax

        def call(*args, **kwargs):
            leaves, tree = jax.tree.flatten((args, kwargs))
            key = (name, str(tree), tuple(_signature(x) for x in leaves))
            first = key not in self.calls
            if first:
                rows = rows_of(name, args, kwargs)
                self.calls[key] = [fn.lower(*args, **kwargs), 0, default_trips(kwargs), [], rows]
            self.calls[key][1] += 1
            wall, cpu = time.perf_counter(), time.process_time()
            out = jax.block_until_ready(fn(*args, **kwargs))  # callers fetch the results next
            if not first:  # the first call compiles
                self.calls[key][3].append((time.perf_counter() - wall, time.process_time() - cpu))
            return out

        call.lower = fn.lower
        return call

    def phase_cpu(self) -> dict[str, float]:
        """Median CPU seconds per call of each phase, after the first (compiling) call."""
        return {k: statistics.median(c for _, c in v[1:]) for k, v in self.phases.items() if v[1:]}

    def costs(self) -> list[tuple[str, int, ProgramCost, list, int]]:
        """(name, calls, cost, [(wall s, CPU s) of each call after the first], rows of a call)
        per program."""
        from jaxrl.infra.hlo_cost import collectives, kernels

        out = []
        for (name, *_), (lowered, count, trips, times, rows) in self.calls.items():
            compiled = lowered.compile()
            memory = compiled.memory_analysis()
            pages = fresh_pages(
                memory.temp_size_in_bytes,
                memory.output_size_in_bytes - memory.alias_size_in_bytes,
            )
            ks = kernels(compiled.as_text(), trips)
            cost = ProgramCost(tuple((k.flops, k.bytes, k.count) for k in ks), pages,
                               collectives(ks))  # fmt: skip
            out.append((name, count, cost, times, rows))
        return out


@contextlib.contextmanager
def recording(recorder: Recorder):
    """Wraps the jitted programs of every Trainer, Engine and Sampler built inside."""
    from jaxrl.generation.engine import Engine
    from jaxrl.generation.executor import GeneratorExecutor
    from jaxrl.generation.sampler import Sampler
    from jaxrl.train.trainer import Trainer

    def patch(cls, attrs, trips=lambda kwargs: 1):
        init = cls.__init__

        def __init__(self, *args, **kwargs):
            init(self, *args, **kwargs)
            for attr, name in attrs:
                setattr(self, attr, recorder.wrap(name, getattr(self, attr), trips))

        cls.__init__ = __init__
        return cls, init

    def sampler_trips(kwargs):  # the decode while loop: one step per new token after the first
        return kwargs["sampling"].max_new_tokens - 1

    saved = [
        patch(Trainer, [("_rl", "train")]),
        patch(Engine, [("_prefill", "prefill"), ("_decode", "decode"), ("_move", "move")]),
        patch(Sampler, [("_generate", "sample")], sampler_trips),
    ]
    methods = [(GeneratorExecutor, "generate"), (Trainer, "rl_step")]
    originals = [getattr(cls, name) for cls, name in methods]
    GeneratorExecutor.generate = recorder.timed_phase("generate", GeneratorExecutor.generate)
    Trainer.rl_step = recorder.timed_phase("train", Trainer.rl_step)
    try:
        yield recorder
    finally:
        for cls, init in saved:
            cls.__init__ = init
        for (cls, name), fn in zip(methods, originals, strict=True):
            setattr(cls, name, fn)


# --- the model per phase ----------------------------------------------------------------------


def machine(out: dict, phase: str, clock: str) -> Machine:
    """The row's constants for a phase's programs: the trainer's own where its devices were
    calibrated apart (the async 8-device row), else the process's."""
    return out.get(f"{phase}_{clock}") or out[clock]


def predict(out: dict, steps: int, clock: str) -> dict:
    """Per-step seconds of the recorded calls: the generator's programs plus its host work
    (`bench.engine_host`, counts from the recorded schedule), and the train step."""
    gen = train = calls = rowcalls = 0.0
    for name, count, cost, _, rows in out["costs"]:
        phase = "train" if name == "train" else "generate"
        t = program_seconds(cost, machine(out, phase, clock)) * count / steps
        if phase == "train":
            train += t
        else:
            gen += t
            calls += count / steps
            rowcalls += count * rows / steps
    host: HostCost | None = out.get(f"host_{clock}")
    host_s = host.seconds(calls, rowcalls) if host is not None and calls else 0.0
    return dict(generate_s=gen + host_s, programs_s=gen, host_s=host_s, train_s=train,
                calls=calls, rowcalls=rowcalls)  # fmt: skip


def measured_programs(out: dict, steps: int, clock: str) -> float:
    """Per step, the generator's programs as measured (median call times x calls per step)."""
    i = {"wall": 0, "cpu": 1}[clock]
    return sum(
        statistics.median(t[i] for t in times) * count / steps
        for name, count, _, times, _ in out["costs"]
        if name != "train" and times
    )


# --- the rows, each in its own process --------------------------------------------------------


def _result(measured, calibration, host, recorder) -> dict:
    return dict(
        measured=measured, wall=calibration.machine("wall"), cpu=calibration.machine("cpu"),
        host_wall=host.cost("wall") if host else None, host_cpu=host.cost("cpu") if host else None,
        host_batches=host.measured() if host else {}, costs=recorder.costs(),
        phase_cpu=recorder.phase_cpu(),
    )  # fmt: skip


def controller_row(mode, steps: int, smoke: bool, between_steps: bool) -> dict:
    """A `bench.rl` row run through the Controller (`run_mode`), recorded. `between_steps`: one
    calibration round (machine and host) after every RL step, outside the timed step (sync
    rows); else `ROUNDS_ASYNC` before and after the run (a round between steps would stall or
    contend with the async pipeline)."""
    import jax

    import bench.rl as rl

    def devices(sizes_first):
        (a, b), first = sizes_first
        return jax.devices()[first : first + a * b]

    # Colocated: one calibration on the trainer's devices; async: one per role's devices.
    calibration = Calibration(devices(mode.generator or mode.trainer), jax.device_count() > 1)
    trainer = Calibration(devices(mode.trainer), True) if mode.generator else None
    host = HostCalibration("engine", mode.trainer, mode.generator)
    recorder = Recorder()

    def rounds(n):
        for _ in range(n):
            calibration.round()
            if trainer:
                trainer.round()
            host.round()

    original = rl.MemoryIO.after_step
    if between_steps:
        rl.MemoryIO.after_step = lambda self, step: rounds(1)
    else:
        rounds(ROUNDS_ASYNC)
    try:
        with recording(recorder):
            measured = rl.run_mode(mode, steps, smoke)
    finally:
        rl.MemoryIO.after_step = original
    if not between_steps:
        rounds(ROUNDS_ASYNC)
    out = _result(measured, calibration, host, recorder)
    if trainer:
        out |= dict(train_wall=trainer.machine("wall"), train_cpu=trainer.machine("cpu"))
    return out


def _calibrated(fn, kind, *args):
    calibration = Calibration()
    host = HostCalibration(kind) if kind else None

    def rounds():
        for _ in range(ROUNDS_ASYNC):
            calibration.round()
            if host:
                host.round()

    rounds()
    recorder = Recorder()
    with recording(recorder):
        records = fn(*args)
    rounds()
    return _result(records, calibration, host, recorder)


def async_trainer(steps, smoke, weights_out, rollouts_in):
    from bench.rl import proxy_trainer

    return _calibrated(proxy_trainer, None, steps, smoke, weights_out, rollouts_in)


def async_generator(steps, smoke, weights_in, rollouts_out):
    from bench.rl import proxy_generator

    return _calibrated(proxy_generator, "static", steps, smoke, weights_in, rollouts_out)


def program_rows(row: str, out: dict, steps: int) -> list[dict]:
    """Per program: calls per step, the model's seconds per call (wall and CPU constants) and the
    measured medians per call (wall, CPU), calls after each program's first."""
    rows = []
    for name, count, cost, times, _ in out["costs"]:
        if not times:
            continue
        phase = "train" if name == "train" else "generate"
        wall = statistics.median(w for w, _ in times)
        cpu = statistics.median(c for _, c in times)
        pred_wall = program_seconds(cost, machine(out, phase, "wall"))
        pred_cpu = program_seconds(cost, machine(out, phase, "cpu"))
        rows.append(dict(
            row=row, program=name, calls_per_step=count / steps, gflop=cost.flops / 1e9,
            gbytes=cost.bytes / 1e9, launches=cost.launches, fresh_pages=cost.pages,
            collectives=sum(n for _, n in cost.collectives),
            predicted_cpu_s=pred_cpu, measured_cpu_s=cpu, ratio_cpu=pred_cpu / cpu,
            predicted_wall_s=pred_wall, measured_wall_s=wall, ratio_wall=pred_wall / wall,
        ))  # fmt: skip
    return rows


def phase_row(setting, gen: dict, train: dict, measured: dict, steps: int, cpu_phases: bool,
              schedule: str) -> dict:  # fmt: skip
    """Predicted vs measured per phase, wall (against `bench.rl`'s own medians) and CPU (the
    phase's CPU seconds, where the phase has its process to itself: `cpu_phases`). `schedule`:
    "sync": the step is Tg + Tt; "pipelined": max(Tg, Tt + Ts) (Ts measured); "turns": async
    roles whose programs take turns on one runtime (XLA's fake CPU devices run one program at a
    time: a program on devices 4-7 waits for one running on devices 0-3), so the step is
    Tg + Tt + Ts and, as the generator never idles, its phase spans the step."""
    row = {"setting": setting, "mode": measured["mode"]}
    for clock in ("wall", "cpu"):
        g, t = predict(gen, steps, clock), predict(train, steps, clock)
        prefix = "" if clock == "wall" else "cpu_"
        row[prefix + "pred_programs_s"] = g["programs_s"]
        row[prefix + "pred_host_s"] = g["host_s"]
        row[prefix + "pred_generate_s"] = g["generate_s"]
        row[prefix + "pred_train_s"] = t["train_s"]
    row["calls_per_step"], row["rowcalls_per_step"] = g["calls"], g["rowcalls"]
    row["measured_generate_s"] = measured["generate_s"]
    row["measured_train_s"] = measured["train_s"]
    row["measured_step_s"] = measured["step_s"]
    row["measured_sync_s"] = measured.get("sync_s", 0.0)
    step = StepPrediction(row["pred_generate_s"], row["pred_train_s"], row["measured_sync_s"])
    row["pred_step_s"] = step.async_step_s if schedule == "pipelined" else step.sync_step_s
    if schedule == "turns":
        row["pred_step_s"] = row["pred_generate_s"] = step.sync_step_s + row["measured_sync_s"]
    row["measured_host_s"] = measured["generate_s"] - measured_programs(gen, steps, "wall")
    checks = [("generate", ""), ("train", ""), ("step", "")]
    if cpu_phases:
        row["cpu_measured_generate_s"] = gen["phase_cpu"].get("generate", float("nan"))
        row["cpu_measured_train_s"] = train["phase_cpu"].get("train", float("nan"))
        row["cpu_measured_host_s"] = row["cpu_measured_generate_s"] - measured_programs(
            gen, steps, "cpu"
        )
        checks += [("generate", "cpu_"), ("train", "cpu_")]
    verdict = []
    for key, prefix in checks:
        ratio = row[f"{prefix}pred_{key}_s"] / row[f"{prefix}measured_{key}_s"]
        row[f"{prefix}ratio_{key}"] = ratio
        ok = abs(ratio - 1.0) <= 0.3
        verdict.append(f"{key}{' CPU' if prefix else ''} {'yes' if ok else 'NO'}")
    row["within_30"] = ", ".join(verdict)
    row["constants"] = _constants(gen["wall"])
    if gen is not train or "train_wall" in train:
        trainer_wall = machine(train, "train", "wall")
        row["constants"] += " (generator's; trainer's: " + _constants(trainer_wall) + ")"
    if gen.get("host_wall") is not None:
        h = gen["host_wall"]
        row["host_constants"] = (f"step {h.step_s * 1e3:.2f} ms, call {h.call_s * 1e6:.0f} us, "
                                 f"row-call {h.row_s * 1e6:.1f} us")  # fmt: skip
    return row


def _constants(m: Machine) -> str:
    text = (
        f"{m.peak_flops / 1e9:.0f} GFLOP/s, {m.bandwidth / 1e9:.0f} GB/s, launch "
        f"{m.launch_s * 1e6:.2f} us, call {m.call_s * 1e6:.0f} us, page {m.page_s * 1e6:.2f} us"
    )
    groups = " / ".join(f"{s * 1e6:.0f}" for _, s in m.collective_s)
    sizes = "/".join(str(g) for g, _ in m.collective_s)
    return text + (f", collective of {sizes} devices {groups} us" if m.collective_s else "")


def run(steps: int, smoke: bool, settings: tuple[str, ...]) -> tuple[list[dict], list[dict]]:
    import multiprocessing

    import bench.rl as rl

    cores = sorted(os.sched_getaffinity(0))
    phases, programs = [], []
    if "proxy" in settings and len(cores) >= 2:
        sync_modes = [(rl.PROXY_SYNC_1, {cores[0]})] + (
            [] if smoke else [(rl.PROXY_SYNC_2, set(cores[:2]))]
        )
        for mode, use in sync_modes:  # fmt: skip
            out = rl.Spawned(controller_row, mode, steps, smoke, True, cores=use).result()
            phases.append(phase_row(rl.PROXY, out, out, out["measured"], steps, True, "sync"))
            programs += program_rows(mode.name, out, steps)
        ctx = multiprocessing.get_context("spawn")
        weights_in, weights_out = ctx.Pipe(duplex=False)
        rollouts_in, rollouts_out = ctx.Pipe(duplex=False)
        trainer = rl.Spawned(async_trainer, steps, smoke, weights_out, rollouts_in,
                             cores={cores[0]})  # fmt: skip
        generator = rl.Spawned(async_generator, steps, smoke, weights_in, rollouts_out,
                               cores={cores[1]})  # fmt: skip
        t_out, g_out = trainer.result(), generator.result()
        measured = rl.summarise_proxy_async(t_out["measured"], g_out["measured"],
                                            warmup=1 if smoke else 2)  # fmt: skip
        phases.append(phase_row(rl.PROXY, g_out, t_out, measured, steps, True, "pipelined"))
        programs += program_rows(measured["mode"] + ": trainer", t_out, steps)
        programs += program_rows(measured["mode"] + ": generator", g_out, steps)
    if "fake8" in settings:
        for mode in rl.FAKE8_MODES:
            sync = mode.generator is None
            out = rl.Spawned(controller_row, mode, steps, smoke, sync, devices=8).result()
            # Async: the roles' threads share the process, so no phase has its CPU clock alone,
            # and their programs take turns on the runtime.
            phases.append(phase_row(rl.FAKE8, out, out, out["measured"], steps, sync,
                                    "sync" if sync else "turns"))  # fmt: skip
            programs += program_rows(mode.name, out, steps)
    return phases, programs


def turns_check(n: int = 512, reps: int = 40) -> dict:
    """Does this runtime run programs on disjoint devices side by side? A long program (`reps`
    dependent [n, n] matmuls a device) runs on devices 0-3 in a thread; 50 ms later a short one
    runs on devices 4-7, then (in a second long run) on device 4 alone. Returns the seconds of
    each alone and of each short one issued during the long one: if it waits for the long one
    to finish, the async roles of the 8-device setting take turns (`phase_row`'s "turns").
    XLA:CPU holds a multi-device program while another multi-device program runs, not a
    one-device one: a one-device generator runs beside a multi-device trainer."""
    import threading

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    def program(devices, size, count):
        mesh = Mesh(np.array(devices), ("d",))
        x = jax.device_put(jnp.ones((len(devices) * size, size)), NamedSharding(mesh, P("d")))
        w = jax.device_put(jnp.full((size, size), 1e-3), NamedSharding(mesh, P()))

        def f(x, w):
            for _ in range(count):
                x = jnp.tanh(x @ w)
            return x

        fn = jax.jit(f)
        fn(x, w).block_until_ready()  # compiled
        return lambda: fn(x, w).block_until_ready()

    devices = jax.devices()
    long = program(devices[:4], n, reps)
    shorts = {
        "short": program(devices[4:8], 64, 5),
        "one_device_short": program(devices[4:5], 64, 5),
    }

    def timed(fn):
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    out = {"long_alone_s": timed(long)}
    for name, short in shorts.items():
        out[f"{name}_alone_s"] = timed(short)
        thread = threading.Thread(target=long)
        thread.start()
        time.sleep(0.05)
        out[f"{name}_during_long_s"] = timed(short)
        thread.join()
    return out


PHASE_COLUMNS = [
    ("setting", "setting"),
    ("mode", "row"),
    ("pred_programs_s", "generate: programs s"),
    ("pred_host_s", "+ host s"),
    ("pred_generate_s", "= generate predicted s"),
    ("measured_generate_s", "generate measured s"),
    ("ratio_generate", "ratio"),
    ("pred_train_s", "train predicted s"),
    ("measured_train_s", "train measured s"),
    ("ratio_train", "ratio"),
    ("pred_step_s", "step predicted s"),
    ("measured_step_s", "step measured s"),
    ("ratio_step", "ratio"),
    ("cpu_pred_generate_s", "generate CPU s predicted (host part)"),
    ("cpu_measured_generate_s", "generate CPU s measured"),
    ("cpu_ratio_generate", "ratio"),
    ("cpu_pred_host_s", "host CPU s predicted"),
    ("cpu_measured_host_s", "host CPU s measured (phase - its programs)"),
    ("cpu_pred_train_s", "train CPU s predicted"),
    ("cpu_measured_train_s", "train CPU s measured"),
    ("cpu_ratio_train", "ratio"),
    ("within_30", "within 30%?"),
    ("constants", "constants (wall medians, same process)"),
    ("host_constants", "host constants (wall, tiny model)"),
]
PROGRAM_COLUMNS = [
    ("row", "row"),
    ("program", "program"),
    ("calls_per_step", "calls / step"),
    ("gflop", "GFLOP (dots)"),
    ("gbytes", "GB moved"),
    ("launches", "kernels"),
    ("collectives", "collectives"),
    ("fresh_pages", "fresh pages"),
    ("predicted_cpu_s", "CPU s predicted"),
    ("measured_cpu_s", "CPU s measured"),
    ("ratio_cpu", "ratio"),
    ("predicted_wall_s", "wall s predicted"),
    ("measured_wall_s", "wall s measured"),
    ("ratio_wall", "ratio"),
]


# --- summaries of the committed runs (docs/benchmarks.md's two tables) -------------------------

SUMMARY, RUNS = "scale_validate_summary", "scale_validate_runs"
LATEST = "scale_validate"  # the file a run writes: the per-row table's run
SUMMARY_COLUMNS = [
    ("row", "row"),
    ("generate", "generate s: programs + host = predicted / measured (ratio)"),
    ("train", "train s (ratio)"),
    ("step", "step s (ratio)"),
    ("generate_cpu", "generate CPU s (ratio)"),
    ("train_cpu", "train CPU s (ratio)"),
    ("host_ms", "host ms predicted / measured"),
    ("verdict", "within 30%?"),
]
RUNS_COLUMNS = [
    ("run", "run (UTC, load average)"),
    ("row", "row"),
    ("wall", "wall: generate / train / step"),
    ("cpu", "CPU: generate / train"),
    ("source", "file"),
]
_NOTE = re.compile(
    r"(\d\d:\d\d)-(\d\d:\d\d) UTC, load average \(1/5/15 min\) ([\d.]+)/\S+ -> ([\d.]+)/"
)


def _labels() -> dict[str, tuple[str, str, str]]:
    """bench.rl's rows by mode: (the per-row table's label, the runs table's group, its part)."""
    import bench.rl as rl

    sync8, fixed8, free8 = (m.name for m in rl.FAKE8_MODES)
    return {
        rl.PROXY_SYNC_1.name: ("proxy sync, 1 core", "proxy sync, ", "1 core"),
        rl.PROXY_SYNC_2.name: ("proxy sync, 2 cores", "proxy sync, ", "2 cores"),
        rl.PROXY_ASYNC: ("proxy async, 1 core each", "proxy async", ""),
        sync8: ("8 devices, sync", "8 devices ", "sync"),
        fixed8: ("8 devices, async (4 + 4)", "8 devices ", "fixed lag"),
        free8: ("8 devices, free-running (4 + 4)", "8 devices ", "free-running"),
    }


def with_turns(row: dict) -> dict:
    """A phase row with the turns term (`phase_row`'s "turns"): an async 8-device row of a run
    from before it (its generate phase predicted as the generator's programs + host, its step
    as max(Tg, Tt + Ts)) is recomputed from its recorded predictions, Tg + Tt + Ts for both;
    any other row comes back unchanged."""
    from bench.rl import FAKE8

    own = row["pred_programs_s"] + row["pred_host_s"]
    if row["setting"] != FAKE8 or "async" not in row["mode"]:
        return row
    if abs(row["pred_generate_s"] - own) > 1e-9:  # already Tg + Tt + Ts
        return row
    turns = own + row["pred_train_s"] + row["measured_sync_s"]
    return row | {
        "pred_generate_s": turns, "pred_step_s": turns, "turns_recomputed": True,
        "ratio_generate": turns / row["measured_generate_s"],
        "ratio_step": turns / row["measured_step_s"],
    }  # fmt: skip


def _ratio(r: float) -> str:
    """A ratio to 2 decimals, in bold outside 30% (`phase_row`'s criterion)."""
    return f"{r:.2f}" if abs(r - 1.0) <= 0.3 else f"**{r:.2f}**"


def _checks(row: dict) -> dict[str, float]:
    out = {name: row[f"ratio_{name}"] for name in ("generate", "train", "step")}
    out |= {f"{name} CPU": row[f"cpu_ratio_{name}"] for name in ("generate", "train")
            if f"cpu_ratio_{name}" in row}  # fmt: skip
    return out


def _runs(source: str) -> list[tuple[str, dict]]:
    """(name, result) of every run's phase file in SOURCE (scale_validate.json and the kept
    scale_validate_X.json), earliest first; the rows with the turns term."""
    import glob

    runs = []
    for path in glob.glob(os.path.join(source, "scale_validate*.json")):
        name = os.path.basename(path)[: -len(".json")]
        if name.endswith(("_programs", "_smoke")) or name in (SUMMARY, RUNS):
            continue
        with open(path) as f:
            result = json.load(f)
        rows = result.get("rows") if isinstance(result, dict) else None
        if rows and all("ratio_generate" in r and "setting" in r for r in rows):
            result["rows"] = [with_turns(r) for r in result["rows"]]
            runs.append((name, result))
    return sorted(runs, key=lambda run: run[1]["date"])


def summary_rows(result: dict) -> list[dict]:
    """One run's rows (by default LATEST) as docs/benchmarks.md's per-row table: per phase
    predicted / measured (ratio), wall and CPU; the host work in CPU ms, predicted and measured
    (the generate phase's CPU seconds minus its programs'); the 30% verdict. A "-" where the row
    has no CPU clock of its own (the async 8-device row: two roles' threads in one process)."""
    labels, rows = _labels(), []
    for r in map(with_turns, result["rows"]):
        turns = abs(r["pred_generate_s"] - r["pred_programs_s"] - r["pred_host_s"]) > 1e-9
        generate = f"{r['pred_programs_s']:.3f} + {r['pred_host_s']:.3f}" + (
            " + Tt + Ts" if turns else ""
        )
        row = {"row": labels.get(r["mode"], (r["mode"],))[0], "setting": r["setting"]}
        row["generate"] = (
            f"{generate} = {r['pred_generate_s']:.3f} / {r['measured_generate_s']:.3f} "
            f"({_ratio(r['ratio_generate'])})"
        )
        for key, prefix in (("train", ""), ("step", ""), ("generate_cpu", "cpu_"),
                            ("train_cpu", "cpu_")):  # fmt: skip
            phase = key.split("_")[0]
            if f"{prefix}ratio_{phase}" not in r:
                row[key] = "-"
                continue
            row[key] = (
                f"{r[f'{prefix}pred_{phase}_s']:.3f} / {r[f'{prefix}measured_{phase}_s']:.3f} "
                f"({_ratio(r[f'{prefix}ratio_{phase}'])})"
            )
        if "cpu_measured_host_s" in r:
            row["host_ms"] = (
                f"{1e3 * r['cpu_pred_host_s']:.1f} / {1e3 * r['cpu_measured_host_s']:.1f}"
            )
        else:
            row["host_ms"] = "-"
        checks = _checks(r)
        outside = [name for name, ratio in checks.items() if abs(ratio - 1.0) > 0.3]
        row["verdict"] = f"no: {', '.join(outside)}" if outside else f"yes, all {len(checks)}"
        row |= {f"ratio_{name.replace(' CPU', '_cpu')}": v for name, v in checks.items()}
        rows.append(row)
    return rows


def runs_rows(runs: list[tuple[str, dict]]) -> list[dict]:
    """Every run's ratios, earliest first, as docs/benchmarks.md's table: a run's rows grouped
    as bench.rl's settings (proxy sync, proxy async, 8 devices), the ratios of a group's rows
    joined by "; " (wall generate / train / step, CPU generate / train, "-" without a CPU clock),
    outside 30% in bold; the run's time and 1-minute load average (before -> after) from its
    note, "8 devices only" for a run without the proxy's rows."""
    from bench.rl import PROXY

    labels, out = _labels(), []
    for number, (name, result) in enumerate(runs, 1):
        groups: list[tuple[str, list]] = []
        for r in result["rows"]:
            _, group, part = labels.get(r["mode"], (None, r["mode"], ""))
            if not groups or groups[-1][0] != group:
                groups.append((group, []))
            groups[-1][1].append((part, r))
        match = _NOTE.search(result.get("note", ""))
        when = f"{match[1]}-{match[2]}, {match[3]} -> {match[4]}" if match else result["date"]
        if not any(r["setting"] == PROXY for r in result["rows"]):
            when += "; 8 devices only"
        outside = sum(abs(v - 1.0) > 0.3 for r in result["rows"] for v in _checks(r).values())
        first = {
            "run": f"{number} ({when})", "source": f"`{name}`", "run_number": number,
            "comparisons": sum(len(_checks(r)) for r in result["rows"]), "outside_30": outside,
        }  # fmt: skip
        for i, (group, members) in enumerate(groups):
            parts = " / ".join(p for p, _ in members if p)
            row = dict(first) if i == 0 else {"run_number": number}
            row["row"] = group + parts
            row["wall"] = "; ".join(
                " / ".join(_ratio(r[f"ratio_{k}"]) for k in ("generate", "train", "step"))
                for _, r in members
            )
            row["cpu"] = "; ".join(
                " / ".join(_ratio(r[f"cpu_ratio_{k}"]) for k in ("generate", "train"))
                if "cpu_ratio_generate" in r else "-"
                for _, r in members
            )  # fmt: skip
            row["modes"] = [r["mode"] for _, r in members]
            out.append(row)
    return out


def summarize(source: str = "") -> tuple[list[dict], list[dict]]:
    """Writes SUMMARY (the per-row table of LATEST) and RUNS (every run's ratios) from the
    runs' files in SOURCE (default: the committed results)."""
    from bench.common import COMMITTED_RESULTS_DIR, write_results

    runs = _runs(source or COMMITTED_RESULTS_DIR)
    latest = dict(runs)[LATEST]
    summary = summary_rows(latest)
    note = f"bench/results/{LATEST}.json per row, its run: {latest['note']}"
    print(write_results(SUMMARY, summary, SUMMARY_COLUMNS, note))
    every = runs_rows(runs)
    names = ", ".join(name for name, _ in runs)
    note = (
        f"the runs of bench/results/scale_validate*.json, earliest first ({names}); the async "
        "8-device rows of runs before the turns term recomputed with it from their predictions"
    )
    print(write_results(RUNS, every, RUNS_COLUMNS, note))
    return summary, every


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=0, help="RL steps per row (default 16)")
    smoke = "1-layer model, 3 steps, no 2-core row: checks the plumbing"
    parser.add_argument("--smoke", action="store_true", help=smoke)
    settings = "comma-separated: proxy (pinned processes), fake8 (8 fake devices)"
    parser.add_argument("--settings", default="proxy,fake8", help=settings)
    turns = "only check whether programs on devices 0-3 and 4-7 run side by side (8 devices)"
    parser.add_argument("--turns", action="store_true", help=turns)
    summarize_help = (
        f"run nothing: write {SUMMARY}.json (the per-row table of {LATEST}.json) and {RUNS}.json "
        "(every committed run's ratios) from bench/results/scale_validate*.json"
    )
    parser.add_argument("--summarize", action="store_true", help=summarize_help)
    args = parser.parse_args(argv)
    if args.summarize:
        return summarize()
    if args.turns:
        from bench.cpu_devices import simulate

        simulate(8)  # before JAX starts (without it, one CPU device and nothing on 4-7)
        print(json.dumps(turns_check()))
        return None
    steps = args.steps or (3 if args.smoke else 16)
    load_before = os.getloadavg()
    start = time.strftime("%H:%M", time.gmtime())
    phases, programs = run(steps, args.smoke, tuple(args.settings.split(",")))
    load_after = os.getloadavg()
    for row in phases + programs:
        print(json.dumps(row))
    from bench.common import write_results

    command = "python -m bench.scale_validate" + "".join(f" {a}" for a in (argv or []))
    command = os.environ.get("JAXRL_BENCH_COMMAND") or command  # `python -m bench`
    note = (
        f"`{command}` {start}-{time.strftime('%H:%M', time.gmtime())} UTC, load average "
        f"(1/5/15 min) {'/'.join(f'{x:.1f}' for x in load_before)} -> "
        f"{'/'.join(f'{x:.1f}' for x in load_after)}, {len(os.sched_getaffinity(0))} CPU cores"
    )
    smoke = "_smoke" if args.smoke else ""  # *_smoke.* results are not kept (.gitignore)
    print(write_results("scale_validate" + smoke, phases, PHASE_COLUMNS, note))
    print(write_results("scale_validate_programs" + smoke, programs, PROGRAM_COLUMNS, note))
    return phases, programs


if __name__ == "__main__":
    main(sys.argv[1:])

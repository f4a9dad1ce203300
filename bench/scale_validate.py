"""The speed-up model (`bench.scale`) against this machine's `bench.rl` CPU-proxy rows, measured
side by side in one run.

Each row runs in its own pinned process (as `bench.rl` runs it: `run_mode` / the proxy's trainer
and generator loops, unchanged). In that process:

* the machine's constants come from microbenchmarks that are not the workload (`Calibration`): a
  1024^3 float32 matmul (peak FLOP/s), a donated 64 MiB elementwise pass (bandwidth: read +
  write), a chain of 1000 dependent 8 x 8 matmuls (one kernel launch), an empty jitted call
  fetched to the host (one program call), and a program that writes a fresh 64 MiB output (one
  page's first touch). In the sync rows one round runs after every RL step (`after_step`, outside
  the timed step), so the constants and the step see the same load; the async row's processes run
  5 rounds before and 5 after their loops (a round between steps would delay the pipeline).
  Medians.
* every call the workload makes to its jitted programs (the trainer's RL step, the engine's
  prefill / decode / slot moves, the static sampler) is recorded with its argument shapes, and
  after the run each distinct program is lowered and compiled again and read
  (`bench.hlo_cost.kernels` on `compiled.as_text()`, `memory_analysis()` for the fresh pages).
  The call counts per step are the workload's schedule (the engine's calls depend on the batch,
  not on timing); the static sampler's decode loop runs `max_new_tokens - 1` times (random
  weights over 512 tokens almost never stop early).

Two comparisons. Per phase, against `bench.rl`'s own medians (wall seconds): Tg = the
generator's calls' t(program) per step, Tt = t(train step) (the async row's weight push Ts is
measured, not modelled; host work outside the programs, such as prompt building, collation and
the reward, is not modelled). Per program, each call timed around the program alone (the
recorder blocks on its result; the workload fetches it next anyway): wall seconds against the
model with wall constants, and the process's CPU seconds against the model with constants in CPU
seconds. The machine is shared: wall times stretch by however much of the core other jobs take,
and not in the same proportion for a 20 ms microbenchmark as for a 2 s step; CPU seconds count
only this process's work (cache and memory-bus contention still slow it).

    python -m bench.scale_validate            # ~5 minutes on 2 quiet cores (15 at load 20)
    python -m bench.scale_validate --steps 8  # shorter
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

from bench.scale import Machine, ProgramCost, StepPrediction, fresh_pages, program_seconds

ROUNDS_ASYNC = 5


# --- microbenchmarks --------------------------------------------------------------------------


class Calibration:
    """Microbenchmark rounds in this process; `machine()` gives the medians."""

    def __init__(self):
        import jax
        import jax.numpy as jnp

        self.jax, self.rounds = jax, []
        self.a = jnp.ones((1024, 1024), jnp.float32)
        self.matmul = jax.jit(lambda x, y: x @ y)
        self.stream = {"x": jnp.ones((16 * 1024 * 1024,), jnp.float32)}
        self.scale = jax.jit(lambda v: v * 0.5 + 1.0, donate_argnums=0)
        small = jnp.full((8, 8), 0.1, jnp.float32)
        self.small = small

        def chain(v, w):
            for _ in range(1000):
                v = v @ w
            return v

        self.chain = jax.jit(chain)
        self.empty = jax.jit(lambda v: v)
        self.fresh_n = 16 * 1024 * 1024  # float32: 64 MiB
        self.fresh = jax.jit(lambda v: jnp.broadcast_to(v, (self.fresh_n,)) + 1.0)
        from bench.hlo_cost import kernels, totals

        self.chain_kernels = totals(kernels(self.chain.lower(small, small).compile().as_text()))[2]
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

        nbytes = 2 * self.stream["x"].nbytes  # read + write
        timed("peak_flops", lambda: block(self.matmul(self.a, self.a)), lambda t: 2 * 1024**3 / t)
        timed("bandwidth", stream, lambda t: nbytes / t)
        timed("launch_s", lambda: block(self.chain(self.small, self.small)),
              lambda t: t / self.chain_kernels)  # fmt: skip
        timed("call_s", calls, lambda t: t / 20)
        one = np.float32(1.0)
        timed("page_s", lambda: block(self.fresh(one)), lambda t: t / (self.fresh_n * 4 // 4096))
        self.rounds.append((wall, cpu))

    def machine(self, clock: str = "wall") -> Machine:
        """Medians of the rounds; clock "wall" or "cpu"."""
        i = {"wall": 0, "cpu": 1}[clock]
        keys = self.rounds[0][i]
        return Machine(**{k: statistics.median(r[i][k] for r in self.rounds) for k in keys})


# --- recording the workload's program calls ---------------------------------------------------


def _signature(x) -> tuple:
    """An argument's part of a program's cache key: shape and dtype for an array, the value for
    anything else (static arguments). Never `repr` of an array: printing the params on every
    call cost ~0.17 CPU s a decode call, which the first version of this bench measured as the
    engine's host work."""
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return (tuple(x.shape), str(x.dtype))
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
                self.calls[key] = [fn.lower(*args, **kwargs), 0, default_trips(kwargs), []]
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

    def costs(self) -> list[tuple[str, int, ProgramCost, list]]:
        """(name, calls, cost, [(wall s, CPU s) of each call after the first]) per program."""
        from bench.hlo_cost import kernels

        out = []
        for (name, *_), (lowered, count, trips, times) in self.calls.items():
            compiled = lowered.compile()
            memory = compiled.memory_analysis()
            pages = fresh_pages(
                memory.temp_size_in_bytes,
                memory.output_size_in_bytes - memory.alias_size_in_bytes,
            )
            ks = kernels(compiled.as_text(), trips)
            cost = ProgramCost(tuple((k.flops, k.bytes, k.count) for k in ks), pages)
            out.append((name, count, cost, times))
        return out


@contextlib.contextmanager
def recording(recorder: Recorder):
    """Wraps the jitted programs of every Trainer, Engine and Sampler built inside."""
    from jaxrl.executors import GeneratorExecutor
    from jaxrl.generation.engine import Engine
    from jaxrl.generation.sampler import Sampler
    from jaxrl.trainer import Trainer

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


def predict(costs, steps: int, machine: Machine) -> dict:
    """Per-step seconds of the recorded calls, split into generate and train."""
    gen = train = 0.0
    detail = {}
    for name, count, cost, _ in costs:
        seconds = program_seconds(cost, machine) * count / steps
        detail[name] = detail.get(name, 0.0) + seconds
        if name == "train":
            train += seconds
        else:
            gen += seconds
    return {"generate_s": gen, "train_s": train, "programs": detail}


# --- the rows, each in its pinned process -----------------------------------------------------


def sync_row(mode, steps: int) -> dict:
    import bench.rl as rl

    calibration = Calibration()
    recorder = Recorder()
    original = rl.MemoryIO.after_step
    rl.MemoryIO.after_step = lambda self, step: calibration.round()
    try:
        with recording(recorder):
            measured = rl.run_mode(mode, steps, False)
    finally:
        rl.MemoryIO.after_step = original
    return dict(measured=measured, wall=calibration.machine("wall"), cpu=calibration.machine("cpu"),
                costs=recorder.costs(), phase_cpu=recorder.phase_cpu())  # fmt: skip


def _calibrated(fn, *args):
    calibration = Calibration()
    for _ in range(ROUNDS_ASYNC):
        calibration.round()
    recorder = Recorder()
    with recording(recorder):
        records = fn(*args)
    for _ in range(ROUNDS_ASYNC):
        calibration.round()
    return dict(records=records, wall=calibration.machine("wall"), cpu=calibration.machine("cpu"),
                costs=recorder.costs(), phase_cpu=recorder.phase_cpu())  # fmt: skip


def async_trainer(steps, weights_out, rollouts_in):
    from bench.rl import proxy_trainer

    return _calibrated(proxy_trainer, steps, False, weights_out, rollouts_in)


def async_generator(steps, weights_in, rollouts_out):
    from bench.rl import proxy_generator

    return _calibrated(proxy_generator, steps, False, weights_in, rollouts_out)


def program_rows(row: str, out: dict, steps: int) -> list[dict]:
    """Per program: calls per step, the model's seconds per call (wall and CPU constants) and the
    measured medians per call (wall, CPU), calls after each program's first."""
    rows = []
    for name, count, cost, times in out["costs"]:
        if not times:
            continue
        wall = statistics.median(w for w, _ in times)
        cpu = statistics.median(c for _, c in times)
        pred_wall = program_seconds(cost, out["wall"])
        pred_cpu = program_seconds(cost, out["cpu"])
        rows.append(dict(
            row=row, program=name, calls_per_step=count / steps, gflop=cost.flops / 1e9,
            gbytes=cost.bytes / 1e9, launches=cost.launches, fresh_pages=cost.pages,
            predicted_cpu_s=pred_cpu, measured_cpu_s=cpu, ratio_cpu=pred_cpu / cpu,
            predicted_wall_s=pred_wall, measured_wall_s=wall, ratio_wall=pred_wall / wall,
        ))  # fmt: skip
    return rows


def run(steps: int) -> tuple[list[dict], list[dict]]:
    import multiprocessing

    from bench.rl import PROXY_SYNC_1, PROXY_SYNC_2, Spawned, summarise_proxy_async

    cores = sorted(os.sched_getaffinity(0))[:2]
    phases, programs = [], []
    for mode, use in ((PROXY_SYNC_1, {cores[0]}), (PROXY_SYNC_2, set(cores))):
        out = Spawned(sync_row, mode, steps, cores=use).result()
        pred = predict(out["costs"], steps, out["wall"])
        phases.append(_phase_row(mode.name, out["measured"], pred, out["wall"]))
        _add_cpu(phases[-1], predict(out["costs"], steps, out["cpu"]), out["phase_cpu"])
        programs += program_rows(mode.name, out, steps)
    ctx = multiprocessing.get_context("spawn")
    weights_in, weights_out = ctx.Pipe(duplex=False)
    rollouts_in, rollouts_out = ctx.Pipe(duplex=False)
    trainer = Spawned(async_trainer, steps, weights_out, rollouts_in, cores={cores[0]})
    generator = Spawned(async_generator, steps, weights_in, rollouts_out, cores={cores[1]})
    t_out, g_out = trainer.result(), generator.result()
    measured = summarise_proxy_async(t_out["records"], g_out["records"], warmup=2)
    gen = predict(g_out["costs"], steps, g_out["wall"])
    train = predict(t_out["costs"], steps, t_out["wall"])
    step = StepPrediction(gen["generate_s"], train["train_s"], measured["sync_s"])
    pred = {"generate_s": gen["generate_s"], "train_s": train["train_s"]}
    row = _phase_row(measured["mode"], measured, pred, t_out["wall"])
    cpu_pred = {
        "generate_s": predict(g_out["costs"], steps, g_out["cpu"])["generate_s"],
        "train_s": predict(t_out["costs"], steps, t_out["cpu"])["train_s"],
    }
    _add_cpu(row, cpu_pred, {"generate": g_out["phase_cpu"].get("generate", float("nan")),
                             "train": t_out["phase_cpu"].get("train", float("nan"))})  # fmt: skip
    row["predicted_step_s"] = step.async_step_s
    row["ratio_step"] = row["predicted_step_s"] / row["measured_step_s"]
    row["constants"] += " (trainer's; generator's: " + _constants(g_out["wall"]) + ")"
    phases.append(row)
    name = measured["mode"]
    programs += program_rows(name + ": trainer", t_out, steps)
    programs += program_rows(name + ": generator", g_out, steps)
    return phases, programs


def _add_cpu(row: dict, pred: dict, measured: dict) -> None:
    """The phases in CPU seconds: the model with CPU-second constants against the phase's own
    CPU seconds (the programs and the host work around them: the engine's bookkeeping, the
    sampler's padding, the trainer's batch placement)."""
    for key in ("generate", "train"):
        row[f"cpu_predicted_{key}_s"] = pred[f"{key}_s"]
        row[f"cpu_measured_{key}_s"] = measured.get(key, float("nan"))
        row[f"cpu_ratio_{key}"] = row[f"cpu_predicted_{key}_s"] / row[f"cpu_measured_{key}_s"]


def _constants(m: Machine) -> str:
    return (
        f"{m.peak_flops / 1e9:.0f} GFLOP/s, {m.bandwidth / 1e9:.0f} GB/s, launch "
        f"{m.launch_s * 1e6:.2f} us, call {m.call_s * 1e6:.0f} us, page {m.page_s * 1e6:.2f} us"
    )


def _phase_row(mode, measured, pred, machine) -> dict:
    row = {
        "mode": mode,
        "predicted_generate_s": pred["generate_s"],
        "measured_generate_s": measured["generate_s"],
        "predicted_train_s": pred["train_s"],
        "measured_train_s": measured["train_s"],
        "predicted_step_s": pred["generate_s"] + pred["train_s"],
        "measured_step_s": measured["step_s"],
        "measured_sync_s": measured.get("sync_s", 0.0),
        "constants": _constants(machine),
    }
    for key in ("generate", "train", "step"):
        row[f"ratio_{key}"] = row[f"predicted_{key}_s"] / row[f"measured_{key}_s"]
    return row


PHASE_COLUMNS = [
    ("mode", "CPU proxy row"),
    ("predicted_generate_s", "generate predicted s"),
    ("measured_generate_s", "generate measured s"),
    ("ratio_generate", "ratio"),
    ("predicted_train_s", "train predicted s"),
    ("measured_train_s", "train measured s"),
    ("ratio_train", "ratio"),
    ("predicted_step_s", "step predicted s"),
    ("measured_step_s", "step measured s"),
    ("ratio_step", "ratio"),
    ("cpu_predicted_generate_s", "generate CPU s predicted"),
    ("cpu_measured_generate_s", "generate CPU s measured"),
    ("cpu_ratio_generate", "ratio"),
    ("cpu_predicted_train_s", "train CPU s predicted"),
    ("cpu_measured_train_s", "train CPU s measured"),
    ("cpu_ratio_train", "ratio"),
    ("constants", "constants (wall medians, same process)"),
]
PROGRAM_COLUMNS = [
    ("row", "row"),
    ("program", "program"),
    ("calls_per_step", "calls / step"),
    ("gflop", "GFLOP (dots)"),
    ("gbytes", "GB moved"),
    ("launches", "kernels"),
    ("fresh_pages", "fresh pages"),
    ("predicted_cpu_s", "CPU s predicted"),
    ("measured_cpu_s", "CPU s measured"),
    ("ratio_cpu", "ratio"),
    ("predicted_wall_s", "wall s predicted"),
    ("measured_wall_s", "wall s measured"),
    ("ratio_wall", "ratio"),
]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16, help="RL steps per row")
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    start = time.strftime("%H:%M", time.gmtime())
    phases, programs = run(args.steps)
    load_after = os.getloadavg()
    for row in phases + programs:
        print(json.dumps(row))
    from bench.common import write_results

    note = (
        f"`python -m bench.scale_validate --steps {args.steps}` {start}-"
        f"{time.strftime('%H:%M', time.gmtime())} UTC, load average (1/5/15 min) "
        f"{'/'.join(f'{x:.1f}' for x in load_before)} -> "
        f"{'/'.join(f'{x:.1f}' for x in load_after)}, 2 CPU cores"
    )
    print(write_results("scale_validate", phases, PHASE_COLUMNS, note))
    print(write_results("scale_validate_programs", programs, PROGRAM_COLUMNS, note))
    return phases, programs


if __name__ == "__main__":
    main(sys.argv[1:])

"""The speed-up model (`bench.scale`) against this machine's `bench.rl` CPU-proxy rows, measured
side by side in one run.

Each row runs in its own pinned process (as `bench.rl` runs it: `run_mode` / the proxy's trainer
and generator loops, unchanged). In that process:

* the machine's constants come from microbenchmarks that are not the workload (`calibrate`): a
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

Predicted per step: Tg = sum of the generator's calls' t(program), Tt = t(train step); measured:
`bench.rl`'s medians (generate, train, step). The async row's weight push Ts is measured, not
modelled. Host work outside the programs (prompt building, collation, reward) is not modelled.

    python -m bench.scale_validate            # ~5 minutes on 2 cores
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
        import numpy as np

        block = self.jax.block_until_ready
        t = {}
        start = time.perf_counter()
        block(self.matmul(self.a, self.a))
        t["peak_flops"] = 2 * 1024**3 / (time.perf_counter() - start)
        start = time.perf_counter()
        self.stream["x"] = block(self.scale(self.stream["x"]))
        t["bandwidth"] = 2 * self.stream["x"].nbytes / (time.perf_counter() - start)
        start = time.perf_counter()
        block(self.chain(self.small, self.small))
        t["launch_s"] = (time.perf_counter() - start) / self.chain_kernels
        calls = []
        for _ in range(20):
            start = time.perf_counter()
            np.asarray(self.empty(self.small))
            calls.append(time.perf_counter() - start)
        t["call_s"] = statistics.median(calls)
        one = np.float32(1.0)
        start = time.perf_counter()
        out = block(self.fresh(one))
        t["page_s"] = (time.perf_counter() - start) / (self.fresh_n * 4 // 4096)
        del out
        self.rounds.append(t)

    def machine(self) -> Machine:
        return Machine(**{k: statistics.median(r[k] for r in self.rounds) for k in self.rounds[0]})


# --- recording the workload's program calls ---------------------------------------------------


class Recorder:
    """Counts calls per (program, argument shapes); lowers each new one when first called (in
    the caller's mesh context), compiles them all in `costs()` after the run."""

    def __init__(self):
        self.calls: dict = {}

    def wrap(self, name: str, fn, default_trips=lambda kwargs: 1):
        import jax

        def call(*args, **kwargs):
            leaves, tree = jax.tree.flatten((args, kwargs))
            key = (name, str(tree), tuple(
                (getattr(x, "shape", None), str(getattr(x, "dtype", repr(x)))) for x in leaves
            ))  # fmt: skip
            if key not in self.calls:
                self.calls[key] = [fn.lower(*args, **kwargs), 0, default_trips(kwargs)]
            self.calls[key][1] += 1
            return fn(*args, **kwargs)

        call.lower = fn.lower
        return call

    def costs(self) -> list[tuple[str, int, ProgramCost]]:
        from bench.hlo_cost import kernels

        out = []
        for (name, *_), (lowered, count, trips) in self.calls.items():
            compiled = lowered.compile()
            memory = compiled.memory_analysis()
            pages = fresh_pages(
                memory.temp_size_in_bytes,
                memory.output_size_in_bytes - memory.alias_size_in_bytes,
            )
            ks = kernels(compiled.as_text(), trips)
            cost = ProgramCost(tuple((k.flops, k.bytes, k.count) for k in ks), pages)
            out.append((name, count, cost))
        return out


@contextlib.contextmanager
def recording(recorder: Recorder):
    """Wraps the jitted programs of every Trainer, Engine and Sampler built inside."""
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
    try:
        yield recorder
    finally:
        for cls, init in saved:
            cls.__init__ = init


def predict(costs, steps: int, machine: Machine) -> dict:
    """Per-step seconds of the recorded calls, split into generate and train."""
    gen = train = 0.0
    detail = {}
    for name, count, cost in costs:
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
    machine = calibration.machine()
    costs = recorder.costs()
    return {"measured": measured, "machine": machine, "costs": costs, "steps": steps}


def _calibrated(fn, *args):
    calibration = Calibration()
    for _ in range(ROUNDS_ASYNC):
        calibration.round()
    recorder = Recorder()
    with recording(recorder):
        records = fn(*args)
    for _ in range(ROUNDS_ASYNC):
        calibration.round()
    return records, calibration.machine(), recorder.costs()


def async_trainer(steps, weights_out, rollouts_in):
    from bench.rl import proxy_trainer

    return _calibrated(proxy_trainer, steps, False, weights_out, rollouts_in)


def async_generator(steps, weights_in, rollouts_out):
    from bench.rl import proxy_generator

    return _calibrated(proxy_generator, steps, False, weights_in, rollouts_out)


def run(steps: int) -> list[dict]:
    import multiprocessing

    from bench.rl import PROXY_SYNC_1, PROXY_SYNC_2, Spawned, summarise_proxy_async

    cores = sorted(os.sched_getaffinity(0))[:2]
    rows = []
    for mode, use in ((PROXY_SYNC_1, {cores[0]}), (PROXY_SYNC_2, set(cores))):
        out = Spawned(sync_row, mode, steps, cores=use).result()
        pred = predict(out["costs"], steps, out["machine"])
        rows.append(_row(mode.name, out["measured"], pred, out["machine"], out["costs"], steps))
    ctx = multiprocessing.get_context("spawn")
    weights_in, weights_out = ctx.Pipe(duplex=False)
    rollouts_in, rollouts_out = ctx.Pipe(duplex=False)
    trainer = Spawned(async_trainer, steps, weights_out, rollouts_in, cores={cores[0]})
    generator = Spawned(async_generator, steps, weights_in, rollouts_out, cores={cores[1]})
    (t_records, t_machine, t_costs), (g_records, g_machine, g_costs) = (
        trainer.result(),
        generator.result(),
    )
    measured = summarise_proxy_async(t_records, g_records, warmup=2)
    gen = predict(g_costs, steps, g_machine)
    train = predict(t_costs, steps, t_machine)
    pred = StepPrediction(gen["generate_s"], train["train_s"], measured["sync_s"])
    row = _row(
        measured["mode"],
        measured,
        {"generate_s": gen["generate_s"], "train_s": train["train_s"],
         "programs": gen["programs"] | train["programs"]},
        t_machine,
        t_costs + g_costs,
        steps,
    )  # fmt: skip
    row["predicted_step_s"] = pred.async_step_s
    row["machine_generator"] = _machine_dict(g_machine)
    rows.append(row)
    return rows


def _machine_dict(m: Machine) -> dict:
    return {
        "peak_GFLOPs": m.peak_flops / 1e9,
        "bandwidth_GBs": m.bandwidth / 1e9,
        "launch_us": m.launch_s * 1e6,
        "call_us": m.call_s * 1e6,
        "page_us": m.page_s * 1e6,
    }


def _row(mode, measured, pred, machine, costs, steps) -> dict:
    per_step = {}
    for name, count, cost in costs:
        p = per_step.setdefault(name, [0, 0.0, 0.0, 0, 0])
        p[0] += count / steps
        p[1] += cost.flops * count / steps
        p[2] += cost.bytes * count / steps
        p[3] += cost.launches * count / steps
        p[4] += cost.pages * count / steps
    return {
        "mode": mode,
        "predicted_generate_s": pred["generate_s"],
        "measured_generate_s": measured["generate_s"],
        "predicted_train_s": pred["train_s"],
        "measured_train_s": measured["train_s"],
        "predicted_step_s": pred["generate_s"] + pred["train_s"],
        "measured_step_s": measured["step_s"],
        "measured_sync_s": measured.get("sync_s", 0.0),
        "predicted_programs_s": pred["programs"],
        "machine": _machine_dict(machine),
        "per_step": {
            k: dict(calls=v[0], flops=v[1], bytes=v[2], launches=v[3], pages=v[4])
            for k, v in per_step.items()
        },
    }


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16, help="RL steps per row")
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    start = time.strftime("%H:%M", time.gmtime())
    rows = run(args.steps)
    load_after = os.getloadavg()
    for row in rows:
        for key in ("generate", "train", "step"):
            row[f"ratio_{key}"] = row[f"predicted_{key}_s"] / row[f"measured_{key}_s"]
        print(json.dumps(row))
    from bench.common import write_results

    note = (
        f"`python -m bench.scale_validate --steps {args.steps}` {start}-"
        f"{time.strftime('%H:%M', time.gmtime())} UTC, load average (1/5/15 min) "
        f"{'/'.join(f'{x:.1f}' for x in load_before)} -> "
        f"{'/'.join(f'{x:.1f}' for x in load_after)}"
    )
    flat = []
    for row in rows:
        m = row["machine"]
        flat.append(
            {
                **{k: v for k, v in row.items() if not isinstance(v, dict)},
                "constants": f"{m['peak_GFLOPs']:.0f} GFLOP/s, {m['bandwidth_GBs']:.0f} GB/s, "
                f"launch {m['launch_us']:.2f} us, call {m['call_us']:.0f} us, "
                f"page {m['page_us']:.2f} us",
                "detail": row,
            }
        )
    columns = [
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
        ("constants", "constants (medians, same process)"),
    ]
    print(write_results("scale_validate", flat, columns, note))
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])

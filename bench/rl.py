"""Seconds per RL step, sync (colocated) vs async (LlamaRL), with the phase breakdown.

Workload (rlbench-tiny, DESIGN section 6): `jaxrl.models.presets.rlbench_tiny` (Llama 3, vocab
512, hidden 256, intermediate 768, 4 layers, 8 heads, 4 KV heads; random weights), 8 prompts x 4
samples, prompts of 16 tokens, up to 32 new tokens at temperature 1, one AdamW step (AIPO) per RL
step. The reward (fraction of even token ids) is cheap, as a verifiable reward is. Every row runs
in a fresh process.

Two settings:

- "8 fake devices", through the library's own `Controller` (so the async rows include the
  queue, the device-to-device weight pushes and the thread hand-offs): sync = colocated on all 8
  devices (trainer FSDP 4 x TP 2); async = trainer FSDP 2 x TP 2 on devices 0-3, generator 2
  replicas x TP 2 on devices 4-7, fixed lag 1 (and free-running). The 8 devices share the
  machine's cores, so the two executors cannot both run at full speed: this measures the
  machinery more than a speed-up.
- "CPU proxy" (a proxy, labelled so): each executor is a process pinned to its own core
  (`os.sched_setaffinity`, as `taskset -c`), one CPU device each. XLA:CPU cannot be made
  single-threaded in-process here (`--xla_cpu_multi_thread_eigen=false` still ran one matmul on
  both cores), so the executors are split by process: sync = one process on 1 core (its phase
  times are what each async executor gets: they give the LlamaRL bound) and on 2 cores (the same
  hardware as async); async = trainer process on core 0 and generator process on core 1, fixed
  lag 1, the weights sent host to host through a pipe after every step (the proxy's stand-in for
  the device-to-device push; counted as sync time). The two processes are the library's role
  split over pipes (`bench.pipes`): `Controller.run` over a pipe-backed `RemoteFeed` and
  `roles.serve_batches`.

Per row: medians over the steps after warm-up (compiles) of the step time and each phase
(generate, reward, train, weight sync), the trainer's idle fraction (waiting for rollouts), the
generator's idle fraction, the overlap of generation and training as a fraction of wall time,
the mean consumed staleness, and the speed-up over the setting's sync baseline next to the
LlamaRL bound (Tg + Tt) / max(Tg, Tt), Tg = generate + reward and Tt = train measured in that
baseline. For async rows, `max(Tg, Tt + sync)` from the row's own phase times is the step a
perfect pipeline would take: a step time close to it means generation is hidden behind training
and any gap to the bound comes from the phases themselves running slower side by side (shared
cores, memory bandwidth). This machine is shared: numbers swing between runs (the note records
the load average); ratios come from one run.

    python -m bench.rl            # both settings, ~4 minutes on 2 cores
    python -m bench.rl --smoke    # 1-layer model, 4 steps, 2 rows a setting (a test runs it)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import statistics
import sys
import traceback

from jaxrl.infra.xla_cpu import cpu_xla_flags

FAKE8 = "8 fake devices"
PROXY = "CPU proxy: 1 core per executor (pinned processes)"
PROMPT_LEN, NUM_PROMPTS, SAMPLES = 16, 8, 4


@dataclasses.dataclass(frozen=True)
class Mode:
    name: str
    trainer: tuple  # (axis_sizes, first_device) on ("fsdp", "tp")
    generator: tuple | None = None  # (axis_sizes, first_device) on ("dp", "tp"); None: colocated
    schedule: str = "fixed_lag"
    baseline: bool = False  # the sync row the setting's speed-ups are measured against


FAKE8_MODES = [
    Mode("sync (colocated, 8 dev)", ((4, 2), 0), baseline=True),
    Mode("async fixed lag 1 (4 + 4 dev)", ((2, 2), 0), ((2, 2), 4)),
    Mode("async free-running (4 + 4 dev)", ((2, 2), 0), ((2, 2), 4), "free_running"),
]
PROXY_SYNC_1 = Mode("sync (1 process, 1 core)", ((1, 1), 0), baseline=True)
PROXY_SYNC_2 = Mode("sync (1 process, 2 cores)", ((1, 1), 0))
PROXY_ASYNC = "async fixed lag 1 (2 processes, 1 core each)"


# --- the workload ------------------------------------------------------------------------------


class IdTokenizer:
    """Prompts and completions as space-separated token ids (the workload is token-level)."""

    pad_token_id = 0

    def encode(self, text, add_special_tokens=True):
        return [int(t) for t in text.split()]

    def batch_decode(self, ids, skip_special_tokens=False):
        return [" ".join(map(str, row)) for row in ids]


class RandomPrompts:
    """Item i: 16 token ids drawn from a generator seeded by i."""

    reward_name = "even_ids"

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def item(self, index: int):
        import numpy as np

        from jaxrl.tasks.source import PromptItem

        ids = np.random.default_rng(index).integers(3, self.vocab_size, PROMPT_LEN)
        return PromptItem(" ".join(map(str, ids)), None)

    def eval_items(self, limit: int):
        return []


def even_ids(prompts, completions, references):
    return [sum(int(t) % 2 == 0 for t in c.split()) / max(len(c.split()), 1) for c in completions]


def _model_config(smoke: bool):
    from jaxrl.models.presets import rlbench_tiny

    return rlbench_tiny(
        **(dict(hidden_size=32, intermediate_size=64, num_layers=1) if smoke else {})
    )


def _rl_config(mode: Mode, steps: int, smoke: bool):
    from jaxrl.loop.config import RLConfig

    return RLConfig(
        mode="sync" if mode.generator is None else "async",
        schedule=mode.schedule,
        lag=1,
        max_staleness=2,
        queue_size=2,
        total_steps=steps,
        num_prompts=NUM_PROMPTS,
        samples_per_prompt=SAMPLES,
        max_new_tokens=4 if smoke else 32,
        eval_size=0,
        save_every_steps=10**6,
        log_every_steps=10**6,
    )


def _trainer(sizes_first: tuple, steps: int, smoke: bool):
    from jaxrl.infra.mesh import MeshConfig, make_mesh
    from jaxrl.infra.sharding import TRAINER_RULES
    from jaxrl.train.trainer import OptimizerConfig, Trainer

    sizes, first = sizes_first
    mesh = make_mesh(MeshConfig(("fsdp", "tp"), sizes, first, sizes[0] * sizes[1]))
    optimizer = OptimizerConfig(learning_rate=1e-5).make(steps)
    return Trainer(_model_config(smoke), mesh, TRAINER_RULES, optimizer)


# --- rows through the library's Controller -----------------------------------------------------


class MemoryIO:
    """What the Controller needs of `RunIO`, pared down for timing: metrics kept in memory, no
    checkpoints, no TensorBoard (tensorboardX imports torch: seconds per process)."""

    def __init__(self):
        self.records: list[dict] = []

    def start(self, step: int) -> None:
        pass

    def save_due(self, step: int, force: bool = False) -> bool:
        return False

    def log(self, step: int, metrics: dict, headline: dict) -> None:
        self.records.append({"step": step} | metrics)

    def save(self, state, extra: dict, *, force: bool = False) -> None:
        pass

    def after_step(self, step: int) -> None:
        pass


def run_mode(mode: Mode, steps: int, smoke: bool) -> dict:
    """`steps` RL steps of `mode` through the Controller, summarised."""
    from jaxrl.generation.executor import GeneratorExecutor
    from jaxrl.generation.placement import (
        colocated_sampler,
        generator_param_shardings,
        mesh_sampler,
    )
    from jaxrl.infra.mesh import MeshConfig, make_mesh
    from jaxrl.infra.sharding import GENERATOR_RULES
    from jaxrl.loop.config import sampling_config
    from jaxrl.loop.controller import Controller
    from jaxrl.loop.reward import RewardExecutor
    from jaxrl.sync.in_process import WeightSync
    from jaxrl.sync.store import GeneratorWeights

    trainer = _trainer(mode.trainer, steps, smoke)
    tokenizer = IdTokenizer()
    weights = None
    if mode.generator is None:
        sampler = colocated_sampler(trainer, tokenizer)
    else:
        sizes, first = mode.generator
        gen_mesh = make_mesh(MeshConfig(("dp", "tp"), sizes, first, sizes[0] * sizes[1]))
        sampler = mesh_sampler(trainer, tokenizer, gen_mesh, GENERATOR_RULES)
        sync = WeightSync(
            trainer.param_shardings, generator_param_shardings(trainer, gen_mesh, GENERATOR_RULES)
        )
        weights = GeneratorWeights(sync, latest_only=mode.schedule == "free_running")
    rl = _rl_config(mode, steps, smoke)
    io = MemoryIO()
    controller = Controller(
        rl,
        trainer,
        GeneratorExecutor(sampler, sampling_config(rl), SAMPLES, seed=0),
        RewardExecutor(even_ids, tokenizer),
        RandomPrompts(trainer.model_config.vocab_size),
        tokenizer,
        io,
        reward=even_ids,
        weights=weights,
    )
    controller.run(trainer.init(trainer.init_params(0)))
    return summarise(mode, [r for r in io.records if r["step"]], warmup=1 if smoke else 2)


def summarise(mode: Mode, records: list[dict], warmup: int) -> dict:
    """Medians over the steps after `warmup` and before the last (where the pipeline drains)."""
    window = records[warmup:-1] or records[-1:]

    def median(key):
        return statistics.median(r.get(key, 0.0) for r in window)

    total = sum(r["time/step_s"] for r in window)
    overlap = sum(r.get("async/overlap_fraction_step", 0.0) * r["time/step_s"] for r in window)
    return {
        "mode": mode.name,
        "baseline": mode.baseline,
        "steps_measured": len(window),
        "step_s": median("time/step_s"),
        "generate_s": median("time/generate_s"),
        "reward_s": median("time/reward_s"),
        "train_s": median("time/train_s"),
        "sync_s": median("time/sync_s"),
        "trainer_idle_frac": sum(r.get("time/trainer_idle_s", 0.0) for r in window) / total,
        "generator_idle_frac": sum(r.get("time/generator_idle_s", 0.0) for r in window) / total,
        "overlap_frac": overlap / total,
        "staleness_mean": statistics.mean(r.get("async/staleness", 0.0) for r in window),
        "dropped_samples": window[-1].get("async/dropped_samples", 0.0),
    }


def fake8_rows(steps: int, smoke: bool) -> list[dict]:
    modes = FAKE8_MODES[:2] if smoke else FAKE8_MODES
    return [run_mode(mode, steps, smoke) for mode in modes]


# --- the CPU proxy's async row: two pinned processes ------------------------------------------


def _proxy_controller(steps: int, smoke: bool, trainer, weights, feed=None):
    """A `Controller` of the proxy's async row (fixed lag 1) in one of its two processes."""
    from jaxrl.generation.executor import GeneratorExecutor
    from jaxrl.generation.sampler import Sampler
    from jaxrl.loop.config import sampling_config
    from jaxrl.loop.controller import Controller
    from jaxrl.loop.reward import RewardExecutor

    rl = dataclasses.replace(_rl_config(PROXY_SYNC_1, steps, smoke), mode="async")
    config = trainer.model_config
    sampler = Sampler(trainer.graphdef, config, pad_id=0, eos_ids=config.eos_token_ids)
    tokenizer = IdTokenizer()
    return Controller(
        rl,
        trainer,
        GeneratorExecutor(sampler, sampling_config(rl), SAMPLES, seed=0),
        RewardExecutor(even_ids, tokenizer),
        RandomPrompts(config.vocab_size),
        tokenizer,
        MemoryIO(),
        reward=even_ids,
        weights=weights,
        feed=feed,
    )


def proxy_trainer(steps: int, smoke: bool, control, rollouts, weights) -> list[dict]:
    """The trainer process: the library's loop over a `PipeFeed` (step k trains batch k, then
    sends its weights, version k + 1)."""
    from bench.pipes import PipeFeed, PipeWeights, TrainerChannel

    trainer = _trainer(((1, 1), 0), steps, smoke)
    channel = TrainerChannel(control, rollouts)
    ctl = _proxy_controller(
        steps, smoke, trainer, PipeWeights(weights), lambda ctl: PipeFeed(ctl, channel)
    )
    ctl.run(trainer.init(trainer.init_params(0)))
    records = [r for r in ctl.io.records if r["step"]]
    return [
        dict(
            step_s=r["time/step_s"],
            idle_s=r["time/trainer_idle_s"],
            train_s=r["time/train_s"],
            sync_s=r["time/sync_s"],
            train=span,
        )
        for r, span in zip(records, ctl.feed.train_spans, strict=True)
    ]


def proxy_generator(steps: int, smoke: bool, control, rollouts, weights) -> list[dict]:
    """The generator process: the library's generator side (`roles.serve_batches`); batch k is
    sampled by version max(k - 1, 0) (fixed lag 1)."""
    from bench.pipes import GeneratorChannel, PipeSync, Spans
    from jaxrl.loop.roles import serve_batches
    from jaxrl.sync.store import GeneratorWeights

    trainer = _trainer(((1, 1), 0), steps, smoke)
    store = GeneratorWeights(PipeSync(weights), latest_only=False)
    ctl = _proxy_controller(steps, smoke, trainer, store)
    channel, busy = GeneratorChannel(control, rollouts), Spans()
    serve_batches(ctl, channel, lead=True, timeline=busy)
    return [sent | {"busy": span} for sent, span in zip(channel.sent, busy.spans, strict=True)]


def summarise_proxy_async(trainer: list[dict], generator: list[dict], warmup: int) -> dict:
    window = range(warmup, len(trainer) - 1) or range(len(trainer) - 1, len(trainer))
    start = trainer[window[0]]["train"][0] - trainer[window[0]]["idle_s"]
    end = start + sum(trainer[k]["step_s"] for k in window)
    busy = [g["busy"] for g in generator]

    def inside(a, b):
        return sum(max(0.0, min(b, e) - max(a, s)) for s, e in busy)

    overlap = sum(inside(*trainer[k]["train"]) for k in window)
    return {
        "mode": PROXY_ASYNC,
        "baseline": False,
        "steps_measured": len(window),
        "step_s": statistics.median(trainer[k]["step_s"] for k in window),
        "generate_s": statistics.median(generator[k]["generate_s"] for k in window),
        "reward_s": statistics.median(generator[k]["reward_s"] for k in window),
        "train_s": statistics.median(trainer[k]["train_s"] for k in window),
        "sync_s": statistics.median(trainer[k]["sync_s"] for k in window),
        "trainer_idle_frac": sum(trainer[k]["idle_s"] for k in window) / (end - start),
        "generator_idle_frac": 1.0 - inside(start, end) / (end - start),
        "overlap_frac": overlap / (end - start),
        "staleness_mean": 1.0,  # batch k >= 1 is sampled by version k - 1, trained at version k
        "dropped_samples": 0.0,
    }


# --- processes -----------------------------------------------------------------------------------


def smoke_xla_flags() -> str:
    """The flags a smoke run's processes keep from this one's XLA_FLAGS: LLVM's optimisation
    level for XLA:CPU's machine code (the tests set 0: their tiny programs spend more time
    compiling than running). A smoke run checks the plumbing, not the speed; a full run's
    processes start from no flags."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    return " ".join(f for f in flags if f.startswith("--xla_backend_optimization_level="))


def _child(fn, args, devices: int, cores, result, flags: str = "") -> None:
    """A fresh process: its device count, XLA flags and cores set before JAX starts (a smoke
    run's process has imported JAX, not started it)."""
    os.environ["XLA_FLAGS"] = cpu_xla_flags(flags, devices=devices)
    os.environ["JAX_PLATFORMS"] = "cpu"
    if "jax" in sys.modules:  # read at import: the forkserver's imports came first
        sys.modules["jax"].config.update("jax_platforms", "cpu")
    if cores is not None:
        os.sched_setaffinity(0, cores)
    try:
        result.send(("ok", fn(*args)))
    except BaseException:
        result.send(("error", traceback.format_exc()))


# What a smoke run's processes have imported when they start (`processes(smoke=True)`).
SMOKE_PRELOAD = [
    "bench.rl",
    "bench.pipes",
    "bench.rl_streaming_pinned",
    "flax.nnx",
    "optax",
    "jaxrl.loop.controller",
    "jaxrl.generation.executor",
    "jaxrl.train.trainer",
    "launch.rl",
]


def processes(smoke: bool):
    """The multiprocessing context of the rows' processes: a full run's each start a fresh
    interpreter ("spawn"); a smoke run's are forked from a server process that imported
    `SMOKE_PRELOAD` (JAX, the library) once, without starting JAX ("forkserver"), instead of
    each importing them (seconds a process)."""
    if not smoke:
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(SMOKE_PRELOAD)  # read when the server starts (the first process)
    return ctx


class Spawned:
    def __init__(self, fn, *args, devices: int = 1, cores=None, smoke=False):
        """`fn(*args)` in a process of `processes(smoke)`, with `devices` simulated devices on
        `cores`; a smoke run's keeps this process's LLVM optimisation level (`smoke_xla_flags`)."""
        ctx = processes(smoke)
        flags = smoke_xla_flags() if smoke else ""
        self._result, send = ctx.Pipe(duplex=False)
        self.name = fn.__name__
        self.process = ctx.Process(target=_child, args=(fn, args, devices, cores, send, flags))
        self.process.start()

    def result(self):
        if not hasattr(self, "_value"):
            status, self._value = self._result.recv()
            self.process.join()
            if status != "ok":
                raise SystemExit(f"bench.rl: {self.name} failed in its process:\n{self._value}")
        return self._value


def proxy_rows(steps: int, smoke: bool, cores: list[int]) -> list[dict]:
    """Sync on 1 and 2 cores, then async; the smoke run skips the 2-core row and starts the
    async processes as soon as the 1-core row is done, beside the 8-device rows (it checks the
    plumbing, not the timing): they load the programs the sync row compiled (the train step, its
    initialisation) from the persistent XLA cache when one is set, as the tests set it."""
    sync_runs = [Spawned(run_mode, PROXY_SYNC_1, steps, smoke, cores={cores[0]}, smoke=smoke)]
    sync_runs[0].result()  # smoke: the async processes load its programs from the XLA cache
    if not smoke:
        sync_runs.append(Spawned(run_mode, PROXY_SYNC_2, steps, smoke, cores=set(cores[:2])))
        sync_runs[1].result()
    ctx = processes(smoke)
    control_in, control_out = ctx.Pipe(duplex=False)
    rollouts_in, rollouts_out = ctx.Pipe(duplex=False)
    weights_in, weights_out = ctx.Pipe(duplex=False)
    trainer = Spawned(
        proxy_trainer, steps, smoke, control_out, rollouts_in, weights_out, cores={cores[0]},
        smoke=smoke,
    )  # fmt: skip
    generator = Spawned(
        proxy_generator, steps, smoke, control_in, rollouts_out, weights_in, cores={cores[1]},
        smoke=smoke,
    )  # fmt: skip
    records = trainer.result(), generator.result()
    return [r.result() for r in sync_runs] + [
        summarise_proxy_async(*records, warmup=1 if smoke else 2)
    ]


def add_ratios(rows: list[dict]) -> None:
    """Speed-up over the setting's sync baseline, next to the LlamaRL bound from its phases."""
    base = next(r for r in rows if r["baseline"])
    t_gen = base["generate_s"] + base["reward_s"]
    t_train = base["train_s"]
    bound = (t_gen + t_train) / max(t_gen, t_train)
    for row in rows:
        row["speedup"] = base["step_s"] / row["step_s"]
        row["bound_inputs"] = f"Tg={t_gen:.3f}s Tt={t_train:.3f}s"
        if row["mode"].startswith("async"):
            row["bound"] = bound
            # The step a perfect pipeline would reach with this row's own (contended) phases.
            generating = row["generate_s"] + row["reward_s"]
            row["pipelined_s"] = max(generating, row["train_s"] + row["sync_s"])


COLUMNS = [
    ("setting", "setting"),
    ("mode", "mode"),
    ("step_s", "s/step"),
    ("generate_s", "generate s"),
    ("reward_s", "reward s"),
    ("train_s", "train s"),
    ("sync_s", "sync s"),
    ("trainer_idle_frac", "trainer idle"),
    ("generator_idle_frac", "generator idle"),
    ("overlap_frac", "overlap"),
    ("staleness_mean", "staleness"),
    ("pipelined_s", "max(Tg, Tt + sync)"),
    ("speedup", "speed-up vs sync"),
    ("bound", "LlamaRL bound"),
]


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--steps", type=int, default=0, help="RL steps per row")
    args = parser.parse_args(argv)
    steps = args.steps or (4 if args.smoke else 24)
    command = "python -m bench.rl" + "".join(f" {a}" for a in (argv or []))
    command = os.environ.get("JAXRL_BENCH_COMMAND") or command  # `python -m bench`
    cores = sorted(os.sched_getaffinity(0))
    load_before = os.getloadavg()[0]
    # The full run measures one row at a time (rows would compete for the cores); the smoke run
    # only checks the plumbing, so its two settings run side by side.
    fake8 = Spawned(fake8_rows, steps, args.smoke, devices=8, smoke=args.smoke)
    if not args.smoke:
        fake8.result()
    proxy = proxy_rows(steps, args.smoke, cores) if len(cores) >= 2 else []
    settings = {FAKE8: fake8.result(), PROXY: proxy}
    rows = []
    for setting, setting_rows in settings.items():
        if setting_rows:
            add_ratios(setting_rows)
        for row in setting_rows:
            row |= {"setting": setting, "command": command}
            print(json.dumps(row))
        rows += setting_rows

    from bench.common import write_results

    workload = "rlbench-tiny shrunk to 1 layer, 4 new tokens" if args.smoke else "rlbench-tiny"
    load = f"load average {load_before:.1f} -> {os.getloadavg()[0]:.1f}"  # others on the machine
    note = f"`{command}` on {len(cores)} CPU cores ({load}), {workload}, {steps} steps per row"
    print(write_results("rl_smoke" if args.smoke else "rl", rows, COLUMNS, note))
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])

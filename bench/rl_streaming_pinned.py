"""The pinned one-core-per-role CPU proxy of `bench.rl_streaming` (`--settings pinned`).

A proxy, labelled so, as `bench.rl`'s "CPU proxy": each role is its own process pinned to one
core (`os.sched_setaffinity`) with one CPU device, since XLA:CPU cannot pin one process's threads
per role and a role-split job (`jaxrl.loop.roles`) runs fixed lag only. The library's pieces run
unchanged in each process: the trainer's loop (`Controller.run`, over `PipeFeed`), the engine
and the generator threads' own loops (`feeds.lagged.BatchProducer` for fixed lag,
`feeds.streaming.StreamProducer` for streaming), the reward executor, `GroupQueue` (staleness
bound on a group's oldest token, drops counted), `token_staleness_metrics`, `Trainer.rl_step`
(AIPO). Only the in-process queue and the device-to-device weight push are replaced, by two
pipes:

- weights (trainer -> generator): `("weights", version, host params, push time, removed)` after
  each step and `("removed", n)` right after each take, `removed` the cumulative count of queue
  items (groups or batches) the trainer took or dropped, from which the generator applies the
  queue's bounds (fixed lag: `put` waits on a full queue; streaming: `issue` waits); then
  `("stop",)`. `_PipeWeights` is `GeneratorWeights`' interface over it: `newest` polls the pipe
  without blocking (the engine's `update` hook between decode calls), `acquire` blocks.
- rollouts (generator -> trainer): each scored group (streaming) or batch (fixed lag) as it is
  done (`_PipeQueue.put`); the trainer's receiver thread admits groups into its `GroupQueue`.

Rows: sync (one process on core 0: `Controller.run`, colocated: generate, score, train in turn);
fixed lag 1 (trainer on core 0, generator on core 1, batch k sampled whole by version k - 1);
streaming keep (the engine never drains; the trainer takes the next `num_prompts` groups to
finish). Times are `time.perf_counter` (CLOCK_MONOTONIC, one clock for all processes on Linux),
so the generator's idle intervals are cut to the trainer's measured window.
"""

from __future__ import annotations

import os
import queue as queue_lib
import statistics
import threading
import time

from bench.rl import MemoryIO, Spawned, processes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOKE_PARAMS = [  # random weights, a small batch: checks the plumbing, not the timing
    "RLConfig.num_prompts = 4",
    "RLConfig.samples_per_prompt = 4",
    "RLConfig.max_new_tokens = 8",
    "RLConfig.oversample = 2",  # still left-out groups (random weights: one reward), half the work
]


def build(spec: dict, schedule: str, with_state: bool):
    """(controller, train state or None) of `spec`'s config on this process's one device.

    `schedule`: "sync" (colocated), "fixed_lag" or "streaming" (the generator side gets a
    `_PipeWeights` later: `controller.weights`). The engine has one slot per sample of a step's
    groups (num_prompts x samples_per_prompt), as launch.rl's streaming default, and with
    `spec["precompile"]` compiles all its programs before its first batch (`Engine.precompile`,
    as the config's `GeneratorConfig.precompile`)."""
    import dataclasses

    from flax import nnx

    from jaxrl.generation.executor import GeneratorExecutor
    from jaxrl.generation.placement import colocated_sampler
    from jaxrl.infra.config import parse_gin, resolve_bindings
    from jaxrl.infra.mesh import MeshConfig, make_mesh
    from jaxrl.infra.sharding import TRAINER_RULES
    from jaxrl.job import workdir as run_dir
    from jaxrl.job.specs import build_model_config, build_source, build_tokenizer, reward_name
    from jaxrl.loop.config import sampling_config
    from jaxrl.loop.controller import Controller
    from jaxrl.loop.reward import RewardExecutor
    from jaxrl.train.trainer import Trainer
    from launch.rl import rl_main

    config, params, sft = spec["config"], spec["params"], spec["sft"]
    if spec.get("cache"):  # the smoke's rows compile the same programs: the first row's serve
        import jax

        jax.config.update("jax_compilation_cache_dir", spec["cache"])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    parse_gin([os.path.join(REPO, config)], params)
    kw = resolve_bindings(rl_main)
    policy, task, rl, optimizer = kw["policy"], kw["task"], kw["rl"], kw["optimizer"]
    rl = dataclasses.replace(
        rl,
        mode="sync" if schedule == "sync" else "async",
        schedule="fixed_lag" if schedule == "sync" else schedule,
        eval_size=0,
    )
    tokenizer = build_tokenizer(policy, task)
    model_config = build_model_config(policy, tokenizer)
    source = build_source(
        task, tokenizer, max_prompt_tokens=model_config.max_position_embeddings - rl.max_new_tokens
    )
    reward = reward_name(task, source)
    mesh = make_mesh(MeshConfig(("fsdp", "tp"), (1, 1), 0, 1))
    trainer = Trainer(
        model_config,
        mesh,
        TRAINER_RULES,
        optimizer.make(rl.total_steps),
        grad_accum_steps=optimizer.grad_accum_steps,
        loss=kw["loss"],
        pack_length=rl.pack_length,
    )
    sampler = colocated_sampler(
        trainer,
        tokenizer,
        num_slots=rl.num_prompts * rl.samples_per_prompt,
        steps_per_call=min(8, rl.max_new_tokens),
        precompile=spec.get("precompile", False),
    )
    ctl = Controller(
        rl,
        trainer,
        GeneratorExecutor(sampler, sampling_config(rl), rl.samples_per_prompt, seed=rl.seed),
        RewardExecutor(reward, tokenizer),
        source,
        tokenizer,
        MemoryIO(),
        reward=reward,
        weights=None if schedule == "sync" else _Unset(),
        learning_rate=optimizer.schedule_fn(rl.total_steps),
    )
    state = None
    if with_state:
        if sft:
            _, restored = run_dir.restore_params(
                sft, model_config, shardings=trainer.base_param_shardings
            )
            state = trainer.init(nnx.to_pure_dict(restored))
        else:
            state = trainer.init(trainer.init_params(0))
    return ctl, state


class _Unset:
    """Placeholder weight store until the process sets `controller.weights`."""


# --- the generator side -------------------------------------------------------------------------


class _Held:
    def __init__(self, version: int, params):
        self.version, self.params = version, params


class _PipeWeights:
    """`GeneratorWeights`' interface over the trainer's weights pipe (see the module docstring);
    the generator's waits on it are recorded in `idle` as (start, end) intervals."""

    def __init__(self, conn):
        self.conn = conn
        self.published_at: dict[int, float] = {}
        self.removed = 0
        self.idle: list[tuple[float, float]] = []
        self._hosts: dict[int, object] = {}
        self._stopped = False

    def drain(self, block: bool) -> None:
        """Reads every waiting message (with `block`, at least one); QueueClosed on stop."""
        from jaxrl.infra.closable import QueueClosed

        while not self._stopped and (block or self.conn.poll()):
            block = False
            message = self.conn.recv()
            if message[0] == "stop":
                self._stopped = True
            elif message[0] == "removed":
                self.removed = max(self.removed, message[1])
            else:
                _, version, host, pushed_at, removed = message
                self._hosts[version] = host
                self.published_at[version] = pushed_at
                self.removed = max(self.removed, removed)
        if self._stopped:
            raise QueueClosed()

    def _take(self, version: int) -> _Held:
        import jax

        for old in [v for v in self._hosts if v < version]:
            del self._hosts[old]
        return _Held(version, jax.device_put(self._hosts[version]))

    def newest(self, after: int) -> _Held | None:
        self.drain(block=False)
        newest = max(self._hosts, default=-1)
        return self._take(newest) if newest > after else None

    def acquire(self, version: int | None, timeout: float | None = None) -> _Held:
        start = time.perf_counter()
        self.drain(block=False)
        while not self._hosts or (version is not None and version not in self._hosts):
            self.drain(block=True)
        if time.perf_counter() - start > 1e-3:
            self.idle.append((start, time.perf_counter()))
        return self._take(version if version is not None else max(self._hosts))

    def close(self, error: BaseException | None = None) -> None:
        self._stopped = True

    def free(self) -> None:
        self._hosts.clear()


class _PipeQueue:
    """The generator's side of the rollout queue, counted from what it sent and what the trainer
    reports removed. Fixed lag (`max_in_flight=None`): `put` sends, waiting (idle, recorded)
    while the trainer holds `capacity` batches it has not removed. Streaming: `issue` follows
    `GroupQueue.issue`'s rule (no prompt while `capacity` groups are held, or held + in flight
    reach `capacity + max_in_flight`), `put` never waits, `filter` is `GroupQueue.filter`'s."""

    def __init__(self, conn, weights: _PipeWeights, capacity: int, max_in_flight=None):
        self.conn, self.weights, self.capacity = conn, weights, capacity
        self.max_in_flight = max_in_flight
        self.sent = self.next_prompt = self.filtered = 0
        self.error: BaseException | None = None

    @property
    def closed(self) -> bool:
        return self.weights._stopped

    def _wait(self, full) -> bool:
        """Reads the pipe until `full()` is False (idle, recorded), or once without blocking;
        True when there is room."""
        start = time.perf_counter()
        self.weights.drain(block=False)
        while full():
            self.weights.drain(block=True)
        if time.perf_counter() - start > 1e-3:
            self.weights.idle.append((start, time.perf_counter()))
        return True

    def issue(self, block: bool = True, timeout: float | None = None) -> int | None:
        def full():
            held = self.sent - self.weights.removed
            in_flight = self.next_prompt - self.sent - self.filtered
            return held >= self.capacity or (held + in_flight >= self.capacity + self.max_in_flight)

        self.weights.drain(block=False)
        if full() and not block:
            return None
        self._wait(full)
        index, self.next_prompt = self.next_prompt, self.next_prompt + 1
        return index

    def put(self, item, timeout: float | None = None) -> bool:
        if self.max_in_flight is None:  # fixed lag: wait for room for the batch
            self._wait(lambda: self.sent - self.weights.removed >= self.capacity)
        self.conn.send(item)
        self.sent += 1
        return True

    def filter(self, group, oversample: int) -> bool:
        from jaxrl.loop.rollout_queue import leave_out

        if not leave_out(group, oversample, self.filtered, self.sent):
            return False
        self.filtered += 1
        return True

    def close(self, error: BaseException | None = None) -> None:
        if error is not None:
            self.error = error
            self.conn.send(("error", f"{type(error).__name__}: {error}"))


def proxy_generator(spec: dict, weights_in, rollouts_out) -> dict:
    """The generator process: the library's generator loop with the pipes for queue and weights."""
    from jaxrl.loop.feeds.lagged import BatchProducer
    from jaxrl.loop.feeds.streaming import StreamProducer

    ctl, _ = build(spec, spec["schedule"], with_state=False)
    ctl.weights = _PipeWeights(weights_in)
    if spec["schedule"] == "streaming":
        from jaxrl.loop.feeds.streaming import groups_in_flight

        capacity = ctl.config.queue_size * ctl.config.num_prompts  # groups, as StreamingFeed
        pipe = _PipeQueue(rollouts_out, ctl.weights, capacity, groups_in_flight(ctl))
        producer = StreamProducer(ctl, pipe)
    else:
        pipe = _PipeQueue(rollouts_out, ctl.weights, ctl.config.queue_size)  # batches
        producer = BatchProducer(ctl, pipe, first_index=0)
    producer.run()  # returns on the trainer's stop (QueueClosed) or after the last batch
    if pipe.error is not None:
        raise pipe.error
    rollouts_out.send(("done",))
    stats = ctl.generator.sampler.engine.stats  # over the whole run, warm-up included
    push_to_use = producer.take_counters().push_to_use_s if hasattr(producer, "engine") else []
    return {
        "push_to_use_s": statistics.mean(push_to_use) if push_to_use else float("nan"),
        "idle": ctl.weights.idle,
        "end": time.perf_counter(),
        "swaps": stats.swaps,
        "utilisation": stats.utilisation,
    }


# --- the trainer side ---------------------------------------------------------------------------


def _sender(conn) -> tuple[queue_lib.Queue, threading.Thread]:
    """Messages to the generator, sent in order by a thread (a 1.6 MB weights message waits in
    the pipe until the generator's next poll; the trainer goes on meanwhile). A generator that
    already finished (fixed lag's last batch) leaves a broken pipe: ignored."""
    outbox: queue_lib.Queue = queue_lib.Queue()

    def run():
        while (message := outbox.get()) is not None:
            try:
                conn.send(message)
            except (BrokenPipeError, ConnectionResetError, EOFError):
                return

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return outbox, thread


def _receiver(conn, groups, errors: list) -> threading.Thread:
    """Admits each group from the generator into the trainer's `GroupQueue` as it arrives."""

    def run():
        while True:
            try:
                item = conn.recv()
            except (EOFError, OSError):
                return
            if isinstance(item, tuple) and item[0] == "done":
                return
            if isinstance(item, tuple) and item[0] == "error":
                errors.append(item[1])
                groups.close(RuntimeError(f"the generator process failed: {item[1]}"))
                return
            groups.admit(item)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


class PipeFeed:
    """The trainer's rollout feed over the two pipes (module docstring), for `Controller.run`:
    fixed lag takes the generator's next batch from the pipe; streaming the next `num_prompts`
    groups of a `GroupQueue` a receiver thread admits them into. After each take it reports the
    queue items removed; after each step it pushes the weights (host copies, sent in order by a
    thread). `ends`: each step's end on `time.perf_counter`."""

    timeline = None  # the generator is another process: its idle time comes from there

    def __init__(self, controller, weights_out, rollouts_in):
        self.config = controller.config
        self.streaming = self.config.schedule == "streaming"
        self.outbox, self.sender = _sender(weights_out)
        self.rollouts_in = rollouts_in
        self.groups = self.receiver = None
        self.errors: list[str] = []
        self.taken = 0
        self.ends: list[float] = []

    def removed(self) -> int:
        stats = self.groups.stats if self.groups is not None else None
        return stats.consumed_batches + stats.dropped_batches if stats else self.taken

    def push(self, version: int, params) -> None:
        import jax
        import numpy as np

        host = jax.tree.map(np.array, params)  # a copy: the next step donates the params
        self.outbox.put(("weights", version, host, time.perf_counter(), self.removed()))

    def start(self, step: int, params, extra: dict | None) -> None:
        from jaxrl.loop.rollout_queue import GroupQueue

        class ForwardedGroups(GroupQueue):
            """A `GroupQueue` fed from another process: each group is issued there."""

            def admit(self, group) -> bool:
                with self._cond:
                    self._in_flight.add(group.batch_index)
                return self.put(group)

        c = self.config
        if self.streaming:
            self.groups = ForwardedGroups(c.queue_size * c.num_prompts, c.max_staleness)
            self.receiver = _receiver(self.rollouts_in, self.groups, self.errors)
        self.push(step, params)

    def take(self, step: int, params):
        import numpy as np

        from jaxrl.loop.feeds.base import Taken
        from jaxrl.loop.feeds.streaming import token_staleness_metrics

        c = self.config
        if self.streaming:
            taken = self.groups.take(c.num_prompts, timeout=c.stall_timeout_s)
            rollouts = [r for g in taken for r in g.rollouts]
            staleness, _ = token_staleness_metrics(rollouts, step)
            metrics = {
                "staleness_mean": staleness["stream/token_staleness_mean"],
                "staleness_max": staleness["stream/token_staleness_max"],
                "mixed_rows": staleness["stream/mixed_version_rows"],
                "dropped": self.groups.stats.dropped_batches,
            }
        else:
            batch = self.rollouts_in.recv()
            if isinstance(batch, tuple):
                raise RuntimeError(f"the generator process failed: {batch[1]}")
            rollouts = batch.rollouts
            lag = float(step - batch.policy_version)
            metrics = {"staleness_mean": lag, "staleness_max": lag, "dropped": 0}
        self.taken += 1
        self.outbox.put(("removed", self.removed()))  # room in the queue: the generator may go on
        metrics["reward/mean"] = float(np.mean([r.reward for r in rollouts]))
        metrics["completion"] = float(np.mean([len(r.completion_ids) for r in rollouts]))
        return Taken(rollouts, metrics)

    def trained(self, step: int, params) -> dict[str, float]:
        start = time.perf_counter()
        if self.streaming:
            self.groups.advance(step)
        # Fixed lag 1: batch step + 1 (the last needing version step) exists; streaming: always.
        if self.streaming or step <= self.config.total_steps - 2:
            self.push(step, params)
        self.ends.append(time.perf_counter())
        sampled = float(self.removed() * self.config.num_prompts)
        return {"time/sync_s": self.ends[-1] - start, "data/prompts_sampled": sampled}

    def snapshot(self, step: int) -> dict:
        return {}  # the bench saves nothing

    def stop(self, failed: bool) -> None:
        self.outbox.put(("stop",))
        self.outbox.put(None)
        self.sender.join(timeout=60)
        if self.receiver is not None:  # until the generator's "done": it may be sending a group
            self.receiver.join(timeout=60)
        if self.errors and not failed:
            raise RuntimeError(f"the generator process failed: {self.errors[0]}")


def proxy_trainer(spec: dict, weights_out, rollouts_in) -> dict:
    """The trainer process: the library's `Controller.run` over a `PipeFeed`. Per step: wall,
    idle (waiting to take), train and push seconds."""
    ctl, state = build(spec, spec["schedule"], with_state=True)
    ctl.feed = feed = PipeFeed(ctl, weights_out, rollouts_in)
    ctl.run(state)
    records = [r for r in ctl.io.records if r["step"]]
    keys = ("staleness_mean", "staleness_max", "mixed_rows", "dropped", "completion")
    return {
        "records": [
            {k: r[k] for k in keys if k in r}
            | dict(end=end, step_s=r["time/step_s"], idle_s=r["time/trainer_idle_s"])
            | dict(train_s=r["time/train_s"], sync_s=r["time/sync_s"])
            for r, end in zip(records, feed.ends, strict=True)
        ]
    }


def proxy_sync(spec: dict) -> dict:
    """One process on one core: the library's `Controller.run` in sync mode (generate, score,
    train)."""
    ctl, state = build(spec, "sync", with_state=True)
    ctl.run(state)
    records = []
    for r in ctl.io.records:
        if r["step"]:
            train = r["time/train_s"]
            records.append(
                dict(step_s=r["time/step_s"], train_s=train, idle_s=r["time/step_s"] - train,
                     sync_s=0.0, staleness_mean=0.0, staleness_max=0.0, dropped=0,
                     completion=r["completion/mean_tokens"] if "completion/mean_tokens" in r
                     else float("nan"))
            )  # fmt: skip
    return {"records": records}


# --- rows ---------------------------------------------------------------------------------------


def _window(records: list[dict], warmup: int) -> list[dict]:
    return records[warmup:] or records[-1:]


def summarise(mode: str, trainer: dict, generator: dict | None, warmup: int) -> dict:
    """Medians and fractions over the steps after `warmup` (compiles)."""
    rows = _window(trainer["records"], warmup)
    wall = sum(r["step_s"] for r in rows)
    step_s = statistics.median(r["step_s"] for r in rows)
    if generator is None:  # sync: one process, the generator idle while it trains
        generator_idle = sum(r["train_s"] for r in rows) / wall
    else:
        start, end = rows[0]["end"] - rows[0]["step_s"], rows[-1]["end"]
        idle = sum(max(0.0, min(end, b) - max(start, a)) for a, b in generator["idle"])
        idle += max(0.0, end - generator["end"])  # fixed lag: done before the trainer
        generator_idle = idle / (end - start)
    before = trainer["records"][warmup - 1]["dropped"] if warmup and len(rows) > 1 else 0
    return {
        "setting": "pinned",
        "mode": mode,
        "step_s": step_s,
        "steps_per_hour": 3600.0 / step_s,
        "trainer_idle": sum(r["idle_s"] for r in rows) / wall,
        "generator_idle": generator_idle,
        "train_s": statistics.median(r["train_s"] for r in rows),
        "sync_s": statistics.median(r["sync_s"] for r in rows),
        "engine_util": generator["utilisation"] if generator and mode.startswith("stream")
        else float("nan"),
        "token_staleness": statistics.mean(r["staleness_mean"] for r in rows),
        "token_staleness_max": max(r["staleness_max"] for r in rows),
        "mixed_rows": statistics.mean(r.get("mixed_rows", 0.0) for r in rows),
        "push_to_use_s": generator["push_to_use_s"] if generator else float("nan"),
        "swaps": generator["swaps"] if generator else 0,
        "dropped_groups": rows[-1]["dropped"] - before,
        "completion_tokens": statistics.mean(r["completion"] for r in rows),
        "measured_steps": len(rows),
    }  # fmt: skip


def start_row(mode: str, spec: dict, cores: list[int]):
    """Starts one row in fresh processes: "sync" on cores[0]; "fixed_lag" / "streaming_keep":
    the trainer on cores[0], the generator on cores[1]. Returns (trainer, generator or None)."""
    smoke = spec.get("smoke", False)
    if mode == "sync":
        return Spawned(proxy_sync, spec, cores={cores[0]}, smoke=smoke), None
    spec = spec | {"schedule": "streaming" if mode.startswith("streaming") else "fixed_lag"}
    ctx = processes(smoke)
    weights_in, weights_out = ctx.Pipe(duplex=False)
    rollouts_in, rollouts_out = ctx.Pipe(duplex=False)
    trainer = Spawned(proxy_trainer, spec, weights_out, rollouts_in, cores={cores[0]}, smoke=smoke)
    generator = Spawned(
        proxy_generator, spec, weights_in, rollouts_out, cores={cores[1]}, smoke=smoke
    )
    return trainer, generator


def finish_row(mode: str, started, warmup: int, load: float) -> dict:
    trainer, generator = started
    row = summarise(mode, trainer.result(), generator and generator.result(), warmup)
    return row | {"load_before": load, "load_after": os.getloadavg()[0]}


def pinned_rows(config, sft, steps, warmup, smoke, modes, cores, extra=()) -> list[dict]:
    """The pinned setting's rows, one after the other (they would compete for the cores). The
    smoke run's rows share a persistent compilation cache (it checks the plumbing, not the
    timing); the full run's engines precompile all their programs before the first batch (in
    the warm-up steps), so no compile stalls a measured step: lazily compiled, each new decode
    or prefill shape stalled the generator 0.7-1.9 s, and the trainer with it, well into the
    measured steps."""
    if len(cores) < 2:
        raise SystemExit(f"the pinned setting needs 2 cores; this process may use {cores}")
    params = (
        [
            "RLConfig.eval_size = 0",
            f"RLConfig.total_steps = {steps}",
            "RLConfig.lag = 1",
            "RLConfig.kv_on_update = 'keep'",
        ]
        + (SMOKE_PARAMS if smoke else [])
        + list(extra)
    )
    spec = {"config": config, "params": params, "sft": None if smoke else sft, "steps": steps,
            "precompile": not smoke}  # fmt: skip
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory(prefix="rl_streaming_cache_") as cache:
        if smoke:  # this process's LLVM optimisation level, processes forked with the imports
            spec |= {"cache": cache, "smoke": True}  # (bench.rl.Spawned)
        for mode in modes:
            load = os.getloadavg()[0]
            rows.append(finish_row(mode, start_row(mode, spec, cores), warmup, load))
    return rows

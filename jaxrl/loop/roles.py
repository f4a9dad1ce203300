"""Role-split async RL across processes: trainer processes and generator processes.

`rl_main.roles = ("trainer", "generator")` gives process i of a `jax.distributed` job the role
`roles[i]`. Trainer processes own the trainer mesh and run only the trainer's programs (train
steps, evaluation, checkpoints); generator processes own the generator mesh and run only the
sampler and the reward. No jitted program spans both roles, so neither waits for the other's
programs (contrast: the "every role on every process" job of `arith_tiny_2proc.gin`, whose two
threads must take turns on the devices). Process 0 must be a trainer: it hosts the coordination
service, writes the metrics and the checkpoints' JSON state.

What crosses between the roles:

- Weights, trainer -> generator: `CrossProcessWeightSync.push` (transport "device_put" over
  JAX's transfer server on CPU, "ppermute" over a union mesh on GPU / TPU), which every process
  must issue for every version in the same order. Under the fixed-lag schedule both sides know
  the versions (`Controller.push_needed`: batch k is sampled by version max(k - lag, 0)), so the
  trainer pushes each one after its optimizer step and a receiver thread on every generator
  process issues the same push into a `GeneratorWeights` double buffer, while the generator's
  main thread samples. The trainer's push returns once the generator holds the version (each
  chunk ends at a coordination-service barrier); it waits longer only when the generator still
  holds two versions, as `GeneratorWeights.publish` does in one process.
- Scored rollouts, generator -> trainer: the coordination service's key-value store
  (`RolloutChannel`; bytes values, zlib-compressed JSON of `ScoredBatch.to_json`, float32
  log-probs exact). The trainer asks for batch k (key `room/k`) only when its `RolloutQueue` has
  room, the generator sends it (key `batch/k`) once asked, and the trainer's fetcher thread puts
  it into the queue, which checks staleness on admission and on consumption exactly as in one
  process. So at most `queue_size` batches wait on the trainer and one more, scored, on the
  generator. A key is deleted once the step that trained on it is done.
- Start and end: the trainer publishes where it starts (`start`: its step and the next batch
  index to generate, from its checkpoint) and that it finished (`done`).

Fixed lag only: under the free-running schedule the generator would take whichever version is
newest, which the two sides cannot agree on in advance, and every cross-process push must be
issued by both. A checkpoint is written by the trainer processes alone
(`checkpoint.restrict_to_processes`) and holds what a resumed run needs (the queued rollouts,
the data position, the queue's counts); a relaunched job's generators start from the trainer's
weights, pushed again from the restored step, and resample nothing the checkpoint holds.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
import zlib
from collections.abc import Sequence

import jax

from jaxrl.infra import faults
from jaxrl.infra.closable import QueueClosed, unwrap
from jaxrl.loop.controller import Controller
from jaxrl.loop.report import StepClock, queue_metrics
from jaxrl.loop.rollout_queue import RolloutQueue, ScoredBatch
from jaxrl.run_io import to_host
from jaxrl.sync.store import GeneratorWeights
from jaxrl.trainer import TrainState

logger = logging.getLogger(__name__)
ROLES = ("trainer", "generator")
_PREFIX = "jaxrl_roles"
_POLL_MS = 1000


class RoleLayoutError(ValueError):
    """`rl_main.roles` does not fit the job's processes or the meshes' devices."""


@dataclasses.dataclass(frozen=True)
class RoleLayout:
    """Which process runs which role: `roles[i]` is process i's."""

    roles: tuple[str, ...]

    @property
    def trainer_processes(self) -> tuple[int, ...]:
        return tuple(i for i, r in enumerate(self.roles) if r == "trainer")

    @property
    def generator_processes(self) -> tuple[int, ...]:
        return tuple(i for i, r in enumerate(self.roles) if r == "generator")

    def role_of(self, process: int) -> str:
        return self.roles[process]


def check_roles(
    roles: Sequence[str], trainer_mesh: jax.sharding.Mesh, generator_mesh: jax.sharding.Mesh
) -> RoleLayout:
    """The job's `RoleLayout`; raises RoleLayoutError naming the fix when `roles` does not give
    each process one known role, process 0 the trainer's, or a mesh uses a device of a process
    of the other role."""
    roles = tuple(roles)
    count = jax.process_count()
    if len(roles) != count:
        raise RoleLayoutError(
            f"rl_main.roles={roles} names {len(roles)} processes but the job has {count}; give "
            "one role per process, in process order (e.g. ('trainer', 'generator'))"
        )
    unknown = sorted(set(roles) - set(ROLES))
    if unknown:
        raise RoleLayoutError(f"rl_main.roles has unknown role(s) {unknown}; use {ROLES}")
    if roles[0] != "trainer":
        raise RoleLayoutError(
            f"rl_main.roles={roles}: process 0 must be a trainer (it hosts the coordination "
            "service and writes the metrics and checkpoints); put 'trainer' first"
        )
    if "generator" not in roles:
        raise RoleLayoutError(f"rl_main.roles={roles} has no generator process")
    layout = RoleLayout(roles)
    for role, mesh, own in (
        ("trainer", trainer_mesh, layout.trainer_processes),
        ("generator", generator_mesh, layout.generator_processes),
    ):
        strays = sorted(
            {(d.id, d.process_index) for d in mesh.devices.flat if d.process_index not in own}
        )
        if strays:
            raise RoleLayoutError(
                f"the {role} mesh uses device(s) {[d for d, _ in strays]} of process(es) "
                f"{sorted({p for _, p in strays})}, which rl_main.roles={roles} gives another "
                f"role; choose the {role}'s devices (MeshConfig.device_indices) among its "
                f"processes {list(own)}"
            )
    return layout


class RolloutChannel:
    """Keys in the coordination service's key-value store (module docstring). Blocking reads
    wait at most `timeout_s` and raise TimeoutError naming what they waited for."""

    def __init__(self, timeout_s: float):
        from jax._src import distributed as jax_distributed

        self.client = jax_distributed.global_state.client
        if self.client is None:
            raise RuntimeError("RolloutChannel needs a jax.distributed job (initialize first)")
        self.timeout_s = timeout_s

    def put_json(self, name: str, value) -> None:
        self.client.key_value_set_bytes(f"{_PREFIX}/{name}", json.dumps(value).encode())

    def get_json(self, name: str, what: str, timeout_s: float | None = None):
        return json.loads(self._get(name, what, timeout_s))

    def has(self, name: str) -> bool:
        return self.client.key_value_try_get_bytes(f"{_PREFIX}/{name}") is not None

    def send(self, batch: ScoredBatch) -> None:
        blob = zlib.compress(json.dumps(batch.to_json()).encode(), 1)
        self.client.key_value_set_bytes(f"{_PREFIX}/batch/{batch.batch_index}", blob)

    def receive(self, index: int) -> ScoredBatch:
        blob = self._get(f"batch/{index}", f"the generator to send batch {index}")
        return ScoredBatch.from_json(json.loads(zlib.decompress(blob)))

    def forget(self, index: int) -> None:
        self.client.key_value_delete(f"{_PREFIX}/batch/{index}")

    def _get(self, name: str, what: str, timeout_s: float | None = None) -> bytes:
        """Polls in one-second waits, so a stuck read is noticed against its own deadline."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        key = f"{_PREFIX}/{name}"
        while True:
            try:
                return self.client.blocking_key_value_get_bytes(key, _POLL_MS)
            except jax.errors.JaxRuntimeError as err:
                if "DEADLINE_EXCEEDED" not in str(err):
                    raise
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {what}")


class _PushOnly:
    """The trainer's side of the cross-process push, with `GeneratorWeights.publish`'s
    signature: the generator processes receive the same push into their own weight store."""

    def __init__(self, sync):
        self.sync = sync

    def publish(self, trainer_params, version: int, timeout: float | None = None):
        _, metrics = self.sync.push(trainer_params, version)  # nothing of it lives here
        return metrics, 0.0

    def close(self, error: BaseException | None = None) -> None:
        pass


class RoleController(Controller):
    """The controller of one process of a role-split job: `run_trainer` on trainer processes,
    `run_generator` on generator processes (module docstring). Built like `Controller`, with
    `weights` = the job's `CrossProcessWeightSync` (the same on every process) and on
    generator processes `io=None` (they write nothing)."""

    def __init__(self, config, trainer, generator, rewarder, source, tokenizer, io, **kwargs):
        self.sync = kwargs.pop("weights")
        self.layout: RoleLayout = kwargs.pop("layout")
        if config.mode != "async" or config.schedule != "fixed_lag":
            raise ValueError(
                f"rl_main.roles needs RLConfig.mode='async' and schedule='fixed_lag' (got "
                f"{config.mode!r}, {config.schedule!r}): both roles must know every version "
                "pushed across processes in advance"
            )
        super().__init__(
            config,
            trainer,
            generator,
            rewarder,
            source,
            tokenizer,
            io if io is not None else _NoIO(),
            weights=_PushOnly(self.sync),
            **kwargs,
        )
        self.in_turns = False  # the point of the split: no program spans both roles
        self.channel = RolloutChannel(config.stall_timeout_s)
        me = jax.process_index()
        self.lead_trainer = me == self.layout.trainer_processes[0]
        self.lead_generator = me == self.layout.generator_processes[0]

    def run(self, state=None, extra=None):
        if self.layout.role_of(jax.process_index()) == "trainer":
            return self.run_trainer(state, extra)
        return self.run_generator()

    # --- trainer processes -------------------------------------------------------------------

    def run_trainer(self, state: TrainState, extra: dict | None = None) -> TrainState:
        c = self.config
        step = int(state.step)
        queue = self.restore_queue(step, extra)
        first_index = queue.next_index
        if self.lead_trainer:
            self.channel.put_json("start", {"step": step, "first_index": first_index})
        # The first push before the step-0 evaluation: the generator samples meanwhile.
        self.publish(state.params, step, first_index)
        if step == 0:
            self.io.log(0, self.evaluate(state.params), {})
        fetcher = _Fetcher(self, queue, first_index)
        fetcher.start()
        # The generator processes time themselves (`time/generator_idle_s` in each batch).
        report = self.step_report(StepClock())
        report.start(step)
        n = c.num_prompts * c.oversample
        try:
            while step < c.total_steps:
                depth = queue.depth
                t0 = time.perf_counter()
                batch, staleness = unwrap(queue.get, c.stall_timeout_s)
                t1 = time.perf_counter()
                train_batch = self.collate(batch.rollouts)
                state, train_metrics = self.trainer.rl_step(state, train_batch, self.ref_params)
                train_metrics = to_host(train_metrics)
                t2 = time.perf_counter()
                step += 1
                queue.advance(step)
                if self.lead_trainer:
                    self.channel.forget(batch.batch_index)
                metrics = dict(batch.metrics) | train_metrics
                metrics |= self.publish(state.params, step, first_index)
                stats = queue.stats
                metrics |= self.step_metrics(
                    step, sampled=(stats.consumed_batches + stats.dropped_batches) * n
                )
                metrics |= {
                    "data/batch_index": float(batch.batch_index),
                    "async/generator_version": float(batch.policy_version),
                    "async/staleness": float(staleness),
                    "async/queue_depth": float(depth),
                } | queue_metrics(stats)
                report.step(
                    step,
                    state,
                    metrics,
                    {"reward": f"{metrics['reward/mean']:.3f}", "stale": f"{staleness}"},
                    lambda step: self.async_snapshot(step, queue, fetcher),
                    timing=(t0, t1, t2, int(train_batch.completion_mask_bt.sum())),
                )
        except BaseException:
            fetcher.stop()
            raise
        fetcher.stop()
        jax.block_until_ready(state.params)
        if self.lead_trainer:
            self.channel.put_json("done", {"step": step})
        return state

    # --- generator processes -----------------------------------------------------------------

    def run_generator(self) -> None:
        """Samples and scores batches [first_index, total_steps) with the versions the trainer
        pushes, and (the first generator process) sends each once the trainer asks for it."""
        c = self.config
        start = self.channel.get_json("start", "the trainer to start (process 0)")
        step, first_index = int(start["step"]), int(start["first_index"])
        weights = GeneratorWeights(self.sync, latest_only=False)
        versions = [v for v in range(step, c.total_steps + 1) if self.push_needed(v, first_index)]
        receiver = threading.Thread(
            target=self._receive, args=(weights, versions), name="jaxrl-receiver", daemon=True
        )
        receiver.start()
        try:
            for k in range(first_index, c.total_steps):
                t0 = time.perf_counter()
                params = unwrap(weights.acquire, self.version_for(k), c.stall_timeout_s)
                waited = time.perf_counter() - t0
                items, prompt_ids = self.prompts(k)
                generated = self.generator.generate(
                    params.params, items, prompt_ids, params.version, k
                )
                rollouts, metrics = self.score(generated)
                metrics["time/generate_s"] = generated.seconds
                if self.lead_generator:
                    t1 = time.perf_counter()
                    self.channel.get_json(f"room/{k}", f"the trainer to ask for batch {k}")
                    metrics["time/generator_idle_s"] = waited + time.perf_counter() - t1
                    self.channel.send(ScoredBatch(k, params.version, rollouts, metrics))
                    faults.after_batch(k)
                logger.info("generator: sent batch %d (version %d)", k, params.version)
        except BaseException:
            weights.close()
            raise
        receiver.join(c.stall_timeout_s)
        weights.free()
        # Exit together with the trainer (JAX's shutdown barrier waits for every process).
        self.channel.get_json("done", "the trainer to finish")

    def _receive(self, weights: GeneratorWeights, versions: list[int]) -> None:
        """The receiver thread: issues the trainer's pushes, in order, into `weights`."""
        phantom = jax.tree.map(
            lambda a, s: jax.make_array_from_single_device_arrays(a.shape, s, [], dtype=a.dtype),
            self.trainer.abstract_params,
            self.trainer.param_shardings,
        )
        try:
            for version in versions:
                weights.publish(phantom, version, self.config.stall_timeout_s)
        except QueueClosed:
            return
        except BaseException as error:
            error.add_note("[jaxrl] raised in the generator's weight receiver thread")
            weights.close(error)


class _Fetcher:
    """The trainer's fetcher thread: for batch index k = first_index, ...: waits for room in
    the queue, asks the generator for batch k (the lead trainer), receives it and puts it into
    the queue. Its failure closes the queue with the error (raised at the trainer's next wait).
    `version`: the policy version of the last batch received (checkpointed)."""

    def __init__(self, controller: RoleController, queue: RolloutQueue, first_index: int):
        self.controller, self.queue, self.first_index = controller, queue, first_index
        self.version: int | None = None
        self._thread = threading.Thread(target=self._run, name="jaxrl-fetcher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.queue.close()
        self._thread.join(5.0)

    def _run(self) -> None:
        ctl = self.controller
        c = ctl.config
        try:
            for k in range(self.first_index, c.total_steps):
                self.queue.wait_for_room(c.stall_timeout_s)
                if ctl.lead_trainer:
                    ctl.channel.put_json(f"room/{k}", True)
                batch = ctl.channel.receive(k)
                self.version = batch.policy_version
                self.queue.put(batch, c.stall_timeout_s)
        except QueueClosed:
            return
        except BaseException as error:
            error.add_note(f"[jaxrl] raised in the trainer's rollout fetcher at batch {k}")
            self.queue.close(error)


class _NoIO:
    """A generator process writes nothing (the trainer's process 0 logs and saves)."""

    def start(self, step):
        pass

    def log(self, step, metrics, headline):
        return metrics

    def save_due(self, step, force=False):
        return False

    def save(self, state, extra, *, force=False):
        pass

    def after_step(self, step):
        pass

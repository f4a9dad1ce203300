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
  the versions (`feeds.lagged.push_needed`: batch k is sampled by version max(k - lag, 0)), so the
  trainer pushes each one after its optimizer step and a receiver thread on every generator
  process issues the same push into a `GeneratorWeights` double buffer, while the generator's
  main thread samples. The trainer's push returns once the generator holds the version (each
  chunk ends at a coordination-service barrier); it waits longer only when the generator still
  holds two versions, as `GeneratorWeights.publish` does in one process.
- Scored rollouts, generator -> trainer: the coordination service's key-value store
  (`rollout_channel.RolloutChannel`; bytes values, zlib-compressed JSON of `ScoredBatch.to_json`,
  float32 log-probs exact). The trainer asks for batch k (key `room/k`) only when its `RolloutQueue`
  has room, the generator sends it (key `batch/k`) once asked, and the trainer's fetcher thread puts
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

Trainer processes run the one trainer loop (`Controller.run`) over `trainer_feed(...)` (a
`feeds.remote.RemoteFeed`, with `PushOnly` as the weight store); generator processes run
`run_generator`: `serve_batches` over the key-value store, sampling with the lagged feed's
`sample_batch` (`serve_batches` takes any channel with `get_json` and `send`).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax

from jaxrl.infra import faults
from jaxrl.infra.closable import QueueClosed, unwrap
from jaxrl.loop.feeds.lagged import push_needed, sample_batch, version_for
from jaxrl.loop.feeds.remote import RemoteFeed
from jaxrl.loop.rollout_channel import RolloutChannel

if TYPE_CHECKING:
    from jaxrl.loop.controller import Controller

logger = logging.getLogger(__name__)
ROLES = ("trainer", "generator")


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


class PushOnly:
    """The trainer processes' weight store: the cross-process push alone, with
    `GeneratorWeights.publish`'s signature (the generator processes receive the same push into
    their own `GeneratorWeights`)."""

    def __init__(self, sync):
        self.sync = sync

    def publish(self, trainer_params, version: int, timeout: float | None = None):
        _, metrics = self.sync.push(trainer_params, version)  # nothing of it lives here
        return metrics, 0.0

    def close(self, error: BaseException | None = None) -> None:
        pass

    def free(self) -> None:
        pass


def trainer_feed(controller: Controller, layout: RoleLayout) -> RemoteFeed:
    """The feed of a trainer process: batches from the generator processes."""
    channel = RolloutChannel(controller.config.stall_timeout_s)
    lead = jax.process_index() == layout.trainer_processes[0]
    return RemoteFeed(controller, channel, lead)


def run_generator(ctl: Controller, layout: RoleLayout) -> None:
    """A generator process's main: `serve_batches` over the coordination service's key-value
    store, with the versions the trainer pushes received into `ctl.weights` (a
    `GeneratorWeights` over the job's `CrossProcessWeightSync`); the first generator process
    sends the batches. `ctl` is built as on a trainer process, with `io=NoIO()`."""
    channel = RolloutChannel(ctl.config.stall_timeout_s)
    lead = jax.process_index() == layout.generator_processes[0]
    phantom = jax.tree.map(
        lambda a, s: jax.make_array_from_single_device_arrays(a.shape, s, [], dtype=a.dtype),
        ctl.trainer.abstract_params,
        ctl.trainer.param_shardings,
    )
    serve_batches(ctl, channel, lead, phantom)


def serve_batches(ctl: Controller, channel, lead: bool, pushed=None, timeline=None) -> None:
    """The generator side of a role split: samples and scores batches [first_index,
    total_steps) with the versions the trainer pushes, and (`lead`) sends each once the trainer
    asks for it. `channel` is a `RolloutChannel` or anything with its `get_json` and `send`;
    a receiver thread issues the trainer's pushes in order (`ctl.weights.publish(pushed, v)`:
    `pushed` is what this side's transport pushes, e.g. phantom arrays of the trainer's
    shards). `timeline` (`begin(t)` / `end(t)`, e.g. a `BusyTimeline`) gets the busy spans."""
    c = ctl.config
    start = channel.get_json("start", "the trainer to start (process 0)")
    step, first_index = int(start["step"]), int(start["first_index"])
    weights = ctl.weights
    versions = [v for v in range(step, c.total_steps + 1) if push_needed(c, v, first_index)]
    receiver = threading.Thread(
        target=_receive, args=(ctl, versions, pushed), name="jaxrl-receiver", daemon=True
    )
    receiver.start()
    try:
        for k in range(first_index, c.total_steps):
            t0 = time.perf_counter()
            params = unwrap(weights.acquire, version_for(c, k), c.stall_timeout_s)
            waited = time.perf_counter() - t0
            if timeline is not None:
                timeline.begin(time.perf_counter())
            batch = sample_batch(ctl, k, params)
            if timeline is not None:
                timeline.end(time.perf_counter())
            if lead:
                t1 = time.perf_counter()
                channel.get_json(f"room/{k}", f"the trainer to ask for batch {k}")
                batch.metrics["time/generator_idle_s"] = waited + time.perf_counter() - t1
                channel.send(batch)
                faults.after_batch(k)
            logger.info("generator: sent batch %d (version %d)", k, params.version)
    except BaseException:
        weights.close()
        raise
    receiver.join(c.stall_timeout_s)
    weights.free()
    # Exit together with the trainer (JAX's shutdown barrier waits for every process).
    channel.get_json("done", "the trainer to finish")


def _receive(ctl: Controller, versions: list[int], pushed) -> None:
    """The receiver thread: issues the trainer's pushes, in order, into `ctl.weights`."""
    try:
        for version in versions:
            ctl.weights.publish(pushed, version, ctl.config.stall_timeout_s)
    except QueueClosed:
        return
    except BaseException as error:
        error.add_note("[jaxrl] raised in the generator's weight receiver thread")
        ctl.weights.close(error)


class NoIO:
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

    def close(self):
        pass

"""The library's role split over `multiprocessing` pipes: a benchmark's trainer and generator in
two pinned processes of one machine, each running `jaxrl`'s own side of a role-split job.

- Trainer process: `Controller.run` over `PipeFeed` (a `jaxrl.loop.feeds.remote.RemoteFeed`
  whose channel is a pair of pipes), with `PipeWeights` as its weight store: after every step
  the params are copied to the host and sent through the weights pipe by a thread, beside the
  next step (the proxy's stand-in for the device-to-device push, counted as sync time).
- Generator process: `jaxrl.loop.roles.serve_batches` with a `GeneratorWeights` over
  `PipeSync` (each version received from the weights pipe and put on the device).

Three pipes: control (trainer -> generator: start, room for batch k, done), rollouts (generator
-> trainer: `ScoredBatch`es) and weights (trainer -> generator: (version, host params)).
"""

from __future__ import annotations

import threading
import time

import jax
import numpy as np

from jaxrl.loop.feeds.remote import RemoteFeed
from jaxrl.sync.plan import GeneratorParams, SyncMetrics


class TrainerChannel:
    """The trainer's end of the control and rollout pipes (`RemoteFeed`'s channel)."""

    def __init__(self, control, rollouts):
        self.control, self.rollouts = control, rollouts

    def put_json(self, name: str, value) -> None:
        self.control.send((name, value))

    def receive(self, index: int):
        batch = self.rollouts.recv()
        if batch.batch_index != index:
            raise RuntimeError(f"pipe feed: got batch {batch.batch_index}, expected {index}")
        return batch

    def forget(self, index: int) -> None:
        del index  # a pipe keeps nothing


class GeneratorChannel:
    """The generator's end (`serve_batches`' channel). Control messages arrive in the order the
    trainer sends them; `get_json` keeps the ones it was not asked for yet. `sent` records each
    batch's generate and reward seconds."""

    def __init__(self, control, rollouts):
        self.control, self.rollouts = control, rollouts
        self.pending: dict[str, object] = {}
        self.sent: list[dict[str, float]] = []

    def get_json(self, name: str, what: str, timeout_s: float | None = None):
        while name not in self.pending:
            got, value = self.control.recv()
            self.pending[got] = value
        return self.pending.pop(name)

    def send(self, batch) -> None:
        metrics = batch.metrics
        self.sent.append(
            {"generate_s": metrics["time/generate_s"], "reward_s": metrics["time/reward_s"]}
        )
        self.rollouts.send(batch)


class PipeFeed(RemoteFeed):
    """`RemoteFeed` over pipes (one trainer, the lead). `train_spans`: each step's
    (train start, train end) on `time.perf_counter`, which every process of a machine shares."""

    def __init__(self, controller, channel: TrainerChannel):
        super().__init__(controller, channel, lead=True)
        self.train_spans: list[tuple[float, float]] = []
        self.taken_at = 0.0

    def take(self, step: int, params):
        taken = super().take(step, params)
        self.taken_at = time.perf_counter()
        return taken

    def trained(self, step: int, params) -> dict[str, float]:
        self.train_spans.append((self.taken_at, time.perf_counter()))
        return super().trained(step, params)

    def stop(self, failed: bool) -> None:
        super().stop(failed)
        self.controller.weights.free()


class PipeWeights:
    """The trainer's weight store: `publish` copies the params to the host (the next step
    donates them) and sends them from a thread, after the previous send finished."""

    def __init__(self, conn):
        self.conn = conn
        self.sender: threading.Thread | None = None

    def publish(self, trainer_params, version: int, timeout: float | None = None):
        start = time.perf_counter()
        host = jax.tree.map(np.array, trainer_params)
        if self.sender is not None:
            self.sender.join()
        self.sender = threading.Thread(target=self.conn.send, args=((version, host),))
        self.sender.start()  # pickling + the pipe, beside the next step
        nbytes = sum(x.nbytes for x in jax.tree.leaves(host))
        seconds = time.perf_counter() - start
        return SyncMetrics(version, nbytes, nbytes, seconds, 1, 0), 0.0

    def close(self, error: BaseException | None = None) -> None:
        del error

    def free(self) -> None:
        if self.sender is not None:
            self.sender.join()


class PipeSync:
    """The generator's transport for `GeneratorWeights`: each push receives the next version
    from the weights pipe and puts it on the default device."""

    def __init__(self, conn):
        self.conn = conn

    def push(self, trainer_params, version: int):
        del trainer_params  # the params come through the pipe
        start = time.perf_counter()
        got, host = self.conn.recv()
        if got != version:
            raise RuntimeError(f"pipe weights: got version {got}, expected {version}")
        params = jax.device_put(host)
        nbytes = sum(x.nbytes for x in jax.tree.leaves(host))
        seconds = time.perf_counter() - start
        return GeneratorParams(version, params), SyncMetrics(version, nbytes, nbytes, seconds, 1, 0)


class Spans:
    """Busy spans (`begin(t)` / `end(t)`), kept whole for a summary after the run."""

    def __init__(self):
        self.spans: list[tuple[float, float]] = []
        self.opened = 0.0

    def begin(self, t: float) -> None:
        self.opened = t

    def end(self, t: float) -> None:
        self.spans.append((self.opened, t))

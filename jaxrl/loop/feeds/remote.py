"""The trainer's side of a role-split job (`jaxrl.loop.roles`): a fixed-lag feed whose generator
runs in other processes.

Batches arrive through the coordination service's key-value store
(`rollout_channel.RolloutChannel`): a fetcher thread asks for batch k (key `room/k`) only when the
`RolloutQueue` has room, receives it and puts it into the queue, which checks staleness on admission
and on consumption exactly as in one process. Weights leave through the cross-process push
(`roles.PushOnly`), which the generator processes issue alike. Everything else (the queue, the
checkpoint's run state, the pushes each version needs) is `LaggedFeed`'s.
"""

from __future__ import annotations

import threading

from jaxrl.infra.closable import QueueClosed
from jaxrl.loop.config import check_role_split
from jaxrl.loop.feeds.base import ControllerView
from jaxrl.loop.feeds.lagged import LaggedFeed, restore_queue
from jaxrl.loop.rollout_channel import RolloutChannel
from jaxrl.loop.rollout_queue import RolloutQueue


class RemoteFeed(LaggedFeed):
    """`LaggedFeed` with the generator in other processes (module docstring). `lead`: this
    process is the first trainer (it asks for batches and writes the shared keys)."""

    generator_here = False  # no program of this process samples: nothing takes turns

    def __init__(self, controller: ControllerView, channel: RolloutChannel, lead: bool):
        check_role_split(controller.config)
        super().__init__(controller)
        self.channel, self.lead = channel, lead
        self.taken_index = -1

    def start(self, step: int, params, extra: dict | None) -> None:
        self.queue = restore_queue(self.config, step, extra)
        self.first_index = self.queue.next_index
        if self.lead:
            self.channel.put_json("start", {"step": step, "first_index": self.first_index})
        self.push(step, params)
        self.source = _Fetcher(self, self.queue, self.first_index)
        self.source.start()

    def take(self, step: int, params):
        taken = super().take(step, params)
        self.taken_index = int(taken.metrics["data/batch_index"])
        return taken

    def trained(self, step: int, params) -> dict[str, float]:
        if self.lead:  # trained on: its key is deleted
            self.channel.forget(self.taken_index)
        return super().trained(step, params)

    def stop(self, failed: bool) -> None:
        if self.source is not None:
            self.source.stop()
        if self.lead and not failed:
            self.channel.put_json("done", {"step": self.config.total_steps})


class _Fetcher:
    """The trainer's fetcher thread: for batch index k = first_index, ...: waits for room in
    the queue, asks the generator for batch k (the lead trainer), receives it and puts it into
    the queue. Its failure closes the queue with the error (raised at the trainer's next wait).
    `version`: the policy version of the last batch received (checkpointed)."""

    def __init__(self, feed: RemoteFeed, queue: RolloutQueue, first_index: int):
        self.feed, self.queue, self.first_index = feed, queue, first_index
        self.version: int | None = None
        self._thread = threading.Thread(target=self._run, name="jaxrl-fetcher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.queue.close()
        self._thread.join(5.0)

    def _run(self) -> None:
        feed, c = self.feed, self.feed.config
        try:
            for k in range(self.first_index, c.total_steps):
                self.queue.wait_for_room(c.stall_timeout_s)
                if feed.lead:
                    feed.channel.put_json(f"room/{k}", True)
                batch = feed.channel.receive(k)
                self.version = batch.policy_version
                self.queue.put(batch, c.stall_timeout_s)
        except QueueClosed:
            return
        except BaseException as error:
            error.add_note(f"[jaxrl] raised in the trainer's rollout fetcher at batch {k}")
            self.queue.close(error)

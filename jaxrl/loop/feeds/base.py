"""Rollout feeds: where the one trainer loop (`jaxrl.loop.controller.Controller.run`) gets its
batches, and what it tells the generator after each step.

A feed hides how rollouts are made: on the trainer's own mesh between steps (`colocated`), by a
generator thread a fixed number of versions behind or as fast as it can (`lagged`), by an engine
that never drains (`streaming`), or by generator processes of a role-split job (`remote`). The
loop calls, in this order:

    start(step, params, extra)   restore the checkpoint's run state, push the first version,
                                 start the generator side
    take(step, params)           the next batch (waits for it): a `Taken`
    trained(step, params)        after optimizer step `step`: advance the queue's version and
                                 push the new weights; returns the step's feed metrics, which
                                 include `data/prompts_sampled` (`jaxrl.loop.report`)
    snapshot(step)               the checkpoint's run state (JSON; may wait for the generator)
    stop(failed)                 stop the generator side (after a failure: without waiting long)

`timeline` (a `BusyTimeline` of the generator's busy spans, or None when the generator is in
other processes) gives the loop's clock the generator's idle time and overlap.

A feed class also answers the launcher's questions about its schedule (`engine_slots`,
`latest_only`), so that knowledge lives with the code that relies on it. A feed is built from the
controller that drives it and sees it as a `ControllerView`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import TYPE_CHECKING, Any, Protocol

from jaxrl.infra.closable import QueueClosed, unwrap
from jaxrl.loop.config import RLConfig
from jaxrl.loop.report import BusyTimeline
from jaxrl.rl import Rollout

if TYPE_CHECKING:
    from jaxrl.generation.executor import GeneratorExecutor
    from jaxrl.loop.reward import RewardExecutor
    from jaxrl.sync.store import GeneratorWeights
    from jaxrl.tasks.prompt import PromptItem, PromptSource


@dataclasses.dataclass
class Taken:
    """One train batch from a feed.

    rollouts: `num_prompts x samples_per_prompt` scored rollouts.
    metrics: the batch's own figures (reward, generation and reward time, staleness, ...).
    headline: progress-line values besides the reward (e.g. staleness).
    prompt_len: the padded prompt length to collate to (None: the bucket of the longest).
    histogram: (name, values) of a distribution to draw, or None.
    """

    rollouts: list[Rollout]
    metrics: dict[str, float]
    headline: dict[str, str] = dataclasses.field(default_factory=dict)
    prompt_len: int | None = None
    histogram: tuple[str, Any] | None = None


logger = logging.getLogger(__name__)


class RolloutFeed(Protocol):
    """The trainer loop's source of batches (module docstring)."""

    timeline: BusyTimeline | None

    def start(self, step: int, params: Any, extra: dict | None) -> None: ...

    def take(self, step: int, params: Any) -> Taken: ...

    def trained(self, step: int, params: Any) -> dict[str, float]: ...

    def snapshot(self, step: int) -> dict: ...

    def stop(self, failed: bool) -> None: ...


class ControllerView(Protocol):
    """What a feed uses of the controller that drives it (`jaxrl.loop.controller.Controller`): the
    run's config, executors and weight store, and the prompt and scoring steps every schedule
    shares."""

    config: RLConfig
    generator: GeneratorExecutor
    rewarder: RewardExecutor
    source: PromptSource
    tokenizer: Any
    weights: GeneratorWeights | None
    chat_formatted: bool

    def prompts(self, batch_index: int) -> tuple[list[PromptItem], list[list[int]]]: ...

    def score(self, generated) -> tuple[list, dict]: ...

    def prompt_bucket(self, prompt_ids) -> int: ...


def default_engine_slots(config: RLConfig) -> int:
    """Decode slots for one generate call's rows: num_prompts x oversample x samples_per_prompt."""
    return config.samples_per_prompt * config.num_prompts * config.oversample


def check_resumable(step: int, extra: dict | None, expected: dict) -> None:
    """Raises ValueError naming both configs when the checkpoint at `step` was written by a run
    whose `expected` keys (mode, schedule, lag) differ from this one's."""
    saved = {k: (extra or {}).get(k) for k in expected}
    if saved != expected:
        wanted = ", ".join(f"{k}={v!r}" for k, v in expected.items())
        raise ValueError(
            f"the checkpoint at step {step} was written by a run with {saved}, not {wanted}; "
            "continue it with its own config, or start a fresh workdir"
        )


def publish(weights, params, version: int, timeout_s: float, needed: bool = True) -> dict:
    """Pushes `params` into the generator's weight store as `version` (when `needed`: some
    batch still to generate samples with it); the push's metrics."""
    if not needed:
        return {"time/sync_s": 0.0}
    sync, waited = unwrap(weights.publish, params, version, timeout_s)
    return {
        "time/sync_s": sync.seconds,
        "time/sync_wait_s": waited,
        "sync/gbps": sync.gbps,
        # one copy of what was pushed (LoRA: the adapters only), in the generator dtype
        "sync/bytes_pushed": float(sync.params_bytes),
    }


class GeneratorThread:
    """The generator side's one life cycle in a process that trains too: a daemon thread runs
    `produce()` (`lagged.BatchProducer`, `streaming.StreamProducer`). `stop()` closes the queue
    and the weight store (waking every wait), joins, and frees the store's copies once the
    thread has stopped. A failure in `produce` closes both with the error, which the trainer
    re-raises at its next wait (`unwrap`); `QueueClosed` (the trainer stopped it) ends quietly.
    `version`: the policy version it samples with (checkpointed)."""

    thread_name = "jaxrl-generator"

    def __init__(self, controller: ControllerView, queue, timeline: BusyTimeline | None = None):
        self.controller, self.queue = controller, queue
        self.version: int | None = None
        self.timeline = timeline or BusyTimeline()
        self._thread = threading.Thread(target=self.run, name=self.thread_name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self.queue.close()
        self.controller.weights.close()
        self._thread.join(timeout_s)
        if self._thread.is_alive():  # inside a device call; a daemon, so exit does not wait
            logger.warning("the generator thread did not stop within %.0fs", timeout_s)
        else:
            self.controller.weights.free()

    def produce(self) -> None:
        raise NotImplementedError

    def where(self) -> str:
        """Where a failure was raised, for the note on the error."""
        return f"the generator thread (policy version {self.version})"

    def failed(self, error: BaseException) -> None:
        """After a failure closed the queue and the store (a hook)."""

    def finish(self) -> None:
        """After `produce` ends, however it ends (a hook)."""

    def run(self) -> None:
        """The thread's body (`start` runs it on the thread; a process that only generates may
        call it on its own thread): `produce`, with the failure handling above."""
        try:
            self.produce()
        except QueueClosed:
            return  # stopped by the trainer: the run ended, or failed on the trainer's side
        except BaseException as error:
            error.add_note(
                f"[jaxrl] raised in {self.where()}; the run stops, its last checkpoint is intact"
            )
            self.queue.close(error)
            self.controller.weights.close(error)
            self.failed(error)
        finally:
            self.finish()

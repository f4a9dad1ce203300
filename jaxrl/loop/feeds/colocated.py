"""Sync mode's feed (the colocated "DeepSpeed-Chat-like" baseline): batch k is generated and
scored with the trainer's current params (policy version k) on the trainer's mesh, on the loop's
own thread, then trained on (`sample`, when given, makes the batch instead: multi-turn episodes,
`jaxrl.loop.feeds.episodes`). Every sample is exactly on-policy (in fp32, log pi == log mu up to
rounding). Batch k's prompts and sampling key are functions of k, so a checkpoint needs only the
train state and the step to continue bit for bit.
"""

from __future__ import annotations

import time

from jaxrl.loop.feeds.base import ControllerView, Taken, default_engine_slots
from jaxrl.loop.report import BusyTimeline
from jaxrl.sync.plan import GeneratorParams


class ColocatedFeed:
    """Generates each batch when the loop asks for it (module docstring)."""

    latest_only = staticmethod(lambda config: False)  # no store: it samples the trainer's params
    engine_slots = staticmethod(default_engine_slots)

    def __init__(self, controller: ControllerView, sample=None):
        """`sample`: a `lagged.SampleBatch` that makes batch k from the trainer's params as
        version k (None: one generate call, then the reward)."""
        self.controller, self.sample = controller, sample
        self.timeline = BusyTimeline()  # generation and scoring, on the trainer's thread

    def start(self, step: int, params, extra: dict | None) -> None:
        pass

    def take(self, step: int, params) -> Taken:
        ctl = self.controller
        self.timeline.begin(time.perf_counter())
        if self.sample is not None:
            batch = self.sample(ctl, step, GeneratorParams(step, params))
            self.timeline.end(time.perf_counter())
            return Taken(batch.rollouts, batch.metrics)
        items, prompt_ids = ctl.prompts(step)
        generated = ctl.generator.generate(params, items, prompt_ids, step, step)
        rollouts, metrics = ctl.score(generated)
        self.timeline.end(time.perf_counter())
        metrics["time/generate_s"] = generated.seconds
        # Padded to the bucket of every prompt sampled (dynamic sampling keeps some of them).
        return Taken(rollouts, metrics, prompt_len=ctl.prompt_bucket(prompt_ids))

    def trained(self, step: int, params) -> dict[str, float]:
        c = self.controller.config
        return {"data/prompts_sampled": float(step * c.num_prompts * c.oversample)}

    def snapshot(self, step: int) -> dict:
        return {}

    def stop(self, failed: bool) -> None:
        pass

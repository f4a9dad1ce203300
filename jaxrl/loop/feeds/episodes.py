"""Sync mode's feed for multi-turn episodes: batch k's prompts each run as G episodes in fresh
environments (`jaxrl.generation.episodes.EpisodeRunner`) on the colocated engine, with the
trainer's current params (policy version k), on the loop's own thread; then trained on.

A batch is `num_prompts x oversample` prompts of the task's stream, as in the single-turn
colocated feed; group g of batch k is episode g of the call (its noise: the sampling key of
(seed, k, k), episode g, turn, sample) with group id `k * n + g`. The rollouts hold every token
after the prompt with the observations masked out of the loss (`Trajectory.to_rollout`); their
reward is the episode's (the loss's advantage estimator normalises it across the G episodes of
a prompt). `RLConfig.max_new_tokens` is the padded length of everything after the prompt, so it
must hold `EpisodeBudget.max_total_tokens`.

Evaluation (`evaluate`, which the controller uses when its feed has one): each held-out item
as one greedy episode; `eval/accuracy` is the mean episode reward, `eval/tool_call_rate` the
share of episodes with at least one step that did not end them.

Used through `Controller(..., feed=lambda ctl: EpisodeFeed(ctl, make_env=..., budget=...))`, or
`episode_feed(source, budget)` for a task source with `make_env()` and `stop_ids`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from jaxrl.env.base import Environment
from jaxrl.generation.episodes import EpisodeBudget, EpisodeGroup, EpisodeRunner, episode_metrics
from jaxrl.generation.executor import sampling_key
from jaxrl.loop.feeds.base import ControllerView, Taken, default_engine_slots
from jaxrl.loop.report import BusyTimeline
from jaxrl.loop.reward import shuffled_rewards
from jaxrl.rl import select_groups


class EpisodeFeed:
    """Runs each batch's episodes when the loop asks for it (module docstring).

    Args:
      controller: its generator's sampler must be the engine (`EngineSampler`) on the trainer's
        mesh (sync mode).
      make_env: a fresh `Environment` per episode.
      budget: the episodes' `EpisodeBudget`.
      stop_ids: ids that end a turn for a tool call (added to the sampling config's).
      tool_workers: threads for environment steps (0: inline, so that the device calls, and
        with them the behaviour log-probs' last bits, are the same on every run).
      mask_observations: observation tokens out of the loss (False: the control experiment of
        training on the tool's replies too, `Trajectory.to_rollout`).
    """

    latest_only = staticmethod(lambda config: False)
    engine_slots = staticmethod(default_engine_slots)

    def __init__(
        self,
        controller: ControllerView,
        *,
        make_env: Callable[[], Environment],
        budget: EpisodeBudget,
        stop_ids: Sequence[int] = (),
        tool_workers: int = 8,
        mask_observations: bool = True,
    ):
        c = controller.config
        if c.mode != "sync":
            raise ValueError(
                f"EpisodeFeed runs multi-turn episodes in sync mode (colocated); RLConfig.mode="
                f"{c.mode!r}"
            )
        engine = getattr(controller.generator.sampler, "engine", None)
        if engine is None:
            raise ValueError(
                "multi-turn episodes run on the continuous-batching engine; build the generator "
                "with generator='engine' (GeneratorConfig.kind), not the static sampler"
            )
        if budget.max_total_tokens > c.max_new_tokens:
            raise ValueError(
                f"EpisodeBudget.max_total_tokens={budget.max_total_tokens} > RLConfig."
                f"max_new_tokens={c.max_new_tokens}: a batch pads everything after the prompt "
                "to max_new_tokens; raise it to at least max_total_tokens"
            )
        sampling = controller.generator.sampling
        sampling = dataclasses.replace(
            sampling, stop_ids=tuple(sorted({*sampling.stop_ids, *map(int, stop_ids)}))
        )
        self.controller, self.make_env = controller, make_env
        self.mask_observations = mask_observations
        self.runner = EpisodeRunner(engine, sampling, budget, tool_workers=tool_workers)
        greedy = dataclasses.replace(sampling, greedy=True)
        self.eval_runner = EpisodeRunner(engine, greedy, budget, tool_workers=tool_workers)
        self.timeline = BusyTimeline()  # episodes and scoring, on the trainer's thread

    def start(self, step: int, params, extra: dict | None) -> None:
        pass

    def take(self, step: int, params) -> Taken:
        ctl, c = self.controller, self.controller.config
        self.timeline.begin(time.perf_counter())
        items, _ = ctl.prompts(step)
        n, g = len(items), c.samples_per_prompt
        groups = [
            EpisodeGroup(j, item, [self.make_env() for _ in range(g)], group_id=step * n + j)
            for j, item in enumerate(items)
        ]
        start = time.perf_counter()
        out = self.runner.run(params, sampling_key(c.seed, step, step), groups, version=step)
        seconds = time.perf_counter() - start
        trajectories = [t for ts in out for t in ts]
        rollouts = [t.to_rollout(self.mask_observations) for t in trajectories]
        rewards = np.array([r.reward for r in rollouts], np.float32)
        metrics = {"reward/mean": float(rewards.mean())}
        if c.shuffle_rewards:  # the control: rewards unlinked from their episodes
            rewards = shuffled_rewards(rewards, c.seed, step)
            rollouts = [
                dataclasses.replace(r, reward=float(x))
                for r, x in zip(rollouts, rewards, strict=True)
            ]
        if c.oversample > 1:
            rollouts, selected = select_groups(rollouts, c.num_prompts)
            metrics |= selected
        metrics |= episode_metrics(trajectories) | {
            "reward/trained_mean": float(np.mean([r.reward for r in rollouts])),
            "completion/mean_tokens": float(np.mean([len(r.completion_ids) for r in rollouts])),
            "time/generate_s": seconds,
        }
        self.timeline.end(time.perf_counter())
        prompt_len = ctl.prompt_bucket([t.prompt_ids for t in trajectories])
        return Taken(rollouts, metrics, prompt_len=prompt_len)

    def trained(self, step: int, params) -> dict[str, float]:
        c = self.controller.config
        return {"data/prompts_sampled": float(step * c.num_prompts * c.oversample)}

    def snapshot(self, step: int) -> dict:
        return {}

    def stop(self, failed: bool) -> None:
        self.runner.close()
        self.eval_runner.close()

    def evaluate(self, params, items) -> dict[str, float]:
        """Greedy episodes of the held-out `items`, one each (module docstring)."""
        groups = [EpisodeGroup(j, item, [self.make_env()]) for j, item in enumerate(items)]
        out = [ts[0] for ts in self.eval_runner.run(params, jax.random.key(0), groups)]
        calls = [len(t.step_statuses) - (t.status == "done") for t in out]
        return {
            "eval/accuracy": float(np.mean([t.reward for t in out])),
            "eval/tool_call_rate": float(np.mean([c > 0 for c in calls])),
            "eval/turns_mean": float(np.mean([t.turns for t in out])),
            "eval/done_fraction": float(np.mean([t.status == "done" for t in out])),
        }


def check_episode_job(config, budget: EpisodeBudget, source) -> None:
    """Raises ValueError, naming the fix, when `config` cannot run `source`'s episodes (before
    any work: the feed itself is built after the SFT stage)."""
    if config.mode != "sync":
        raise ValueError(
            f"multi-turn episodes run in sync mode for now; RLConfig.mode={config.mode!r}"
        )
    if not callable(getattr(source, "make_env", None)):
        raise ValueError(
            f"task source {type(source).__name__} has no make_env(): multi-turn episodes need "
            "an environment per episode (`jaxrl.env.base.Environment`)"
        )
    if budget.max_total_tokens > config.max_new_tokens:
        raise ValueError(
            f"EpisodeBudget.max_total_tokens={budget.max_total_tokens} > RLConfig.max_new_tokens="
            f"{config.max_new_tokens}: a batch pads everything after the prompt to max_new_tokens"
        )


def episode_feed(
    source, budget: EpisodeBudget, tool_workers: int = 8, mask_observations: bool = True
) -> Callable[[ControllerView], EpisodeFeed]:
    """The `Controller` feed argument for `source`'s episodes: its `make_env()` per episode,
    its `stop_ids` (if any) ending a tool call; `mask_observations` as for `EpisodeFeed`."""
    return lambda ctl: EpisodeFeed(
        ctl,
        make_env=source.make_env,
        budget=budget,
        stop_ids=getattr(source, "stop_ids", ()),
        tool_workers=tool_workers,
        mask_observations=mask_observations,
    )

"""Multi-turn episodes through the one trainer loop: the schedule's own feed (`colocated`,
`lagged` or `streaming`) with its generator step replaced by episodes
(`jaxrl.generation.episodes.EpisodeRunner`) on the generator's engine. The queue, the weight
pushes, the checkpoint and the resume are the feed's.

* **Sync** (`colocated`): batch k's episodes run on the trainer's engine with its current
  params (policy version k), on the loop's thread (`EpisodeBatches`).
* **Fixed lag / free running** (`lagged`): the generator thread runs batch k's episodes with
  the weights of version max(k - lag, 0) (fixed lag) on the generator's engine, under the
  same key as a single-turn batch, f(seed, version, k) (`EpisodeBatches`). Fixed lag is a pure
  function of the config, bit for bit, with `tool_workers=0` (the environment steps inline, so
  every device call's shape is fixed), and resumes bit for bit after a kill (the batches
  sampled ahead, episodes and all, are in the checkpoint).
* **Streaming** (`streaming`): prompt i runs as G episodes that join the running engine
  (`EpisodeGroups`); each later turn joins as its tool reply arrives, weights are swapped in
  between decode steps, so an episode may span versions (each sampled token records its own).
  A group is queued when its last episode ends. A resume re-runs the episode groups that were
  in flight from their start and trains none twice (the `GroupQueue` ledger).

A batch is `num_prompts x oversample` prompts of the task's stream, as in the single-turn
feeds; group g of batch k is episode g of the call (its noise: the call's key, episode g,
turn, sample) with group id `k * n + g` (streaming: prompt i is episode i, group id i, under
the key of (seed, 0, 0)). The rollouts hold every token after the prompt with the
observations masked out of the loss (`Trajectory.to_rollout`); their reward is the episode's
(the loss's advantage estimator normalises it across the G episodes of a prompt).
`RLConfig.max_new_tokens` is the padded length of everything after the prompt, so it must hold
`EpisodeBudget.max_total_tokens`. Role-split jobs (`rl_main.roles`) do not run episodes.

Evaluation (`evaluate`, which the controller uses when its feed has one): each held-out item
as one greedy episode on the trainer's engine (`Controller.eval_sampler`); `eval/accuracy` is
the mean episode reward, `eval/tool_call_rate` the share of episodes with at least one step
that did not end them.

Used through `Controller(..., feed=lambda ctl: EpisodeFeed(ctl, make_env=..., budget=...))`, or
`episode_feed(source, budget)` for a task source with `make_env()` and `stop_ids`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence

import jax
import numpy as np

from jaxrl.env.base import Environment
from jaxrl.generation.episodes import (
    EpisodeBudget,
    EpisodeGroup,
    EpisodeRunner,
    Trajectory,
    episode_metrics,
)
from jaxrl.generation.executor import sampling_key
from jaxrl.loop.config import RLConfig
from jaxrl.loop.feeds import feed_class
from jaxrl.loop.feeds.base import ControllerView, Taken
from jaxrl.loop.feeds.streaming import StreamingFeed
from jaxrl.loop.reward import shuffled_rewards
from jaxrl.loop.rollout_queue import ScoredBatch
from jaxrl.rl import select_groups


def _scored(
    config: RLConfig,
    index: int,
    version: int | None,
    trajectories: list[Trajectory],
    select: bool,
    mask_observations: bool = True,
) -> ScoredBatch:
    """The trajectories of batch (or prompt) `index` as a `ScoredBatch`: rollouts (rewards
    shuffled for the control; with `select`, the `num_prompts` groups dynamic sampling keeps;
    `mask_observations` as for `Trajectory.to_rollout`) and metrics. `version` None: the
    oldest version that sampled one of their tokens."""
    c = config
    rollouts = [t.to_rollout(mask_observations) for t in trajectories]
    if version is None:
        version = min(r.policy_version for r in rollouts)
    rewards = np.array([r.reward for r in rollouts], np.float32)
    metrics = {"reward/mean": float(rewards.mean())}
    if c.shuffle_rewards:  # the control: rewards unlinked from their episodes
        rewards = shuffled_rewards(rewards, c.seed, index)
        rollouts = [
            dataclasses.replace(r, reward=float(x)) for r, x in zip(rollouts, rewards, strict=True)
        ]
    if select and c.oversample > 1:  # (streaming: `GroupQueue.filter`, group by group)
        rollouts, selected = select_groups(rollouts, c.num_prompts)
        metrics |= selected
    metrics |= episode_metrics(trajectories) | {
        "reward/trained_mean": float(np.mean([r.reward for r in rollouts])),
        "completion/mean_tokens": float(np.mean([len(r.completion_ids) for r in rollouts])),
    }
    return ScoredBatch(index, version, rollouts, metrics)


class EpisodeBatches:
    """The generator step of the sync and lagged feeds (a `lagged.SampleBatch`): batch k's
    prompts, G episodes each, run with the `GeneratorParams` given (module docstring)."""

    def __init__(
        self,
        runner: EpisodeRunner,
        make_env: Callable[[], Environment],
        mask_observations: bool = True,
    ):
        self.runner, self.make_env = runner, make_env
        self.mask_observations = mask_observations

    def __call__(self, ctl: ControllerView, batch_index: int, params) -> ScoredBatch:
        c, k = ctl.config, batch_index
        items, _ = ctl.prompts(k)
        n, g = len(items), c.samples_per_prompt
        groups = [
            EpisodeGroup(j, item, [self.make_env() for _ in range(g)], group_id=k * n + j)
            for j, item in enumerate(items)
        ]
        start = time.perf_counter()
        key = sampling_key(c.seed, params.version, k)
        out = self.runner.run(params.params, key, groups, version=params.version)
        trajectories = [t for ts in out for t in ts]
        batch = _scored(
            c,
            k,
            params.version,
            trajectories,
            select=True,
            mask_observations=self.mask_observations,
        )
        batch.metrics["time/generate_s"] = time.perf_counter() - start
        return batch


class EpisodeGroups:
    """What the streaming generator runs per prompt (`streaming.PromptGroups`' interface):
    prompt i as G episodes, episode i, group id i, joining the running engine."""

    def __init__(
        self, ctl: ControllerView, runner: EpisodeRunner, make_env, mask_observations: bool = True
    ):
        self.controller, self.runner, self.make_env = ctl, runner, make_env
        self.mask_observations = mask_observations

    def submit(self, index: int) -> None:
        g = self.controller.config.samples_per_prompt
        item = self.controller.source.item(index)
        self.runner.start(EpisodeGroup(index, item, [self.make_env() for _ in range(g)]))

    def run(self, params, key, **engine_run) -> Iterator[ScoredBatch]:
        c = self.controller.config
        for trajectories in self.runner.stream(params, key, **engine_run):
            yield _scored(
                c,
                trajectories[0].episode,
                None,  # queued by the oldest version that sampled one of its tokens
                trajectories,
                select=False,
                mask_observations=self.mask_observations,
            )


class EpisodeFeed:
    """The schedule's feed with episodes as its generator step (module docstring).

    Args:
      controller: its generator's sampler must be the engine (`EngineSampler`).
      make_env: a fresh `Environment` per episode.
      budget: the episodes' `EpisodeBudget`.
      stop_ids: ids that end a turn for a tool call (added to the sampling config's).
      tool_workers: threads for environment steps (0: inline, so that the device calls, and
        with them the behaviour log-probs' last bits, are the same on every run: what makes
        sync and fixed-lag runs reproducible bit for bit).
      mask_observations: observation tokens out of the loss (False: the control experiment of
        training on the tool's replies too, `Trajectory.to_rollout`).
    """

    @staticmethod
    def latest_only(config: RLConfig) -> bool:
        return feed_class(config).latest_only(config)

    @staticmethod
    def engine_slots(config: RLConfig) -> int:
        return feed_class(config).engine_slots(config)

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
        self.runner = EpisodeRunner(engine, sampling, budget, tool_workers=tool_workers)
        if c.mode == "async" and c.schedule == "streaming":
            self.feed = StreamingFeed(
                controller,
                groups=EpisodeGroups(controller, self.runner, make_env, mask_observations),
            )
        else:  # sync (colocated), fixed lag, free running (lagged)
            self.feed = feed_class(c)(
                controller, sample=EpisodeBatches(self.runner, make_env, mask_observations)
            )
        self.timeline = self.feed.timeline
        # Evaluations: greedy episodes on the trainer's engine (in sync mode the same one).
        eval_sampler = getattr(controller, "eval_sampler", None) or controller.generator.sampler
        greedy = dataclasses.replace(sampling, greedy=True)
        eval_engine = getattr(eval_sampler, "engine", engine)
        self.eval_runner = EpisodeRunner(eval_engine, greedy, budget, tool_workers=tool_workers)

    def start(self, step: int, params, extra: dict | None) -> None:
        self.feed.start(step, params, extra)

    def take(self, step: int, params) -> Taken:
        return self.feed.take(step, params)

    def trained(self, step: int, params) -> dict[str, float]:
        return self.feed.trained(step, params)

    def snapshot(self, step: int) -> dict:
        return self.feed.snapshot(step)

    def stop(self, failed: bool) -> None:
        try:
            self.feed.stop(failed)
        finally:
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


def check_episode_job(config: RLConfig, budget: EpisodeBudget, source, roles=None) -> None:
    """Raises ValueError, naming the fix, when `config` cannot run `source`'s episodes (before
    any work: the feed itself is built after the SFT stage). `roles`: `rl_main.roles` of a
    job of several processes (role-split episodes are not supported)."""
    if roles is not None:
        raise ValueError(
            "multi-turn episodes run in sync, fixed-lag, free-running and streaming jobs whose "
            f"processes each run both roles; rl_main.roles={roles!r} (a role-split job) is not "
            "supported: unset rl_main.roles"
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

"""Multi-turn episodes on the continuous-batching engine: turns sampled, environments stepped off
the engine's thread, every continuation a request that joins the running batch.

An episode is a prompt, then model turns and environment observations in turn
(`jaxrl.env.base`). For a group of G episodes of one prompt:

* **Turn 1** is one engine `Request` of G samples: the prompt is prefilled once for the group.
* **Each later turn** of sample s is its own one-sample request whose prompt is the episode's
  whole history (prompt, turns, observations: the ids the engine sampled and the environment
  returned, never re-tokenised), submitted as soon as the observation it follows is there. It
  joins the running batch at the engine's next refill, so a short episode never waits for a long
  one, and a slow tool holds up only its own episode. By default (`continue_in_slot`) the
  episode's engine row keeps its slot and KV cache while the tool runs, and the request
  continues it there: only the observation runs through the model, in the engine's next decode
  call, not the whole history again (unless a queued group took the slot meanwhile).
* **Environment steps** run on a thread pool (`tool_workers`; 0 runs them inline on the
  engine's thread, in a fixed order). The driver collects finished steps before every device
  call (through `Engine.run`'s per-call `update` hook) and, when the engine has nothing left to
  decode, waits for the next one. An episode whose steps take longer than
  `EpisodeBudget.tool_timeout_s` in all ends with status "timeout" (its step is abandoned, its
  thread left to finish; a step still waiting for a free thread is not timed, and an inline
  step is timed when it returns); a step that raises ends its episode with status
  "tool_error". Either way the other episodes and the run go on.
* **Noise.** Turn k of sample s of episode e is drawn with request id
  `request_id(e, k, s)` (turn 1: the group's request `request_id(e, 0, 0)`, sample s), so every
  token's noise is a function of (the run's key, episode, turn, sample, token index) only
  (`jaxrl.generation.engine`): the same episodes give the same tokens and turn counts with any
  slot count, in any arrival order, however long the tools take. Behaviour log-probs are those
  of the tokens drawn; their last bits follow the shapes of the device calls (the engine's
  docstring), which only `tool_workers=0` keeps fixed from run to run.
* **Budgets** (`EpisodeBudget`): turns, tokens per turn, total tokens (prompt included) and
  observation tokens. An episode that would exceed one, or whose turn ran out of tokens without
  a stop id, ends with status "truncated".

What comes back per episode is a `Trajectory`: every token after the prompt with its loss mask
(True on sampled tokens, False on observations), behaviour log-probs (0 on observations) and
sampling versions (-1 on observations), the reward (sum of the steps'), the turn count and the
status. `Trajectory.to_rollout` is the trainer's view of it (`jaxrl.rl.rollout`: observations
attended, not trained; the G episodes of a prompt share a group id, so the episode reward is
normalised across them by the loss's advantage estimator).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np

from jaxrl.env.base import EPISODE_STATUSES, Environment, Step
from jaxrl.generation.engine import Engine, GroupResult, Request
from jaxrl.generation.sampling import SamplingConfig
from jaxrl.rl.rollout import Rollout
from jaxrl.tasks.source import PromptItem

# Request ids are (episode * max_turns + turn) * MAX_GROUP + sample: a fixed radix, so an
# episode's ids do not depend on the other groups' sizes or on the engine.
MAX_GROUP = 256
_INT32_MAX = 2**31 - 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class EpisodeBudget:
    """Limits of one episode.

    max_turns: model turns (engine requests). max_turn_tokens: a turn's max_new_tokens.
    max_total_tokens: prompt + turns + observations. max_observation_tokens: observations in all.
    tool_timeout_s: the environment time of an episode, all its steps together.
    """

    max_turns: int = 4
    max_turn_tokens: int = 16
    max_total_tokens: int = 128
    max_observation_tokens: int = 64
    tool_timeout_s: float = 30.0

    def __post_init__(self):
        for name in ("max_turns", "max_turn_tokens", "max_total_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"EpisodeBudget.{name}={getattr(self, name)}; must be >= 1")
        if self.max_observation_tokens < 0:
            raise ValueError(
                f"EpisodeBudget.max_observation_tokens={self.max_observation_tokens}; must be >= 0"
            )
        if not self.tool_timeout_s > 0:
            raise ValueError(f"EpisodeBudget.tool_timeout_s={self.tool_timeout_s}; must be > 0")


def binding_limit(max_total_tokens: int, engine) -> str:
    """The limit on an episode's tokens that binds, and how to raise it: the budget
    (`EpisodeBudget.max_total_tokens`), else the engine's context, which is
    `GeneratorConfig.max_len` when set, else the model's `max_position_embeddings`."""
    context = engine.max_capacity
    if max_total_tokens <= context:
        return (
            f"EpisodeBudget.max_total_tokens={max_total_tokens} (the engine's context is "
            f"{context}); raise EpisodeBudget.max_total_tokens"
        )
    model = getattr(getattr(engine, "model_config", None), "max_position_embeddings", None)
    if getattr(engine, "grows", True) and model is not None:
        return (
            f"the model's context, max_position_embeddings={model} (below "
            f"EpisodeBudget.max_total_tokens={max_total_tokens}): start from a model with a "
            "longer context (PolicySpec.init_from), or shorten the prompt"
        )
    limit = f" (the model's max_position_embeddings is {model})" if model is not None else ""
    return (
        f"the engine's context of {context} tokens, GeneratorConfig.max_len{limit}, below "
        f"EpisodeBudget.max_total_tokens={max_total_tokens}: raise GeneratorConfig.max_len"
    )


@dataclasses.dataclass(frozen=True)
class EpisodeGroup:
    """The G episodes of one prompt.

    episode: keys the episodes' noise (with turn and sample); unique within one `run` call.
    item: what each environment's `reset` gets. envs: one fresh environment per sample.
    group_id: the rollouts' group id (their shared baseline); default `episode`.
    """

    episode: int
    item: PromptItem
    envs: Sequence[Environment]
    group_id: int | None = None


@dataclasses.dataclass
class Trajectory:
    """One episode (module docstring). `tokens` are every id after the prompt, in order;
    `loss_mask`, `behaviour_logprobs` and `token_versions` are aligned with them.
    `step_statuses`: each environment step's own status ("ok", "malformed", ...).
    `status`: one of `EPISODE_STATUSES` (None while it runs)."""

    episode: int
    sample: int
    group_id: int
    prompt_ids: tuple[int, ...]
    tokens: list[int] = dataclasses.field(default_factory=list)
    loss_mask: list[bool] = dataclasses.field(default_factory=list)
    behaviour_logprobs: list[float] = dataclasses.field(default_factory=list)
    token_versions: list[int] = dataclasses.field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    status: str | None = None
    step_statuses: list[str] = dataclasses.field(default_factory=list)
    observation_tokens: int = 0
    tool_seconds: float = 0.0

    @property
    def history(self) -> list[int]:
        return [*self.prompt_ids, *self.tokens]

    def to_rollout(self, mask_observations: bool = True) -> Rollout:
        """The trainer's view: the completion is every token after the prompt, the loss mask
        its sampled tokens; `policy_version` the oldest version that sampled one of them.

        `mask_observations=False` (a control experiment, never for real training) puts the
        observation tokens in the loss as well, with their placeholder behaviour log-prob 0 and
        version -1: the tool's replies are then trained on as if the policy had written them.
        """
        versions = np.asarray(self.token_versions, np.int32)
        sampled_mask = np.asarray(self.loss_mask, bool)
        sampled = versions[sampled_mask]
        loss_mask = sampled_mask if mask_observations else np.ones_like(sampled_mask)
        return Rollout(
            prompt_ids=np.asarray(self.prompt_ids, np.int32),
            completion_ids=np.asarray(self.tokens, np.int32),
            behaviour_logprobs=np.asarray(self.behaviour_logprobs, np.float32),
            policy_version=int(sampled.min()) if len(sampled) else 0,
            reward=float(self.reward),
            group_id=int(self.group_id),
            token_versions=versions,
            loss_mask=loss_mask,
        )


def request_id(episode: int, turn: int, sample: int, max_turns: int) -> int:
    """The engine request id of turn `turn` (0-based) of sample `sample` of `episode` (turn 0:
    the group's request, `sample` 0)."""
    rid = (episode * max_turns + turn) * MAX_GROUP + sample
    if not 0 <= rid <= _INT32_MAX:
        raise ValueError(
            f"episode {episode} with max_turns={max_turns} gives request id {rid}, past int32; "
            "number a call's episodes from 0"
        )
    return rid


def episode_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """Means over episodes: reward, turns, tokens, the share of each status, of steps with a
    status other than "ok" and of "malformed" steps (a tool call that could not be read)."""
    n = max(len(trajectories), 1)
    steps = [s for t in trajectories for s in t.step_statuses]
    metrics = {
        "episode/reward_mean": sum(t.reward for t in trajectories) / n,
        "episode/turns_mean": sum(t.turns for t in trajectories) / n,
        "episode/sampled_tokens_mean": sum(sum(t.loss_mask) for t in trajectories) / n,
        "episode/observation_tokens_mean": sum(t.observation_tokens for t in trajectories) / n,
        "episode/bad_step_fraction": sum(s != "ok" for s in steps) / max(len(steps), 1),
        "episode/malformed_step_fraction": steps.count("malformed") / max(len(steps), 1),
    }
    for status in EPISODE_STATUSES:
        metrics[f"episode/{status}_fraction"] = sum(t.status == status for t in trajectories) / n
    return metrics


@dataclasses.dataclass
class _Call:
    """A step on the pool: its episode, and when the worker started and ended it."""

    trajectory: Trajectory
    env: Environment
    future: concurrent.futures.Future
    started: float | None = None
    ended: float | None = None
    waited: bool = False  # the driver has waited `tool_grace_s` for it once


class EpisodeRunner:
    """Runs groups of episodes on `engine` (module docstring).

    Args:
      engine: the `Engine` (its `submit`, `run`, `cancel`, `reset`, `num_slots`,
        `max_capacity` and `eos_ids` are used; it must have nothing queued).
      sampling: every turn's sampling config; its `stop_ids` end a turn for a tool call (EOS
        ends one too unless `ignore_eos`). `max_new_tokens` is unused: turns take
        `budget.max_turn_tokens`.
      budget: the `EpisodeBudget`.
      tool_workers: threads that run environment steps (0: inline, in a fixed order).
      continue_in_slot: each later turn continues its episode's engine row in place
        (`Request.keep_cache` / `continues`: the row's slot and KV cache are kept while the
        tool runs, and only the observation runs through the model); False: the turn is a new
        request whose whole history is prefilled again. Same tokens either way.
      tool_grace_s: before each device call the driver waits up to this long for the steps
        started since the last one, so a fast tool's reply joins that call instead of the next
        (0: no wait; a slow tool costs at most this once per step).
    """

    def __init__(
        self,
        engine: Engine,
        sampling: SamplingConfig,
        budget: EpisodeBudget,
        *,
        tool_workers: int = 8,
        continue_in_slot: bool = True,
        tool_grace_s: float = 0.005,
    ):
        if tool_workers < 0:
            raise ValueError(f"tool_workers={tool_workers}; must be >= 0 (0: inline)")
        if tool_grace_s < 0:
            raise ValueError(f"tool_grace_s={tool_grace_s}; must be >= 0 (0: no wait)")
        self.engine, self.sampling, self.budget = engine, sampling, budget
        self.continue_in_slot = continue_in_slot
        self.tool_grace_s = float(tool_grace_s)
        self.stop_ids = set(sampling.stop_ids)
        if not sampling.ignore_eos:
            self.stop_ids |= set(engine.eos_ids)
        self.pool = (
            concurrent.futures.ThreadPoolExecutor(tool_workers, thread_name_prefix="jaxrl-tool")
            if tool_workers
            else None
        )
        self._waiting: dict[int, list[tuple[Trajectory, Environment]]] = {}
        self._envs: dict[tuple[int, int], Environment] = {}  # (episode, sample) -> its env
        self._calls: list[_Call] = []
        self._groups: dict[int, list[Trajectory]] = {}  # episode -> its running group
        self._touched: set[int] = set()  # episodes with a turn or step finished since `_ended`
        # (episode, sample) -> (its trajectory, the engine row it continues from)
        self._rows: dict[tuple[int, int], tuple[Trajectory, tuple[int, int]]] = {}

    def close(self) -> None:
        """Stops the tool threads (steps still running are abandoned)."""
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)

    # --- one call -----------------------------------------------------------------------------

    def run(
        self,
        params: Any,
        key: jax.Array,
        groups: Sequence[EpisodeGroup],
        *,
        version: int = 0,
        update: Callable[[int], tuple[int, Any] | None] | None = None,
        kv_on_update: str = "keep",
    ) -> list[list[Trajectory]]:
        """Runs every episode of `groups` to its end; returns their trajectories, group by group
        in the order given, samples in order. `version`, `update`, `kv_on_update`: as for
        `Engine.run` (an episode may then span versions; each token records its own)."""
        episodes = [g.episode for g in groups]
        if len(set(episodes)) != len(episodes):
            raise ValueError(f"episode numbers must be unique within a call; got {episodes}")
        try:
            out = [self.start(group) for group in groups]
        except BaseException:
            self._reset()
            raise
        for _ in self.stream(
            params, key, version=version, update=update, kv_on_update=kv_on_update
        ):
            pass
        return out

    def start(self, group: EpisodeGroup) -> list[Trajectory]:
        """Starts `group`'s episodes (turn 1 queued on the engine) and returns their
        trajectories (filled in as they run). Between `stream`'s yields too: they join the
        running batch."""
        if group.episode in self._groups:
            raise ValueError(f"episode {group.episode} is already running")
        trajectories = self._start(group)
        self._groups[group.episode] = trajectories
        return trajectories

    def stream(
        self,
        params: Any,
        key: jax.Array,
        *,
        version: int = 0,
        update: Callable[[int], tuple[int, Any] | None] | None = None,
        kv_on_update: str = "keep",
    ) -> Iterator[list[Trajectory]]:
        """Runs the started episodes, yielding each group's trajectories (samples in order) as
        its last episode ends; groups started meanwhile join. Ends when none is left.
        `version`, `update`, `kv_on_update`: as for `run`."""
        self._current = (version, params)

        def hook(current_version: int):
            fresh = [c.future for c in self._calls if not c.waited]
            if fresh and self.tool_grace_s > 0:  # fast tools' replies join this very call
                concurrent.futures.wait(fresh, timeout=self.tool_grace_s)
            for c in self._calls:
                c.waited = True
            self._poll()
            self._release_ended()
            swapped = None if update is None else update(current_version)
            if swapped is not None:
                self._current = swapped
            return swapped

        try:
            while self._groups:
                v, p = self._current
                for result in self.engine.run(
                    p, key, version=v, update=hook, kv_on_update=kv_on_update
                ):
                    self._finish_turn(result)
                    yield from self._ended()
                yield from self._ended()
                if not self._calls:
                    if self._groups and not self._waiting:
                        raise RuntimeError("episodes left with no request and no step running")
                    continue
                self._wait()
                yield from self._ended()
        finally:
            self._reset()

    def _ended(self) -> Iterator[list[Trajectory]]:
        """The groups whose episodes have all ended, in the order they were started (only
        groups with a turn or step finished since the last look can have)."""
        touched, self._touched = self._touched, set()
        for episode in [e for e in self._groups if e in touched]:
            trajectories = self._groups[episode]
            if all(t.status is not None for t in trajectories):
                del self._groups[episode]
                for s in range(len(trajectories)):
                    self._envs.pop((episode, s), None)
                yield trajectories

    def _reset(self) -> None:
        """Leaves the engine and the driver empty (steps still running are abandoned)."""
        self.engine.reset()
        for call in self._calls:
            call.future.cancel()
        self._calls, self._waiting, self._envs, self._groups, self._rows = [], {}, {}, {}, {}
        self._touched = set()

    def _start(self, group: EpisodeGroup) -> list[Trajectory]:
        b = self.budget
        g = len(group.envs)
        if not 1 <= g <= MAX_GROUP:
            raise ValueError(f"episode {group.episode}: {g} environments; need 1..{MAX_GROUP}")
        prompts = [tuple(int(t) for t in env.reset(group.item)) for env in group.envs]
        if len(set(prompts)) != 1:
            raise ValueError(
                f"episode {group.episode}: the {g} environments' reset() gave different prompts; "
                "a group's samples share one prompt (one prefill)"
            )
        prompt = prompts[0]
        room = min(b.max_total_tokens, self.engine.max_capacity) - len(prompt)
        if room < 1:
            raise ValueError(
                f"episode {group.episode}: a prompt of {len(prompt)} tokens leaves no room in "
                f"{binding_limit(b.max_total_tokens, self.engine)}"
            )
        group_id = group.episode if group.group_id is None else group.group_id
        trajectories = [Trajectory(group.episode, s, group_id, prompt) for s in range(g)]
        rid = request_id(group.episode, 0, 0, b.max_turns)
        self._waiting[rid] = list(zip(trajectories, group.envs, strict=True))
        self._envs |= {(group.episode, s): env for s, env in enumerate(group.envs)}
        self.engine.submit(
            Request(
                rid,
                prompt,
                g,
                self.sampling,
                max_new_tokens=min(b.max_turn_tokens, room),
                keep_cache=self.continue_in_slot,
                per_sample=True,
            )
        )
        return trajectories

    def _finish_turn(self, result: GroupResult) -> None:
        """A turn's tokens are in: record them, then step the environment (or end the
        episode if the turn ran out of tokens before a stop id)."""
        waiting = self._waiting[result.request_id]
        samples = range(len(waiting)) if result.samples is None else result.samples
        for row, g in enumerate(samples):
            trajectory, env = waiting[g]
            waiting[g] = None
            self._touched.add(trajectory.episode)
            n = int(result.mask_gn[row].sum())
            ids = [int(t) for t in result.tokens_gn[row, :n]]
            trajectory.tokens += ids
            trajectory.loss_mask += [True] * n
            trajectory.behaviour_logprobs += [float(x) for x in result.logprobs_gn[row, :n]]
            versions = result.versions_gn
            trajectory.token_versions += (
                [int(v) for v in versions[row, :n]] if versions is not None else [0] * n
            )
            trajectory.turns += 1
            if self.continue_in_slot:
                self._rows[trajectory.episode, trajectory.sample] = (
                    trajectory,
                    (result.request_id, g),
                )
            if not ids or ids[-1] not in self.stop_ids:
                trajectory.status = "truncated"
            elif self.pool is None:
                self._step_inline(trajectory, env, ids)
            else:
                call = _Call(trajectory, env, concurrent.futures.Future())
                call.future = self.pool.submit(self._timed_step, call, ids)
                self._calls.append(call)
        if all(w is None for w in waiting):
            del self._waiting[result.request_id]

    @staticmethod
    def _timed_step(call: _Call, ids: list[int]) -> Step:
        call.started = time.monotonic()
        try:
            return call.env.step(ids)
        finally:
            call.ended = time.monotonic()

    def _step_inline(self, trajectory: Trajectory, env: Environment, ids: list[int]) -> None:
        start = time.monotonic()
        try:
            step = env.step(ids)
        except Exception:
            trajectory.status = "tool_error"
            return
        trajectory.tool_seconds += time.monotonic() - start
        if trajectory.tool_seconds > self.budget.tool_timeout_s:
            trajectory.status = "timeout"
            return
        self._apply(trajectory, step)

    def _release_ended(self) -> None:
        """Frees the engine rows kept for episodes that have ended."""
        for key, (trajectory, row) in list(self._rows.items()):
            if trajectory.status is not None:
                self.engine.release(*row)
                del self._rows[key]

    def _poll(self) -> None:
        """Applies the finished steps and times out the overdue ones (on the driver's thread)."""
        now, still = time.monotonic(), []
        for call in self._calls:
            t = call.trajectory
            self._touched.add(t.episode)  # a step finished or overdue, or none: checked once
            if call.future.done():
                error = call.future.exception()
                if error is not None:
                    t.status = "tool_error"
                    continue
                t.tool_seconds += call.ended - call.started
                if t.tool_seconds > self.budget.tool_timeout_s:
                    t.status = "timeout"
                    continue
                self._apply(t, call.future.result())
            elif call.started is not None and t.tool_seconds + now - call.started > (
                self.budget.tool_timeout_s
            ):
                t.status = "timeout"  # abandoned: its thread finishes on its own
            else:
                still.append(call)
        self._calls = still

    def _wait(self) -> None:
        """The engine is idle: waits for the first step to finish or to become overdue."""
        now = time.monotonic()
        deadlines = [
            c.started + self.budget.tool_timeout_s - c.trajectory.tool_seconds
            for c in self._calls
            if c.started is not None
        ]
        timeout = min(deadlines, default=now + 0.01) - now
        concurrent.futures.wait(
            [c.future for c in self._calls],
            timeout=min(max(timeout, 0.0), 1.0),
            return_when=concurrent.futures.FIRST_COMPLETED,
        )  # the steps still running get `tool_grace_s` before the next device call
        self._poll()

    def _apply(self, trajectory: Trajectory, step: Step) -> None:
        """A step's answer: end the episode, or append the observation and queue the next
        turn, within the budgets."""
        b = self.budget
        reward = float(step.reward)
        if not math.isfinite(reward):
            trajectory.status = "tool_error"
            return
        trajectory.reward += reward
        trajectory.step_statuses.append(str(step.status))
        if step.done:
            trajectory.status = "done"
            return
        observation = [int(t) for t in step.observation]
        room = (
            min(b.max_total_tokens, self.engine.max_capacity)
            - len(trajectory.prompt_ids)
            - len(trajectory.tokens)
            - len(observation)
        )
        if (
            trajectory.turns >= b.max_turns
            or trajectory.observation_tokens + len(observation) > b.max_observation_tokens
            or room < 1
        ):
            trajectory.status = "truncated"
            return
        trajectory.tokens += observation
        trajectory.loss_mask += [False] * len(observation)
        trajectory.behaviour_logprobs += [0.0] * len(observation)
        trajectory.token_versions += [-1] * len(observation)
        trajectory.observation_tokens += len(observation)
        rid = request_id(trajectory.episode, trajectory.turns, trajectory.sample, b.max_turns)
        self._waiting[rid] = [(trajectory, self._envs[trajectory.episode, trajectory.sample])]
        kept = self._rows.pop((trajectory.episode, trajectory.sample), None)
        self.engine.submit(
            Request(
                rid,
                tuple(trajectory.history),
                1,
                self.sampling,
                max_new_tokens=min(b.max_turn_tokens, room),
                keep_cache=self.continue_in_slot,
                continues=None if kept is None else kept[1],
                per_sample=True,
            )
        )

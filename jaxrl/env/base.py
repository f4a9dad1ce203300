"""What a multi-turn episode talks to: an environment on token ids.

An episode alternates model turns and environment observations:

    prompt = env.reset(item)                 the ids the first turn is conditioned on
    turn_1 = the engine's sample, stopped by a stop id (a tool call's closing token) or EOS
    step_1 = env.step(turn_1)                observation ids to append, reward, done, status
    turn_2 = sampled after prompt + turn_1 + step_1.observation
    ...                                      until a step says done, or a budget runs out

The environment works on ids and answers with ids, already in the form they are appended in
(with a chat template: the template's delta for a tool message, end-of-turn and next-header
tokens included). It may decode a turn to parse it, but what it returns is appended as is, and
the driver never re-tokenises the conversation: the ids the trainer sees are exactly the ids the
engine sampled and the ids the environment appended (re-rendering text to ids is where other
frameworks' trainers came to see different tokens than were sampled).

One `Environment` object serves one episode (the driver builds G per prompt group, one per
sample), so an environment keeps its episode's state in plain attributes; `step` may run on a
worker thread (the driver runs tools off the engine's thread), never on two at once for one
episode.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from jaxrl.tasks.source import PromptItem

# How an episode ended. done: a step said so. truncated: a budget ran out (turns, total tokens,
# observation tokens, or a turn's tokens without a stop). tool_error: `step` raised.
# timeout: the episode's steps took longer than its tool time budget.
EPISODE_STATUSES = ("done", "truncated", "tool_error", "timeout")


@dataclasses.dataclass(frozen=True)
class Step:
    """An environment's answer to one model turn.

    observation: ids appended after the turn (attended by later turns, never trained); ignored
      when `done`.
    reward: added to the episode's reward (the episode reward is the sum over its steps).
    done: the episode ends after this turn.
    status: the step's own verdict, recorded per turn (`Trajectory.step_statuses`): "ok", or
      what went wrong without ending the episode (e.g. "malformed": an error observation).
    """

    observation: Sequence[int] = ()
    reward: float = 0.0
    done: bool = False
    status: str = "ok"


@runtime_checkable
class Environment(Protocol):
    """One episode's environment (module docstring)."""

    def reset(self, item: PromptItem) -> Sequence[int]:
        """The prompt ids of the episode of `item` (the G episodes of a group must agree)."""
        ...

    def step(self, turn_ids: Sequence[int]) -> Step:
        """The answer to the model's turn `turn_ids` (its stop token included)."""
        ...

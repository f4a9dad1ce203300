"""Reward registry: verifiable rewards and user reward models, selected by name from config.

A reward function scores a batch of completions:

    reward(prompts: Sequence[str], completions: Sequence[str],
           references: Sequence[str | None]) -> Sequence[float]  (one finite float per completion)

`completions` are decoded without special tokens (`decode_completions`: no `<eos>`, no padding).
`references` are the task's gold answers (None when a task has none, e.g. for a reward model).
Register a batched callable (a reward model that scores the batch in one forward pass) as is, or a
per-sample function `fn(prompt, completion, reference) -> float` with `per_sample=True`:

    @register_reward("length_penalty", per_sample=True)
    def length_penalty(prompt, completion, reference):
        return -len(completion) / 1000

    register_reward("my_rm", MyRewardModel(...))        # batched callable

`compute_rewards(name_or_fn, ...)` runs one and checks the result: one finite value per
completion, or a `RewardError` naming the reward. Built-in rewards only parse text (see
`jaxrl.tasks.answers`); nothing in this package evaluates model output.

Built-ins: "arithmetic_exact" (exact integer answer, `jaxrl.tasks.arithmetic`), "chain_sum_exact"
(the last partial sum of a chain, `jaxrl.tasks.chain`), "chain_sum_partial" (the same, with
partial credit under 0.5 for the right leading partial sums of a wrong answer) and
"math_answer" (final answer of a GSM8K / MATH completion equals the reference after numeric
normalisation) and "reasoning_gym" (the reply's final answer scored by the reasoning-gym
dataset's own `score_answer`, `jaxrl.tasks.reasoning_gym`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from jaxrl.infra.errors import UserError
from jaxrl.tasks.answers import answers_match, extract_answer
from jaxrl.tasks.arithmetic import arithmetic_reward
from jaxrl.tasks.chain import chain_partial_reward, chain_reward
from jaxrl.tasks.math_jsonl import reference_answer
from jaxrl.tasks.reasoning_gym import score_reply


class RewardFunction(Protocol):
    """A batched reward: one finite float per completion. `completions` are decoded without
    special tokens; `references` are the source's gold answers (None where it has none). A
    reward model object with this `__call__` works as well as a function. Register it with
    `register_reward(name, fn)` in a module the gin file imports, or name it in `TaskSpec.reward`
    as "package.module:function"."""

    def __call__(
        self,
        prompts: Sequence[str],
        completions: Sequence[str],
        references: Sequence[str | None],
    ) -> Sequence[float] | np.ndarray: ...


class RewardError(UserError, RuntimeError):
    """A reward function raised, or returned something unusable."""

    kind = "reward error"


@dataclasses.dataclass(frozen=True)
class PerSampleReward:
    """Batched adapter for `fn(prompt, completion, reference) -> float`."""

    fn: Callable[[str, str, str | None], float]

    def __call__(self, prompts, completions, references):
        return [self.fn(p, c, r) for p, c, r in zip(prompts, completions, references, strict=True)]


_REGISTRY: dict[str, RewardFunction] = {}


def register_reward(
    name: str,
    fn: Callable | None = None,
    *,
    per_sample: bool = False,
    overwrite: bool = False,
):
    """Register `fn` under `name`; without `fn`, returns a decorator. Returns `fn` unchanged.

    Re-registering a name raises unless `overwrite=True`, so two plug-ins cannot silently shadow
    each other.
    """

    def register(fn):
        if not callable(fn):
            raise TypeError(f"reward {name!r} must be callable, got {type(fn).__name__}")
        if name in _REGISTRY and not overwrite:
            raise ValueError(f"reward {name!r} is already registered; pass overwrite=True")
        _REGISTRY[name] = PerSampleReward(fn) if per_sample else fn
        return fn

    if not isinstance(name, str) or not name:
        raise ValueError(f"reward name must be a non-empty string, got {name!r}")
    return register if fn is None else register(fn)


def get_reward(name: str) -> RewardFunction:
    """A registered reward, or `"package.module:attribute"`: a batched reward function (or a
    module-level reward model object) imported from the user's own code, so a config can name a
    reward that lives outside this library without a registration step."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    if ":" in name:
        from jaxrl.infra.user_code import import_user_callable

        return import_user_callable(name, "reward")
    raise KeyError(
        f"unknown reward {name!r}; registered: {list_rewards()} (or name a function as "
        "'package.module:function')"
    )


def user_reward_error(reward, error: Exception, where: str) -> RewardError:
    """The `RewardError` for a user's reward that raised `error` while scoring `where` (e.g.
    "batch 3", "evaluation"): the reward's name, the exception and the user's line that raised
    it, in one line (`jaxrl.infra.launcher.user_error_line`)."""
    from jaxrl.infra.user_code import raised_at

    name = reward if isinstance(reward, str) else getattr(reward, "__name__", repr(reward))
    wrapped = RewardError(
        f"reward {name!r} raised {type(error).__name__}: {error} ({where}) at {raised_at(error)}"
    )
    wrapped.from_user_code = True
    return wrapped


def list_rewards() -> list[str]:
    return sorted(_REGISTRY)


def compute_rewards(
    reward: str | RewardFunction,
    prompts: Sequence[str],
    completions: Sequence[str],
    references: Sequence[str | None] | None = None,
) -> np.ndarray:
    """Score a batch with a registered (by name) or given reward; returns float32 `[N]`."""
    name = reward if isinstance(reward, str) else getattr(reward, "__name__", repr(reward))
    fn = get_reward(reward) if isinstance(reward, str) else reward
    n = len(completions)
    references = [None] * n if references is None else references
    if not len(prompts) == len(references) == n:
        raise ValueError(
            f"reward {name!r}: {len(prompts)} prompts, {n} completions and "
            f"{len(references)} references; expected one of each per sample"
        )
    try:
        scores = np.asarray(fn(prompts, completions, references), dtype=np.float32)
    except (TypeError, ValueError) as e:
        raise RewardError(f"reward {name!r} did not return numbers: {e}") from e
    if scores.shape != (n,):
        raise RewardError(f"reward {name!r} returned shape {scores.shape}, expected ({n},)")
    if not np.all(np.isfinite(scores)):
        raise RewardError(f"reward {name!r} returned non-finite values: {scores}")
    return scores


def decode_completions(tokenizer, completion_ids: Sequence[Sequence[int]]) -> list[str]:
    """The text reward functions see: each completion (its sampled ids, stop token included)
    decoded without special tokens, so `"82<eos>"` reads `"82"`."""
    return tokenizer.batch_decode(
        [np.asarray(ids).tolist() for ids in completion_ids], skip_special_tokens=True
    )


def _math_answer(prompt: str, completion: str, reference: str | None) -> float:
    del prompt
    if reference is None:
        return 0.0
    # Accept a full worked solution as the reference as well as a bare answer.
    gold = reference_answer(reference) or reference
    return float(answers_match(extract_answer(completion), gold))


register_reward("arithmetic_exact", lambda p, c, r: arithmetic_reward(c, r), per_sample=True)
register_reward("math_answer", _math_answer, per_sample=True)
register_reward("chain_sum_exact", lambda p, c, r: chain_reward(c, r), per_sample=True)
register_reward("chain_sum_partial", chain_partial_reward, per_sample=True)
register_reward("reasoning_gym", lambda p, c, r: score_reply(c, r), per_sample=True)

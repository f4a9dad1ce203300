"""A calculator tool for multiplication problems, with the character tokenizer, offline.

The model calls the tool by writing an expression in parentheses; generation stops at `)` (a
stop id of every request), the environment appends `=` and the value, and the model goes on:

    prompt   <bos>37*48=
    turn 1   (37*48)            sampled, trained
    step 1   =1776              appended by the environment, attended, not trained
    turn 2   1776<eos>          sampled, trained; reward 1 when it is the answer

The chained variant `a*b+c*d` takes more turns (`(12*34)` `=408` `(56*78)` `=4368`
`(408+4368)` `=4776` `4776<eos>` in its demonstrations).

The tool is `calculate`, a bounded parser (digits and `* + -` only, `MAX_EXPRESSION_CHARS`
characters, `*` before `+ -`), never `eval`. A call it cannot parse gets the observation
`=error` and the step status "malformed" (the episode goes on); any other exception of the tool
propagates, and the driver ends that episode with status "tool_error". `disabled=True` answers
every call with `=?` (the control experiment of a tool that gives nothing away;
`TaskSpec.tool_disabled` in a config).
"""

from __future__ import annotations

import dataclasses
import re
import threading
from collections.abc import Callable, Sequence

import numpy as np

from jaxrl.env.base import Step
from jaxrl.tasks.arithmetic import arithmetic_reward, hash_u64
from jaxrl.tasks.source import PromptItem, register_task

MAX_EXPRESSION_CHARS = 32
ERROR_REPLY = "=error"
DISABLED_REPLY = "=?"
_EXPRESSION = re.compile(r"[0-9]{1,9}(?:[*+-][0-9]{1,9})*")
# Fast tokenizers are not safe to call from several threads at once; steps run on a pool.
_TOKENIZER_LOCK = threading.Lock()


class CalculatorError(ValueError):
    """The expression is not one the calculator reads."""


def calculate(expression: str) -> int:
    """The value of `expression`: non-negative integers of at most 9 digits joined by `*`, `+`
    and `-`, at most `MAX_EXPRESSION_CHARS` characters, `*` binding tighter. Raises
    `CalculatorError` for anything else (no spaces, parentheses, unary signs or names)."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"{len(expression)} characters > {MAX_EXPRESSION_CHARS}")
    if not _EXPRESSION.fullmatch(expression):
        raise CalculatorError(f"not digits joined by * + -: {expression!r}")
    total, sign = 0, 1
    for term in re.split(r"([+-])", expression):
        if term in "+-":
            sign = 1 if term == "+" else -1
            continue
        product = 1
        for factor in term.split("*"):
            product *= int(factor)
        total += sign * product
    return total


def calculator_stop_ids(tokenizer) -> tuple[int, ...]:
    """The stop id that ends a tool call (`)`), for the episodes' `SamplingConfig.stop_ids`."""
    return (tokenizer.convert_tokens_to_ids(")"),)


class CalculatorEnv:
    """One calculator episode (module docstring). `tool`: the function calls are evaluated
    with (default `calculate`; tests pass raising or slow ones)."""

    def __init__(
        self, tokenizer, *, tool: Callable[[str], int] = calculate, disabled: bool = False
    ):
        self.tokenizer, self.tool, self.disabled = tokenizer, tool, disabled
        (self.close_id,) = calculator_stop_ids(tokenizer)
        self.reference: str | None = None
        # A fast tokenizer's Rust backend directly (the same ids and text, a few microseconds
        # a call instead of tens): the environment steps once per turn of every episode.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        plain = not getattr(tokenizer, "clean_up_tokenization_spaces", False)
        self._backend = backend if plain else None

    def _encode(self, text: str, special: bool = False) -> list[int]:
        with _TOKENIZER_LOCK:
            if self._backend is not None:
                return self._backend.encode(text, add_special_tokens=special).ids
            return list(self.tokenizer.encode(text, add_special_tokens=special))

    def _decode(self, ids: Sequence[int]) -> str:
        with _TOKENIZER_LOCK:
            if self._backend is not None:
                return self._backend.decode(list(ids), skip_special_tokens=True)
            return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def reset(self, item: PromptItem) -> list[int]:
        self.reference = item.reference
        return self._encode(item.text, special=True)  # <bos> first

    def step(self, turn_ids: Sequence[int]) -> Step:
        ids = [int(t) for t in turn_ids]
        if not ids or ids[-1] != self.close_id:  # a final answer (ended by <eos>)
            return Step(reward=arithmetic_reward(self._decode(ids), self.reference), done=True)
        text = self._decode(ids)
        start = text.rfind("(")
        if start < 0:
            return Step(self._encode(ERROR_REPLY), status="malformed")
        if self.disabled:
            return Step(self._encode(DISABLED_REPLY))
        try:
            value = self.tool(text[start + 1 : -1])
        except CalculatorError:
            return Step(self._encode(ERROR_REPLY), status="malformed")
        return Step(self._encode(f"={value}"))


def _digit_range(min_digits: int, max_digits: int) -> tuple[int, int]:
    """The smallest and largest operand of `min_digits` to `max_digits` digits (0 included
    from one digit)."""
    return (0 if min_digits == 1 else 10 ** (min_digits - 1)), 10**max_digits - 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class CalculatorTask:
    """Multiplication problems `a*b=` (or, `chained`, `a*b+c*d=`) with operands of
    `min_digits` to `max_digits` digits, drawn from hashes of (seed, split, index): item i is a
    pure function of the fields and i, and the held-out split (`heldout_fraction` of the hash
    range) is disjoint from the train one.

    min_digits_b, max_digits_b: the second factor's own digit range (b in a*b, and d in
      a*b+c*d), e.g. 3-digit x 2-digit products; None: the first factor's range.

    tool_share: the fraction of SFT demonstrations that use the tool (the rest answer
      directly), so that a warm start calls the tool rarely and RL has tool use to learn.
    """

    min_digits: int = 2
    max_digits: int = 2
    chained: bool = False
    heldout_fraction: float = 0.1
    tool_share: float = 0.1
    seed: int = 0
    min_digits_b: int | None = None
    max_digits_b: int | None = None

    def __post_init__(self):
        if not 1 <= self.min_digits <= self.max_digits <= 4:
            raise ValueError(
                f"need 1 <= min_digits <= max_digits <= 4; got {self.min_digits}, {self.max_digits}"
            )
        low_b, high_b = self.digits_b
        if not 1 <= low_b <= high_b <= 4:
            raise ValueError(
                f"need 1 <= min_digits_b <= max_digits_b <= 4; got {low_b}, {high_b} (None: the "
                "first factor's min_digits / max_digits)"
            )
        if not 0.0 < self.heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction must be in (0, 1), got {self.heldout_fraction}")
        if not 0.0 <= self.tool_share <= 1.0:
            raise ValueError(f"tool_share must be in [0, 1], got {self.tool_share}")

    @property
    def digits_b(self) -> tuple[int, int]:
        """The second factor's (min, max) digits."""
        low = self.min_digits if self.min_digits_b is None else self.min_digits_b
        return low, self.max_digits if self.max_digits_b is None else self.max_digits_b

    def operands(self, index: int, split: str) -> tuple[int, ...]:
        ranges = [_digit_range(self.min_digits, self.max_digits), _digit_range(*self.digits_b)]
        count = 4 if self.chained else 2
        for attempt in range(10_000):
            h = hash_u64("calculator", self.seed, split, index, attempt)
            values = []
            for position in range(count):
                low, high = ranges[position % 2]
                values.append(low + h % (high - low + 1))
                h //= high - low + 1
            heldout = hash_u64("heldout", self.seed, *values) < self.heldout_fraction * 2.0**64
            if heldout == (split == "heldout"):
                return tuple(values)
        raise RuntimeError(f"no {split} problem in 10000 draws; change heldout_fraction")

    def text(self, values: Sequence[int]) -> str:
        a, b, *rest = values
        return f"{a}*{b}+{rest[0]}*{rest[1]}=" if rest else f"{a}*{b}="

    @staticmethod
    def answer(values: Sequence[int]) -> int:
        a, b, *rest = values
        return a * b + (rest[0] * rest[1] if rest else 0)

    def turns(self, values: Sequence[int], tool: bool) -> list[tuple[str, bool]]:
        """A demonstration as (text, trained) pieces after the prompt."""
        answer = f"{self.answer(values)}"
        if not tool:
            return [(answer, True)]
        a, b, *rest = values
        pieces = [(f"({a}*{b})", True), (f"={a * b}", False)]
        if rest:
            c, d = rest
            pieces += [(f"({c}*{d})", True), (f"={c * d}", False)]
            pieces += [(f"({a * b}+{c * d})", True), (f"={a * b + c * d}", False)]
        return [*pieces, (answer, True)]


class CalculatorSource:
    """The calculator task as a `PromptSource` (train items, held-out items, SFT
    demonstrations with `tool_share` of them using the tool); episodes of its items run in
    `CalculatorEnv`s (`make_env`, with `stop_ids` ending a call). Registered as the task
    "calculator" (`TaskSpec.operators` "*": a*b, "*+": the chained a*b+c*d)."""

    chat_formatted = False
    reward_name = "arithmetic_exact"  # single-turn scoring of a final answer

    def __init__(self, task: CalculatorTask, tokenizer=None, *, tool_disabled: bool = False):
        self.task, self.tokenizer, self.tool_disabled = task, tokenizer, tool_disabled

    def _item(self, index: int, split: str) -> PromptItem:
        values = self.task.operands(index, split)
        return PromptItem(self.task.text(values), str(self.task.answer(values)))

    def item(self, index: int) -> PromptItem:
        return self._item(index, "train")

    def eval_items(self, limit: int) -> list[PromptItem]:
        return [self._item(i, "heldout") for i in range(limit)]

    def make_env(self, **kwargs) -> CalculatorEnv:
        """A fresh environment; `tool_disabled` (the source's) unless `disabled` is given."""
        return CalculatorEnv(self.tokenizer, **{"disabled": self.tool_disabled, **kwargs})

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return calculator_stop_ids(self.tokenizer)

    def uses_tool(self, index: int) -> bool:
        """Whether train item `index`'s demonstration calls the tool (`tool_share` of them)."""
        return hash_u64("tool", self.task.seed, index) < self.task.tool_share * 2.0**64

    def demonstrations(self, start: int, count: int, tokenizer, seq_len: int, pool: int = 0):
        """SFT batch `(tokens_bs, loss_mask_bs)` of train items [start, start + count) (cycled
        through [0, pool) when `pool`): the loss on the model's pieces and `<eos>`, not on the
        prompt or the tool's replies."""
        tokens = np.full((count, seq_len), tokenizer.pad_token_id, np.int32)
        loss_mask = np.zeros((count, seq_len), bool)
        for row, index in enumerate(range(start, start + count)):
            index = index % pool if pool else index
            values = self.task.operands(index, "train")
            ids = list(tokenizer.encode(self.task.text(values)))
            trained = [False] * len(ids)
            for text, train in self.task.turns(values, self.uses_tool(index)):
                piece = tokenizer.encode(text, add_special_tokens=False)
                ids += piece
                trained += [train] * len(piece)
            ids.append(tokenizer.eos_token_id)
            trained.append(True)
            if len(ids) > seq_len:
                raise ValueError(f"a demonstration needs {len(ids)} tokens > seq_len={seq_len}")
            tokens[row, : len(ids)], loss_mask[row, : len(ids)] = ids, trained
        return tokens, loss_mask


def calculator_task(spec, name: str = "calculator") -> CalculatorTask:
    """The problems of a `TaskSpec` for task `name`: its digits (the second factor's
    `min_digits_b` / `max_digits_b`), seed and `operators` ("*": a*b, "*+": the chained
    a*b+c*d)."""
    if spec.operators not in ("*", "*+"):
        raise ValueError(
            f"task {name}: TaskSpec.operators={spec.operators!r}; use '*' (a*b) or '*+' "
            "(the chained a*b+c*d)"
        )
    return CalculatorTask(
        min_digits=spec.min_digits,
        max_digits=spec.max_digits,
        min_digits_b=spec.min_digits_b,
        max_digits_b=spec.max_digits_b,
        chained=spec.operators == "*+",
        seed=spec.seed,
    )


def _calculator(spec, tokenizer) -> CalculatorSource:
    """The "calculator" task of a `TaskSpec` (`calculator_task`), with `tool_disabled` (every
    call answered `=?`: the control of a tool that gives nothing away)."""
    task = calculator_task(spec)
    return CalculatorSource(task, tokenizer, tool_disabled=spec.tool_disabled)


register_task("calculator", _calculator)

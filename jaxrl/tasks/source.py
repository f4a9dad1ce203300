"""Prompt sources: deterministic, index-addressed streams of (prompt, reference) items.

Item `i` of a source is a pure function of (source config, i), so a run's data position is just
the next index: a resumed run continues exactly where the interrupted one stopped, with no
prompt skipped or repeated.

A source is anything with the `PromptSource` methods. Sources are built by name from a
`TaskSpec` (`jaxrl.job.specs.build_source`) through a registry that users extend from their own
module, which a gin file imports:

    # my_tasks.py
    from jaxrl.tasks.source import PromptItem, register_task

    @register_task("reverse")
    def reverse_task(spec, tokenizer):          # spec: the run's TaskSpec
        return ReverseSource(seed=spec.seed)

    # my_run.gin
    import my_tasks
    TaskSpec.name = "reverse"                   # or "my_tasks:reverse_task", without registering

Built-ins: "arithmetic" (`ArithmeticSource`), "chain_sum" (`ChainSource`, long-tailed completion
lengths), "math_jsonl" (`JsonlMathSource`) and "reasoning_gym" (any reasoning-gym dataset,
`jaxrl.tasks.reasoning_gym`, with the `tasks` extra).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxrl.infra.errors import DataError
from jaxrl.tasks.arithmetic import ArithmeticTask, demonstration, encode_demonstrations
from jaxrl.tasks.chain import ChainTask, chain_demonstration, encode_chain_demonstrations
from jaxrl.tasks.chat import require_chat_template
from jaxrl.tasks.math_jsonl import DEFAULT_INSTRUCTION, format_prompt, load_math_jsonl
from jaxrl.tasks.prompt import PromptItem, PromptSource  # documented here: `jaxrl.tasks.source`


class SkipSource:
    """`source` after its first `offset` train items, without the prompts in `exclude`:

        item(i) = source.item(offset + i + a * 2**40)   for the smallest a >= 0 whose prompt text
                                                        is not in `exclude`

    a pure function of i (a replaced item comes from a far part of the stream, as likely to
    repeat another prompt as any draw). RL after an SFT warm start reads its prompts this way
    (`jaxrl.train.sft.rl_source_after_sft`), so its batches hold no memorised demonstration."""

    FAR = 2**40  # stride of the replacement draws
    MAX_ATTEMPTS = 1000

    def __init__(self, source: PromptSource, offset: int, exclude: frozenset[str] = frozenset()):
        if offset < 0:
            raise ValueError(f"offset={offset} must be >= 0")
        self.source, self.offset, self.exclude = source, offset, frozenset(exclude)
        self.reward_name = getattr(source, "reward_name", "")

    def item(self, index: int) -> PromptItem:
        for attempt in range(self.MAX_ATTEMPTS):
            candidate = self.source.item(self.offset + index + attempt * self.FAR)
            if candidate.text not in self.exclude:
                return candidate
        raise RuntimeError(
            f"{self.MAX_ATTEMPTS} draws for item {index} all hit the {len(self.exclude)} excluded "
            "prompts: the task has (nearly) no prompts outside them; use a smaller SFT pool"
        )

    def eval_items(self, limit: int) -> list[PromptItem]:
        return self.source.eval_items(limit)


# A task factory builds a source from the run's TaskSpec and tokenizer.
TaskFactory = Callable[[Any, Any], PromptSource]
_TASKS: dict[str, TaskFactory] = {}


def register_task(name: str, factory: TaskFactory | None = None, *, overwrite: bool = False):
    """Register `factory(spec: TaskSpec, tokenizer) -> PromptSource` as task `name` (selected by
    `TaskSpec.name`); without `factory`, returns a decorator. Re-registering a name raises unless
    `overwrite=True`."""

    def register(factory):
        if not callable(factory):
            raise TypeError(f"task {name!r}: the factory must be callable")
        if name in _TASKS and not overwrite:
            raise ValueError(f"task {name!r} is already registered; pass overwrite=True")
        _TASKS[name] = factory
        return factory

    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"task name must be a non-empty string without ':', got {name!r}")
    return register if factory is None else register(factory)


def get_task(name: str) -> TaskFactory:
    """A registered task factory, or `"package.module:factory"` imported from the user's code."""
    if name in _TASKS:
        return _TASKS[name]
    if ":" in name:
        from jaxrl.infra.user_code import import_user_callable

        return import_user_callable(name, "task")
    raise KeyError(
        f"unknown task {name!r}; registered: {list_tasks()}. Register yours with "
        "`@register_task(name)` in a module the gin file imports (`import my_module`), or name "
        "its factory as 'package.module:function'"
    )


def list_tasks() -> list[str]:
    return sorted(_TASKS)


class ArithmeticSource:
    """The synthetic arithmetic task: `train` items for training, a fixed held-out eval set."""

    reward_name = "arithmetic_exact"
    chat_formatted = False  # prompts are raw text: encoding adds the BOS token

    def __init__(self, task: ArithmeticTask):
        self.task = task

    def item(self, index: int) -> PromptItem:
        problem = self.task.problem(index, "train")
        return PromptItem(problem.prompt, problem.answer)

    def eval_items(self, limit: int) -> list[PromptItem]:
        return [PromptItem(p.prompt, p.answer) for p in self.task.heldout_problems(limit)]

    def demonstrations(self, start: int, count: int, tokenizer, seq_len: int, pool: int = 0):
        """SFT batch `(tokens_bs, loss_mask_bs)` of train items [start, start + count); with
        `pool` > 0 the demonstrations are only train items [0, pool), cycled (a scarce-data
        warm start: item i of the stream is item i mod pool)."""
        indices = range(start, start + count)
        if pool:
            indices = [i % pool for i in indices]
        problems = [self.task.problem(i, "train") for i in indices]
        return self._encode(problems, tokenizer, seq_len)

    def demonstration_text(self, index: int) -> str:
        return self._text(self.task.problem(index, "train"))

    # How a problem becomes SFT text and tokens (a subclass with another problem type swaps them).
    _encode = staticmethod(encode_demonstrations)
    _text = staticmethod(demonstration)


class JsonlMathSource:
    """GSM8K / MATH-style jsonl: items cycle through the file in a seeded order per epoch; the
    eval set is a separate file (or the first `limit` items of it).

    Prompts are the questions rendered with the tokenizer's chat template (`format_prompt`, with
    `instruction`; "" = the question alone). `max_prompt_tokens` (the context minus the tokens
    to generate) drops the problems whose prompt would not fit, up front and counted, rather
    than failing at the first batch that holds one.
    """

    reward_name = "math_answer"
    chat_formatted = True  # the chat template writes the special tokens itself

    def __init__(
        self,
        train_path: str,
        eval_path: str | None,
        tokenizer,
        seed: int = 0,
        *,
        instruction: str | None = DEFAULT_INSTRUCTION,
        max_prompt_tokens: int | None = None,
    ):
        require_chat_template(tokenizer, "math_jsonl")
        self.tokenizer, self.seed = tokenizer, seed
        self.instruction = instruction or None
        self.examples = self._fitting(load_math_jsonl(train_path), train_path, max_prompt_tokens)
        if not self.examples:
            raise DataError(
                f"{train_path}: no training problems (the file is empty, or no prompt fits "
                f"in {max_prompt_tokens} tokens); give a jsonl file with one "
                '{"question": ..., "answer": ...} object per line'
            )
        self.eval_examples = (
            self._fitting(load_math_jsonl(eval_path), eval_path, max_prompt_tokens)
            if eval_path
            else []
        )

    def prompt(self, question: str) -> str:
        return format_prompt(question, self.tokenizer, instruction=self.instruction)

    def _fitting(self, examples, path: str, max_prompt_tokens: int | None) -> list:
        if max_prompt_tokens is None:
            return examples
        fits = [
            e
            for e in examples
            if len(self.tokenizer.encode(self.prompt(e.question), add_special_tokens=False))
            <= max_prompt_tokens
        ]
        if len(fits) < len(examples):
            print(
                f"[jaxrl] {path}: {len(examples) - len(fits)} of {len(examples)} problems left "
                f"out: their prompts exceed {max_prompt_tokens} tokens (the model's context "
                "minus the tokens to generate)",
                flush=True,
            )
        return fits

    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.examples))

    def _example(self, index: int):
        epoch, offset = divmod(index, len(self.examples))
        return self.examples[int(self._order(epoch)[offset])]

    def item(self, index: int) -> PromptItem:
        example = self._example(index)
        return PromptItem(self.prompt(example.question), example.reference)

    def eval_items(self, limit: int) -> list[PromptItem]:
        return [
            PromptItem(self.prompt(e.question), e.reference) for e in self.eval_examples[:limit]
        ]

    def demonstrations(self, start: int, count: int, tokenizer, seq_len: int, pool: int = 0):
        """SFT batch `(tokens_bs, loss_mask_bs)` of items [start, start + count) (with `pool`
        > 0, of items [0, pool) cycled): the chat prompt, then the worked solution and `<eos>`,
        right-padded to `seq_len`; the loss mask covers the solution and `<eos>`."""
        tokens = np.full((count, seq_len), tokenizer.pad_token_id, np.int32)
        loss_mask = np.zeros((count, seq_len), bool)
        for row, index in enumerate(range(start, start + count)):
            example = self._example(index % pool if pool else index)
            prompt_ids = tokenizer.encode(self.prompt(example.question), add_special_tokens=False)
            answer_ids = tokenizer.encode(example.solution, add_special_tokens=False)
            ids = prompt_ids + answer_ids + [tokenizer.eos_token_id]
            if len(ids) > seq_len:
                raise ValueError(
                    f"{example.source}: the demonstration (prompt + solution) has {len(ids)} "
                    f"tokens > SFTConfig.seq_len={seq_len}; raise seq_len (within the model's "
                    "context) or shorten the solution"
                )
            tokens[row, : len(ids)] = ids
            loss_mask[row, len(prompt_ids) : len(ids)] = True
        return tokens, loss_mask


class ChainSource(ArithmeticSource):
    """Chain sums (`jaxrl.tasks.chain`): long-tailed completion lengths, the same stream, split
    and demonstration interface as `ArithmeticSource`."""

    reward_name = "chain_sum_exact"
    _encode = staticmethod(encode_chain_demonstrations)
    _text = staticmethod(chain_demonstration)


def encode_prompts(tokenizer, items: Sequence[PromptItem], chat_formatted: bool) -> list[list[int]]:
    """Token ids of each prompt. Chat-formatted prompts already carry their special tokens."""
    return [tokenizer.encode(it.text, add_special_tokens=not chat_formatted) for it in items]


def _arithmetic(spec, tokenizer) -> ArithmeticSource:
    del tokenizer
    return ArithmeticSource(
        ArithmeticTask(
            min_digits=spec.min_digits,
            max_digits=spec.max_digits,
            operators=spec.operators,
            seed=spec.seed,
        )
    )


def _math_jsonl(spec, tokenizer, max_prompt_tokens: int | None = None) -> JsonlMathSource:
    if not spec.train_path:
        raise ValueError("task math_jsonl needs train_path (a jsonl of question/answer)")
    return JsonlMathSource(
        spec.train_path,
        spec.eval_path or None,
        tokenizer,
        seed=spec.seed,
        instruction=spec.instruction,
        max_prompt_tokens=max_prompt_tokens,
    )


def _chain_sum(spec, tokenizer) -> ChainSource:
    del tokenizer
    return ChainSource(
        ChainTask(min_operands=spec.min_operands, max_operands=spec.max_operands, seed=spec.seed)
    )


def _reasoning_gym(spec, tokenizer, max_prompt_tokens: int | None = None):
    from jaxrl.tasks.reasoning_gym import reasoning_gym_task  # reasoning-gym loads on first use

    return reasoning_gym_task(spec, tokenizer, max_prompt_tokens)


register_task("arithmetic", _arithmetic)
register_task("chain_sum", _chain_sum)
register_task("math_jsonl", _math_jsonl)
register_task("reasoning_gym", _reasoning_gym)

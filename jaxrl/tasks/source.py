"""Prompt sources: deterministic, index-addressed streams of (prompt, reference) items.

Item `i` of a source is a pure function of (source config, i), so a run's data position is just
the next index: a resumed run continues exactly where the interrupted one stopped, with no
prompt skipped or repeated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxrl.tasks.arithmetic import ArithmeticTask, demonstration, encode_demonstrations
from jaxrl.tasks.math_jsonl import format_prompt, load_math_jsonl


@dataclasses.dataclass(frozen=True)
class PromptItem:
    text: str  # the prompt as the model sees it (before tokenisation)
    reference: str | None  # gold answer for verifiable rewards


class ArithmeticSource:
    """The synthetic arithmetic task: `train` items for training, a fixed held-out eval set."""

    reward_name = "arithmetic_exact"

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
        return encode_demonstrations(problems, tokenizer, seq_len)

    def demonstration_text(self, index: int) -> str:
        return demonstration(self.task.problem(index, "train"))


class JsonlMathSource:
    """GSM8K / MATH-style jsonl: items cycle through the file in a seeded order per epoch; the
    eval set is a separate file (or the first `limit` items of it)."""

    reward_name = "math_answer"

    def __init__(self, train_path: str, eval_path: str | None, tokenizer, seed: int = 0):
        self.examples = load_math_jsonl(train_path)
        if not self.examples:
            raise ValueError(
                f"{train_path}: no training problems (the file is empty); give a jsonl file "
                'with one {"question": ..., "answer": ...} object per line'
            )
        self.eval_examples = load_math_jsonl(eval_path) if eval_path else []
        self.tokenizer, self.seed = tokenizer, seed

    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.examples))

    def item(self, index: int) -> PromptItem:
        epoch, offset = divmod(index, len(self.examples))
        example = self.examples[int(self._order(epoch)[offset])]
        return PromptItem(format_prompt(example.question, self.tokenizer), example.reference)

    def eval_items(self, limit: int) -> list[PromptItem]:
        return [
            PromptItem(format_prompt(e.question, self.tokenizer), e.reference)
            for e in self.eval_examples[:limit]
        ]


def encode_prompts(tokenizer, items: Sequence[PromptItem], chat_formatted: bool) -> list[list[int]]:
    """Token ids of each prompt. Chat-formatted prompts already carry their special tokens."""
    return [tokenizer.encode(it.text, add_special_tokens=not chat_formatted) for it in items]

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
from jaxrl.tasks.math_jsonl import DEFAULT_INSTRUCTION, format_prompt, load_math_jsonl


@dataclasses.dataclass(frozen=True)
class PromptItem:
    text: str  # the prompt as the model sees it (before tokenisation)
    reference: str | None  # gold answer for verifiable rewards


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
        return encode_demonstrations(problems, tokenizer, seq_len)

    def demonstration_text(self, index: int) -> str:
        return demonstration(self.task.problem(index, "train"))


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
        self.tokenizer, self.seed = tokenizer, seed
        self.instruction = instruction or None
        self.examples = self._fitting(load_math_jsonl(train_path), train_path, max_prompt_tokens)
        if not self.examples:
            raise ValueError(
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


def encode_prompts(tokenizer, items: Sequence[PromptItem], chat_formatted: bool) -> list[list[int]]:
    """Token ids of each prompt. Chat-formatted prompts already carry their special tokens."""
    return [tokenizer.encode(it.text, add_special_tokens=not chat_formatted) for it in items]

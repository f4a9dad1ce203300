"""GSM8K / MATH-style jsonl problems: loading, reference extraction, chat-template prompts.

One JSON object per line with a question and a worked answer whose final result is marked
GSM8K-style (`"... #### 42"`) or MATH-style (`"... \\boxed{\\frac{3}{4}}"`):

    {"question": "Tom has 3 apples ...", "answer": "He has 3 + 4 = 7 apples.\\n#### 7"}

Field names are configurable (MATH uses `problem` / `solution`). Blank lines are skipped; any
other malformed line (bad JSON, not an object, missing or non-string field, no final answer)
raises `JsonlFormatError` naming the file and the 1-based line, before anything is returned.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator

from jaxrl.infra.errors import DataError
from jaxrl.tasks.answers import MAX_ANSWER_CHARS, extract_boxed, extract_hash_answer
from jaxrl.tasks.chat import render_prompt

DEFAULT_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


class JsonlFormatError(DataError):
    """A malformed line in a problems file; the message starts with `path:line:`."""


@dataclasses.dataclass(frozen=True)
class MathExample:
    """One problem: the question, its worked solution, the extracted final answer, its origin."""

    question: str
    solution: str
    reference: str
    source: str


def reference_answer(solution: str) -> str | None:
    """The final answer marked in a worked solution: `#### x` (GSM8K), else `\\boxed{x}` (MATH)."""
    return extract_hash_answer(solution) or extract_boxed(solution)


def iter_math_jsonl(
    path: str | os.PathLike, *, question_key: str = "question", answer_key: str = "answer"
) -> Iterator[MathExample]:
    """Yield examples line by line; raises `JsonlFormatError` at the first malformed line."""
    path = os.fspath(path)
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise JsonlFormatError(
                    f"{where}: invalid JSON ({e.msg} at column {e.colno})"
                ) from e
            if not isinstance(record, dict):
                raise JsonlFormatError(
                    f"{where}: expected a JSON object, got {type(record).__name__}"
                )
            for key in (question_key, answer_key):
                if key not in record:
                    raise JsonlFormatError(
                        f"{where}: missing field {key!r} (fields present: {sorted(record)})"
                    )
                value = record[key]
                if not isinstance(value, str):
                    expected = ""
                    if key == answer_key and type(value) in (int, float):
                        # A bare number: the field is a worked solution ending in its answer.
                        expected = f' (write "{key}": "... #### {value}")'
                    raise JsonlFormatError(
                        f"{where}: field {key!r} must be a string, got "
                        f"{type(value).__name__}{expected}"
                    )
            reference = reference_answer(record[answer_key])
            if not reference:
                raise JsonlFormatError(
                    f"{where}: field {answer_key!r} has no final answer: expected '#### <answer>' "
                    f"or '\\boxed{{<answer>}}' (at most {MAX_ANSWER_CHARS} characters)"
                )
            yield MathExample(record[question_key], record[answer_key], reference, where)


def load_math_jsonl(
    path: str | os.PathLike,
    *,
    question_key: str = "question",
    answer_key: str = "answer",
    max_examples: int | None = None,
) -> list[MathExample]:
    """All examples of a jsonl file (or the first `max_examples`), validated line by line."""
    examples = []
    for example in iter_math_jsonl(path, question_key=question_key, answer_key=answer_key):
        if max_examples is not None and len(examples) >= max_examples:
            break
        examples.append(example)
    return examples


def format_prompt(
    question: str,
    tokenizer,
    *,
    instruction: str | None = DEFAULT_INSTRUCTION,
    system_prompt: str | None = None,
) -> str:
    """The question as a chat prompt ending where the assistant's answer starts
    (`jaxrl.tasks.chat.render_prompt`): the user turn is `question + "\\n" + instruction`
    (instruction None: the question alone), preceded by an optional system turn. Tokenise the
    result with `add_special_tokens=False`: templates usually emit the BOS token themselves.
    A tokenizer without a chat template raises `ChatTemplateError`."""
    return render_prompt(tokenizer, question, instruction=instruction, system_prompt=system_prompt)

"""Prompt sources and verifiable rewards: synthetic arithmetic, GSM8K / MATH-style jsonl."""

from jaxrl.tasks.answers import answers_match, extract_answer, normalise_answer
from jaxrl.tasks.arithmetic import (
    ArithmeticProblem,
    ArithmeticTask,
    arithmetic_reward,
    demonstration,
    encode_demonstrations,
)
from jaxrl.tasks.math_jsonl import JsonlFormatError, MathExample, format_prompt, load_math_jsonl
from jaxrl.tasks.rewards import (
    RewardError,
    RewardFunction,
    compute_rewards,
    decode_completions,
    get_reward,
    list_rewards,
    register_reward,
)
from jaxrl.tasks.source import (
    PromptItem,
    PromptSource,
    SkipSource,
    get_task,
    list_tasks,
    register_task,
)
from jaxrl.tasks.tokenizer import build_arithmetic_tokenizer

__all__ = [
    "ArithmeticProblem",
    "ArithmeticTask",
    "JsonlFormatError",
    "MathExample",
    "PromptItem",
    "PromptSource",
    "RewardError",
    "RewardFunction",
    "SkipSource",
    "answers_match",
    "arithmetic_reward",
    "build_arithmetic_tokenizer",
    "compute_rewards",
    "decode_completions",
    "demonstration",
    "encode_demonstrations",
    "extract_answer",
    "format_prompt",
    "get_reward",
    "get_task",
    "list_rewards",
    "list_tasks",
    "load_math_jsonl",
    "normalise_answer",
    "register_reward",
    "register_task",
]

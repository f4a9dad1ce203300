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
    compute_rewards,
    get_reward,
    list_rewards,
    register_reward,
)
from jaxrl.tasks.tokenizer import build_arithmetic_tokenizer

__all__ = [
    "ArithmeticProblem",
    "ArithmeticTask",
    "JsonlFormatError",
    "MathExample",
    "RewardError",
    "answers_match",
    "arithmetic_reward",
    "build_arithmetic_tokenizer",
    "compute_rewards",
    "demonstration",
    "encode_demonstrations",
    "extract_answer",
    "format_prompt",
    "get_reward",
    "list_rewards",
    "load_math_jsonl",
    "normalise_answer",
    "register_reward",
]

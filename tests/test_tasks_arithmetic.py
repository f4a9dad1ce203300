"""Synthetic arithmetic: problems, deterministic disjoint splits, demonstrations, rewards."""

import re

import numpy as np
import pytest

from jaxrl.tasks.arithmetic import (
    ArithmeticProblem,
    ArithmeticTask,
    demonstration,
    encode_demonstrations,
)
from jaxrl.tasks.rewards import compute_rewards
from jaxrl.tasks.tokenizer import build_arithmetic_tokenizer

PROMPT = re.compile(r"([0-9]+)([+*-])([0-9]+)=")


def test_default_task_is_one_to_two_digit_addition():
    task = ArithmeticTask()
    assert task.num_problems == 100 * 100
    problems = [task.problem(i) for i in range(500)]
    for p in problems:
        a, op, b = PROMPT.fullmatch(p.prompt).groups()
        assert op == "+" and 0 <= int(a) <= 99 and 0 <= int(b) <= 99
        assert p.answer == str(int(a) + int(b))
    assert len(set(problems)) > 400  # a stream of distinct-looking draws, not a constant
    assert ArithmeticProblem(37, "+", 45).prompt == "37+45="
    assert ArithmeticProblem(37, "+", 45).answer == "82"


def test_other_operators_and_digit_ranges():
    task = ArithmeticTask(min_digits=2, max_digits=3, operators="+-*", seed=3)
    seen_ops = set()
    for i in range(300):
        p = task.problem(i)
        a, op, b = PROMPT.fullmatch(p.prompt).groups()
        assert 10 <= int(a) <= 999 and 10 <= int(b) <= 999
        want = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        assert p.answer == str(want)
        seen_ops.add(op)
    assert seen_ops == {"+", "-", "*"}


def test_splits_are_deterministic_and_disjoint():
    task = ArithmeticTask(seed=7)
    heldout = task.heldout_problems()
    # ~10% of the 10^4 problems; binomial std is 30.
    assert 850 <= len(heldout) <= 1150
    assert len(set(heldout)) == len(heldout)
    assert all(task.is_heldout(p) for p in heldout)
    train = [task.problem(i, "train") for i in range(3000)]
    assert not set(train) & set(heldout)
    held_stream = [task.problem(i, "heldout") for i in range(200)]
    assert set(held_stream) <= set(heldout)
    # Same fields: same problems and split. Another seed: another split.
    again = ArithmeticTask(seed=7)
    assert again.heldout_problems() == heldout
    assert [again.problem(i) for i in range(3000)] == train
    assert list(zip(range(5), task.problems(start=10), strict=False)) == [
        (i, task.problem(10 + i)) for i in range(5)
    ]
    other = ArithmeticTask(seed=8).heldout_problems()
    assert len(set(other) & set(heldout)) < 0.3 * len(heldout)


def test_large_problem_space_uses_the_held_out_stream():
    task = ArithmeticTask(min_digits=4, max_digits=6)
    heldout = task.heldout_problems(limit=20)
    assert len(set(heldout)) == 20 and all(task.is_heldout(p) for p in heldout)
    assert not any(task.is_heldout(task.problem(i)) for i in range(200))
    with pytest.raises(ValueError, match="limit"):
        task.heldout_problems()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"min_digits": 0},
        {"min_digits": 3, "max_digits": 2},
        {"max_digits": 12},
        {"operators": "/"},
        {"operators": ""},
        {"operators": "++"},
        {"heldout_fraction": 0.0},
        {"heldout_fraction": 1.0},
    ],
)
def test_bad_configs_raise(kwargs):
    with pytest.raises(ValueError):
        ArithmeticTask(**kwargs)


def test_demonstrations_tokenise_for_sft():
    tokenizer = build_arithmetic_tokenizer()
    problems = [ArithmeticProblem(37, "+", 45), ArithmeticProblem(5, "+", 4)]
    assert demonstration(problems[0]) == "37+45=82<eos>"
    tokens, loss_mask = encode_demonstrations(problems, tokenizer, seq_len=12)
    assert tokens.shape == loss_mask.shape == (2, 12) and tokens.dtype == np.int32
    assert tokenizer.decode(tokens[0]) == "<bos>37+45=82<eos><pad><pad>"
    # '8', '2', '<eos>' follow '<bos>37+45=' (7 tokens).
    np.testing.assert_array_equal(np.flatnonzero(loss_mask[0]), [7, 8, 9])
    assert tokenizer.decode(tokens[0][loss_mask[0]]) == "82<eos>"
    assert tokenizer.decode(tokens[1][loss_mask[1]]) == "9<eos>"
    with pytest.raises(ValueError, match="seq_len"):
        encode_demonstrations(problems, tokenizer, seq_len=8)


def test_reward_on_decoded_samples():
    task = ArithmeticTask()
    problems = [task.problem(i) for i in range(4)]
    right = [p.answer for p in problems]
    wrong = [str(int(p.answer) + 1) for p in problems]
    prompts = [p.prompt for p in problems]
    np.testing.assert_array_equal(compute_rewards("arithmetic_exact", prompts, right, right), 1.0)
    np.testing.assert_array_equal(compute_rewards("arithmetic_exact", prompts, wrong, right), 0.0)

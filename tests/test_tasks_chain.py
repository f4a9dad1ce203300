"""Chain sums (`jaxrl.tasks.chain`): a deterministic, index-addressed, long-tailed stream with a
disjoint held-out split, demonstrations whose chain is the running sum, and a parse-only reward."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from jaxrl.job.specs import TaskSpec
from jaxrl.tasks import build_arithmetic_tokenizer, compute_rewards
from jaxrl.tasks.chain import ChainProblem, ChainTask, chain_reward, parse_chain_answer
from jaxrl.tasks.source import get_task


def test_stream_is_deterministic_disjoint_and_long_tailed():
    task = ChainTask()
    problems = [task.problem(i) for i in range(3000)]
    again = ChainTask()
    assert problems[:50] == [again.problem(i) for i in range(50)]
    assert task.problem(7) != ChainTask(seed=1).problem(7)
    assert not any(task.is_heldout(p) for p in problems)
    heldout = task.heldout_problems(300)
    assert len(set(heldout)) == 300 and all(task.is_heldout(p) for p in heldout)
    assert not set(heldout) & set(problems)
    counts = collections.Counter(len(p.operands) for p in problems)
    assert set(counts) == set(range(2, 17))
    # P(k) ~ 1 / (k - 1): the empirical frequencies within 3 standard errors.
    for k, prob in task.count_probabilities.items():
        assert abs(counts[k] / 3000 - prob) < 3 * np.sqrt(prob * (1 - prob) / 3000), k
    lengths = np.array([len(p.completion) + 1 for p in problems])  # + <eos>
    assert lengths.max() >= 8 * lengths.min()
    assert np.median(lengths) < lengths.mean() < np.percentile(lengths, 90)  # right-skewed
    assert lengths.max() <= task.max_completion_tokens() == 50


def test_chain_is_the_running_sum_and_the_demonstration_masks_it():
    problem = ChainProblem((3, 5, 9, 2))
    assert (problem.prompt, problem.completion, problem.answer) == ("3+5+9+2=", "8,17,19", "19")
    source = get_task("chain_sum")(TaskSpec(name="chain_sum"), None)
    tokenizer = build_arithmetic_tokenizer()
    tokens, mask = source.demonstrations(0, 3, tokenizer, 96)
    for row in range(3):
        p = source.task.problem(row, "train")
        text = tokenizer.decode(tokens[row][mask[row]])
        assert text == p.completion + "<eos>"
        assert source.demonstration_text(row) == p.prompt + p.completion + "<eos>"
    with pytest.raises(ValueError, match="seq_len"):
        source.demonstrations(0, 64, tokenizer, 8)
    with pytest.raises(ValueError, match="min_operands"):
        ChainTask(min_operands=1)


@pytest.mark.parametrize(
    "completion, reward",
    [
        ("8,17,19", 1.0),
        (" 8,17,19 <eos>junk", 1.0),
        ("19", 1.0),  # the chain is the model's work: not required
        ("8,17,20", 0.0),
        ("8,17,19,", 0.0),
        ("8, 17, 19", 0.0),
        ("__import__('os')", 0.0),
        ("٣", 0.0),
        ("", 0.0),
        ("1," * 200 + "19", 0.0),
    ],
)
def test_reward_parses_and_never_evaluates(completion, reward):
    assert chain_reward(completion, "19") == reward
    assert compute_rewards("chain_sum_exact", ["3+5+9+2="], [completion], ["19"])[0] == reward


def test_parse_rejects_non_strings():
    assert parse_chain_answer(None) is None


@pytest.mark.parametrize(
    "prompt, completion, reward",
    [
        ("3+5+9+2=", "8,17,19", 1.0),
        ("3+5+9+2=", "19", 1.0),  # a right answer is 1 however it was reached
        ("3+5+9+2=", "8,17,20", 0.5 * 2 / 3),
        ("3+5+9+2=", "8,16,20", 0.5 * 1 / 3),
        ("3+5+9+2=", "9,17,19,", 0.0),  # not a chain
        ("3+5+9+2=", "8,17,19,22", 0.5 * 2 / 3),  # all sums right, then more: under 0.5
        ("3+5+9+2=", "8<eos>,17,19", 0.5 * 1 / 3),
        ("3+5+9+2=", "__import__('os')", 0.0),
        ("3+5=", "7", 0.0),
        ("3+x=", "3", 1.0),  # the reference decides a right answer,
        ("3+x=", "9", 0.0),  # the prompt's chain the partial credit: none here
    ],
)
def test_partial_credit_stays_under_a_right_answer(prompt, completion, reward):
    answer = str(sum(int(d) for d in prompt[:-1].split("+") if d.isdigit()))
    got = compute_rewards("chain_sum_partial", [prompt], [completion], [answer])[0]
    assert got == pytest.approx(reward)
    assert (got > 0.5) == (chain_reward(completion, answer) == 1.0)  # evaluations unchanged

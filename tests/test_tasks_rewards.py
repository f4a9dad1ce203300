"""Answer parsing, numeric normalisation, the reward registry, and hostile inputs."""

import ast
import inspect
import os
import time

import numpy as np
import pytest

from jaxrl.tasks import answers, arithmetic, math_jsonl, rewards
from jaxrl.tasks.answers import (
    MAX_SCAN_CHARS,
    answers_match,
    extract_answer,
    extract_boxed,
    extract_hash_answer,
    extract_last_number,
    normalise_answer,
    normalise_number,
)
from jaxrl.tasks.arithmetic import arithmetic_reward, parse_integer_answer
from jaxrl.tasks.rewards import RewardError, compute_rewards, register_reward

TEN_MB = 10_000_000


@pytest.mark.parametrize(
    "text, want",
    [
        ("so the answer is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
        ("\\boxed{1} then \\boxed{{2}+{3}}", "{2}+{3}"),
        ("\\boxed 5$ and more", "5"),
        ("He has 7 apples.\n#### 1,234\n", "1,234"),
        ("first 3, then 4.5 and finally -17.", "-17"),
        ("3/4 of them", "3/4"),
        ("no digits here", None),
        ("\\boxed{unbalanced", None),
    ],
)
def test_extract_answer(text, want):
    assert extract_answer(text) == want


@pytest.mark.parametrize(
    "a, b",
    [
        ("1,000", "1000"),
        ("$1000.00", "1000"),
        ("42.0", "42"),
        ("42.", "42"),
        ("3/4", "0.75"),
        ("\\frac{3}{4}", "0.75"),
        ("\\dfrac{6}{8}", "3/4"),
        ("-\\frac{1}{2}", "-0.5"),
        ("\\frac{-1}{2}", "-1/2"),
        ("50\\%", "50"),
        ("90^\\circ", "90"),
        ("-0", "0"),
        (" 7 ", "7"),
        ("\\left( 1, 2 \\right)", "(1,2)"),
        ("1" * 300, "1" * 300 + ".000"),  # past MAX_EXACT_DIGITS: exact string comparison
    ],
)
def test_equivalent_answers(a, b):
    assert answers_match(a, b) and answers_match(b, a)


@pytest.mark.parametrize(
    "a, b",
    [
        ("42", "24"),
        ("3/4", "0.76"),
        ("1" * 300, "1" * 299 + "2"),
        ("1/0", "0"),
        ("", ""),
        ("7", None),
    ],
)
def test_different_answers(a, b):
    assert not answers_match(a, b)


def test_normalise_number_exact_values():
    assert normalise_number("0.125") == "1/8"
    assert normalise_number("1,234,567") == "1234567"
    assert normalise_number("1,2345") is None  # not a thousands grouping
    assert normalise_number("1e5") is None  # exponents are not numbers here (no 10**huge)
    assert normalise_number("007.50") == "15/2"
    assert normalise_number("-" + "0" * 500 + "12.50") == "-25/2"


# Hostile inputs: each must be parsed (not run), quickly, to a "no / wrong answer".
HOSTILE = {
    "import": "__import__('os').system('x')",
    "eval": "eval('40+2')",
    "expression": "40+2",
    "boxed_code": "\\boxed{__import__('os').system('x')}",
    "huge_int": "9" * 5000,  # past Python's 4300-digit int() limit
    "ten_mb_digits": "9" * TEN_MB,
    "ten_mb_text": "lorem ipsum " * (TEN_MB // 12),
    "ten_mb_commas": "1," * (TEN_MB // 2),
    "ten_mb_braces": "\\boxed{" + "{" * TEN_MB,
    "ten_mb_boxes": "\\boxed{" * (TEN_MB // 7),
    "ten_mb_hashes": "#### " * (TEN_MB // 5),
    "ten_mb_dots": "0." * (TEN_MB // 2),
    "ten_mb_minus": "-" * TEN_MB,
    "arabic_indic": "\u0664\u0662",  # '٤٢', int() would read it as 42
    "fullwidth": "\uff14\uff12",  # '４２'
    "boxed_unicode": "\\boxed{\u0664\u0662}",
    "exponent": "1e999999999",
    "empty": "",
    "spaces": " \n\t ",
    "nul": "\x00" * 1000,
}


TASK_MODULES = (answers, arithmetic, math_jsonl, rewards)


@pytest.fixture
def no_code_execution(monkeypatch):
    """Trap eval / exec as seen from the task modules, and os.system everywhere."""

    def forbidden(*args, **kwargs):
        raise AssertionError("a reward parser tried to execute code")

    for module in TASK_MODULES:
        for name in ("eval", "exec", "compile", "__import__"):
            monkeypatch.setattr(module, name, forbidden, raising=False)
    monkeypatch.setattr(os, "system", forbidden)


def test_task_modules_never_evaluate_text():
    """Static check: no eval/exec/compile/literal_eval call, no subprocess, in jaxrl.tasks."""
    banned = {"eval", "exec", "compile", "literal_eval", "__import__", "system", "popen"}
    for module in TASK_MODULES:
        tree = ast.parse(inspect.getsource(module))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                func = node.func
                if isinstance(func, ast.Name):
                    assert func.id not in banned, f"{module.__name__} calls {func.id}"
                elif isinstance(func, ast.Attribute):
                    owner = getattr(func.value, "id", None)
                    allowed = owner == "re" and func.attr == "compile"
                    assert allowed or func.attr not in banned, f"{module.__name__}: {func.attr}"
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = {a.name for a in node.names} | {getattr(node, "module", None)}
                assert not names & {"subprocess", "ast", "pickle"}, module.__name__


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_inputs_only_parse_in_bounded_time(name, no_code_execution):
    text = HOSTILE[name]
    start = time.perf_counter()
    for reference in ("42", "9" * 5000):
        assert arithmetic_reward(text, reference) == 0.0
        assert not answers_match(extract_answer(text), reference)
    assert parse_integer_answer(text) is None
    for parse in (extract_boxed, extract_hash_answer, extract_last_number, normalise_answer):
        result = parse(text)
        assert result is None or len(result) <= MAX_SCAN_CHARS
    scores = compute_rewards("math_answer", [""], [text], ["42"])
    scores2 = compute_rewards("arithmetic_exact", [""], [text], ["42"])
    elapsed = time.perf_counter() - start
    np.testing.assert_array_equal(np.concatenate([scores, scores2]), [0.0, 0.0])
    assert elapsed < 0.5, f"{name}: {elapsed:.3f} s"


def test_non_string_inputs_score_zero():
    for value in (None, 42, b"42", ["42"]):
        assert arithmetic_reward(value, "42") == 0.0
        assert extract_answer(value) is None and normalise_answer(value) is None


def test_arithmetic_reward():
    assert arithmetic_reward("82", "82") == 1.0
    assert arithmetic_reward(" 82<eos><pad><pad>", "82") == 1.0
    assert arithmetic_reward("-5", "-5") == 1.0
    for wrong in ("81", "82 1", "82+0", "+82", "8 2", "", "<eos>82", "82" + " " * 300):
        assert arithmetic_reward(wrong, "82") == 0.0, wrong


def test_builtin_rewards_score_batches():
    completions = ["Thus \\boxed{0.75}", "#### 1,000", "so 12 apples", "\\boxed{3}"]
    references = ["\\frac{3}{4}", "1000", "He buys 12.\n#### 12", "4"]
    scores = compute_rewards("math_answer", [""] * 4, completions, references)
    assert scores.dtype == np.float32
    np.testing.assert_array_equal(scores, [1.0, 1.0, 1.0, 0.0])
    scores = compute_rewards("arithmetic_exact", ["1+2=", "3+4="], ["3", "8"], ["3", "7"])
    np.testing.assert_array_equal(scores, [1.0, 0.0])


def test_registry_plugins_and_errors(monkeypatch):
    monkeypatch.setattr(rewards, "_REGISTRY", dict(rewards._REGISTRY))

    @register_reward("length", per_sample=True)
    def length(prompt, completion, reference):
        return len(completion) / 10

    class RewardModel:  # batched, like a reward model scoring the whole batch at once
        def __call__(self, prompts, completions, references):
            return np.array(
                [len(p) + len(c) for p, c in zip(prompts, completions, strict=True)], float
            )

    register_reward("rm", RewardModel())
    assert {"length", "rm", "arithmetic_exact", "math_answer"} <= set(rewards.list_rewards())
    np.testing.assert_allclose(compute_rewards("length", ["a", "b"], ["xy", "xyz"]), [0.2, 0.3])
    np.testing.assert_array_equal(compute_rewards("rm", ["a", "bb"], ["x", "y"]), [2.0, 3.0])

    with pytest.raises(ValueError, match="already registered"):
        register_reward("length", length, per_sample=True)
    register_reward("length", lambda p, c, r: 1.0, per_sample=True, overwrite=True)
    np.testing.assert_array_equal(compute_rewards("length", ["a"], ["xy"]), [1.0])
    with pytest.raises(KeyError, match="unknown reward"):
        compute_rewards("nope", ["a"], ["b"])
    with pytest.raises(TypeError, match="callable"):
        register_reward("bad", 3)
    with pytest.raises(RewardError, match="shape"):
        compute_rewards(lambda p, c, r: [1.0], ["a", "b"], ["x", "y"])
    with pytest.raises(RewardError, match="non-finite"):
        compute_rewards(lambda p, c, r: [float("nan")], ["a"], ["x"])
    with pytest.raises(ValueError, match="references"):
        compute_rewards("length", ["a"], ["x"], ["r1", "r2"])

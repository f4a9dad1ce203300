"""GSM8K / MATH-style jsonl: loading, reference extraction, errors, chat prompts."""

import json

import pytest

from jaxrl.tasks.math_jsonl import (
    JsonlFormatError,
    format_prompt,
    load_math_jsonl,
    reference_answer,
)
from jaxrl.tasks.rewards import compute_rewards
from jaxrl.tasks.tokenizer import build_arithmetic_tokenizer

GOOD = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = 7\n#### 7"},
    {"question": "Cost of 1000 pens?", "answer": "It costs $1,200.\n#### 1,200"},
    {"question": "What is 3/4 of 1?", "answer": "We get $\\boxed{\\frac{3}{4}}$."},
]


def write_jsonl(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_load_extracts_references(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", [json.dumps(r) for r in GOOD[:2]] + ["", "  "])
    path.write_text(path.read_text() + json.dumps(GOOD[2]) + "\n")
    examples = load_math_jsonl(path)
    assert [e.reference for e in examples] == ["7", "1,200", "\\frac{3}{4}"]
    assert examples[0].question == GOOD[0]["question"]
    assert examples[0].solution == GOOD[0]["answer"]
    assert examples[2].source == f"{path}:5"  # blank lines count in line numbers
    assert len(load_math_jsonl(path, max_examples=2)) == 2


def test_custom_field_names(tmp_path):
    record = {"problem": "1+1?", "solution": "\\boxed{2}"}
    path = write_jsonl(tmp_path / "math.jsonl", [json.dumps(record)])
    (example,) = load_math_jsonl(path, question_key="problem", answer_key="solution")
    assert (example.question, example.reference) == ("1+1?", "2")


@pytest.mark.parametrize(
    "bad_line, reason",
    [
        ('{"question": "q", "answer": "#### 1"', "invalid JSON"),
        ('["question", "answer"]', "expected a JSON object"),
        ('{"question": "q"}', "missing field 'answer'"),
        ('{"question": 3, "answer": "#### 1"}', "must be a string"),
        ('{"question": "q", "answer": "no final answer"}', "no final answer"),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path, bad_line, reason):
    path = write_jsonl(tmp_path / "bad.jsonl", [json.dumps(GOOD[0]), json.dumps(GOOD[1]), bad_line])
    with pytest.raises(JsonlFormatError, match=reason) as info:
        load_math_jsonl(path)
    assert str(info.value).startswith(f"{path}:3:")


def test_reference_answer_prefers_hash_then_boxed():
    assert reference_answer("\\boxed{5} and then\n#### 6") == "6"
    assert reference_answer("only \\boxed{x^2}") == "x^2"
    assert reference_answer("nothing") is None


def test_format_prompt_uses_the_chat_template():
    tokenizer = build_arithmetic_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant] {% endif %}"
    )
    prompt = format_prompt("what is 2+2?", tokenizer, instruction="be brief.", system_prompt="hi")
    assert prompt == "[system] hi\n[user] what is 2+2?\nbe brief.\n[assistant] "
    assert format_prompt("q", tokenizer, instruction=None) == "[user] q\n[assistant] "
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        format_prompt("q", tokenizer)


def test_math_reward_against_loaded_references(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [json.dumps(r) for r in GOOD])
    examples = load_math_jsonl(path)
    completions = ["so 7 apples", "\\boxed{1200}", "The answer is 0.75"]
    scores = compute_rewards(
        "math_answer", [e.question for e in examples], completions, [e.reference for e in examples]
    )
    assert scores.tolist() == [1.0, 1.0, 1.0]
    scores = compute_rewards(
        "math_answer", ["q"] * 3, ["8", "#### 1,201", "3/5"], [e.reference for e in examples]
    )
    assert scores.tolist() == [0.0, 0.0, 0.0]


def test_empty_training_file_is_refused_by_name(tmp_path):
    from jaxrl.tasks.source import JsonlMathSource

    empty = write_jsonl(tmp_path / "empty.jsonl", ["", "  "])
    with pytest.raises(ValueError, match=r"empty\.jsonl: no training problems"):
        JsonlMathSource(str(empty), None, build_arithmetic_tokenizer())

"""The calculator in chat tool-call form (`jaxrl.env.chat_calculator`): the ids an episode appends
are the chat template's rendering of the whole conversation (delta form), calls are parsed and
answered, a call that cannot be read gets an error reply and the episode goes on, the final
answer is scored; the task is registered and refuses templates it cannot append to. Offline: a
ChatML character tokenizer with SmolLM2-135M-Instruct's template, built here."""

from __future__ import annotations

import json

import pytest
from chat_fixtures import SMOLLM2_TEMPLATE, chatml_tokenizer

from jaxrl.env.calculator import CalculatorTask
from jaxrl.env.chat_calculator import (
    SYSTEM_PROMPT,
    ChatCalculatorEnv,
    ChatCalculatorSource,
    parse_tool_call,
)
from jaxrl.job.specs import TaskSpec, build_source
from jaxrl.tasks.chat import ChatTemplateError
from jaxrl.tasks.source import PromptItem

TOK = chatml_tokenizer()
END = TOK.convert_tokens_to_ids("<|im_end|>")


def call(expression) -> str:
    args = {"expression": expression}
    return "<tool_call>" + json.dumps({"name": "calculator", "arguments": args}) + "</tool_call>"


def encode(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False)


def render(messages, generation_prompt: bool) -> list[int]:
    text = TOK.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt
    )
    return encode(text)


def source(chained: bool = False) -> ChatCalculatorSource:
    return ChatCalculatorSource(CalculatorTask(chained=chained, seed=5), TOK)


def test_an_episode_is_the_templates_rendering_of_the_whole_conversation():
    src = source(chained=True)
    item = src.item(3)
    a, b, c, d = src.task.operands(3, "train")
    env = src.make_env()
    history = list(env.reset(item))
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": f"What is {a}*{b}+{c}*{d}?"},
    ]
    assert history == render(messages, True)
    for expression, value in [(f"{a} * {b}", a * b), (f"{c}*{d}", c * d)]:
        reply = call(expression)
        turn = encode(reply) + [END]  # the engine's turn: stopped by EOS, which it keeps
        step = env.step(turn)
        assert (step.status, step.done, step.reward) == ("ok", False, 0.0)
        history += turn + list(step.observation)
        messages += [
            {"role": "assistant", "content": reply},
            {"role": "tool", "content": json.dumps({"result": value})},
        ]
        assert history == render(messages, True)  # the ids, not just the text
    answer = f"The answer is {a * b + c * d}."
    final = env.step(encode(answer) + [END])
    assert (final.done, final.reward, final.status) == (True, 1.0, "ok")
    history += encode(answer) + [END]
    messages.append({"role": "assistant", "content": answer})
    assert history + encode("\n") == render(messages, False)
    assert item.reference == str(a * b + c * d)


def test_worked_examples_are_turns_of_the_conversation_and_replies_stay_in_delta_form():
    src = ChatCalculatorSource(CalculatorTask(seed=5), TOK, examples=[(12, 34)])
    a, b = src.task.operands(0, "train")
    example = [
        {"role": "user", "content": "What is 12*34?"},
        {"role": "assistant", "content": call("12*34")},
        {"role": "tool", "content": '{"result": 408}'},
        {"role": "assistant", "content": "408"},
    ]
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, *example]
    messages.append({"role": "user", "content": f"What is {a}*{b}?"})
    env = src.make_env()
    history = list(env.reset(src.item(0)))
    assert history == render(messages, True)
    turn = encode(call(f"{a}*{b}")) + [END]
    history += turn + list(env.step(turn).observation)
    messages += [
        {"role": "assistant", "content": call(f"{a}*{b}")},
        {"role": "tool", "content": json.dumps({"result": a * b})},
    ]
    assert history == render(messages, True)


def test_a_turn_stopped_without_the_end_of_turn_token_gets_it_in_the_reply():
    env = source().make_env()
    env.reset(source().item(0))
    with_end = env.step(encode(call("2*3")) + [END]).observation
    without = env.step(encode(call("2*3"))).observation  # e.g. stopped by another stop id
    assert list(without) == [END, *with_end]
    assert (
        TOK.decode(with_end)
        == '\n<|im_start|>tool\n{"result": 6}<|im_end|>\n<|im_start|>assistant\n'
    )


@pytest.mark.parametrize(
    "turn",
    [
        '<tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}',  # no closing tag
        "<tool_call>calculator(2*3)</tool_call>",  # not JSON
        '<tool_call>["calculator", "2*3"]</tool_call>',  # JSON, not an object
        '<tool_call>{"name": "search", "arguments": {"expression": "2*3"}}</tool_call>',
        '<tool_call>{"name": "calculator", "arguments": {"expression": 6}}</tool_call>',
        call("__import__('os').system('true')"),  # never evaluated
        call("2/3"),
        call("1" * 40),  # past the parser's length bound
    ],
)
def test_a_call_that_cannot_be_read_gets_an_error_reply_and_the_episode_goes_on(turn):
    env = source().make_env()
    env.reset(source().item(0))
    step = env.step(encode(turn) + [END])
    assert (step.status, step.done, step.reward) == ("malformed", False, 0.0)
    text = TOK.decode(step.observation)
    head, tail = "\n<|im_start|>tool\n", "<|im_end|>\n<|im_start|>assistant\n"
    assert text.startswith(head) and text.endswith(tail)
    assert set(json.loads(text[len(head) : -len(tail)])) == {"error"}


def test_parse_reads_the_first_call_and_strips_spaces():
    assert parse_tool_call("no call here, 42") is None
    assert parse_tool_call("Let me compute. " + call(" 12 * 34 ") + call("1*1")) == "12*34"


@pytest.mark.parametrize(
    "reply, reward",
    [("1776", 1.0), ("The answer is 1,776.", 1.0), ("It is 1775.", 0.0), ("I do not know.", 0.0)],
)
def test_the_final_answer_is_scored_and_ends_the_episode(reply, reward):
    env = ChatCalculatorEnv(TOK)
    env.reset(PromptItem("<|im_start|>user\nWhat is 37*48?<|im_end|>\n", "1776"))
    step = env.step(encode(reply) + [END])
    assert (step.done, step.reward, tuple(step.observation)) == (True, reward, ())


def test_a_disabled_tool_answers_every_call_with_a_question_mark():
    env = source().make_env(disabled=True)
    env.reset(source().item(0))
    step = env.step(encode(call("2*3")) + [END])
    assert step.status == "ok" and '{"result": "?"}' in TOK.decode(step.observation)


def test_the_task_is_registered_and_checks_its_template():
    spec = TaskSpec(name="calculator_chat", operators="*+", min_digits=2, seed=5)
    src = build_source(spec, TOK)
    assert isinstance(src, ChatCalculatorSource) and src.task.chained
    assert src.stop_ids == (END,) and src.chat_formatted
    assert src.item(0) == source(chained=True).item(0)  # a pure function of the spec and index
    assert not {it.text for it in src.eval_items(32)} & {src.item(i).text for i in range(256)}
    custom = build_source(
        TaskSpec(name="calculator_chat", operators="*", system_prompt="Use tools."), TOK
    )
    assert "<|im_start|>system\nUse tools.<|im_end|>" in custom.item(0).text
    with pytest.raises(ValueError, match="operators"):
        build_source(TaskSpec(name="calculator_chat", operators="+"), TOK)
    with pytest.raises(ChatTemplateError, match="no|none"):
        build_source(
            TaskSpec(name="calculator_chat", operators="*"), chatml_tokenizer(template=None)
        )
    # A template that drops earlier assistant turns cannot take replies appended as ids.
    rewriting = SMOLLM2_TEMPLATE.replace(
        "message['content']",
        "(message['content'] if message['role'] != 'assistant' or loop.last else '...')",
    )
    with pytest.raises(ChatTemplateError, match="ChatML"):
        build_source(
            TaskSpec(name="calculator_chat", operators="*"), chatml_tokenizer(template=rewriting)
        )


def test_each_factor_has_its_digit_range_and_the_default_keeps_the_problems():
    task = CalculatorTask(min_digits=3, max_digits=3, min_digits_b=2, max_digits_b=2, seed=5)
    pairs = [task.operands(i, split) for split in ("train", "heldout") for i in range(200)]
    assert all(100 <= a <= 999 and 10 <= b <= 99 for a, b in pairs)
    chained = CalculatorTask(min_digits=3, max_digits=3, max_digits_b=1, min_digits_b=1,
                             chained=True)  # fmt: skip
    assert all(
        a >= 100 and c >= 100 and b < 10 and d < 10
        for a, b, c, d in (chained.operands(i, "train") for i in range(100))
    )
    # None is the first factor's range: the same problems as before the field existed.
    same = CalculatorTask(min_digits=2, max_digits=3, min_digits_b=2, max_digits_b=3, seed=5)
    default = CalculatorTask(min_digits=2, max_digits=3, seed=5)
    assert [same.operands(i, "train") for i in range(50)] == [
        default.operands(i, "train") for i in range(50)
    ]
    # Pinned from the code before the field: configs keep their problems.
    assert default.operands(0, "train") == (694, 741)
    assert CalculatorTask(seed=5, chained=True).operands(3, "train") == (94, 96, 96, 74)
    with pytest.raises(ValueError, match="min_digits_b <= max_digits_b"):
        CalculatorTask(min_digits_b=3, max_digits_b=2)


def test_few_shot_digits_and_a_disabled_tool_reach_the_chat_task_from_its_spec():
    spec = TaskSpec(
        name="calculator_chat",
        operators="*",
        min_digits=3,
        max_digits=3,
        min_digits_b=2,
        max_digits_b=2,
        few_shot=[[123, 45]],  # as gin writes a list
        tool_disabled=True,
    )
    spec.validate()
    src = build_source(spec, TOK)
    a, b = src.task.operands(0, "train")
    assert a >= 100 and b < 100 and spec.few_shot == ((123, 45),)
    text = src.item(0).text
    assert text.index("What is 123*45?") < text.index(call("123*45")) < text.index("5535")
    assert text.rstrip().endswith(f"What is {a}*{b}?<|im_end|>\n<|im_start|>assistant")
    env = src.make_env()
    env.reset(src.item(0))
    assert '{"result": "?"}' in TOK.decode(env.step(encode(call("2*3")) + [END]).observation)
    for bad, message in (
        ({"few_shot": [(1, 2, 3)]}, "write \\(a, b\\) pairs"),
        ({"few_shot": [(1.5, 2)]}, "write \\(a, b\\) pairs"),
        ({"name": "calculator", "few_shot": [(1, 2)]}, "calculator_chat task only"),
        ({"min_digits_b": 5}, "min_digits_b <= max_digits_b <= 4"),
    ):
        with pytest.raises(ValueError, match=message):
            TaskSpec(**{"name": "calculator_chat", "operators": "*", **bad}).validate()

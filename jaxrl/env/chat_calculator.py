"""The calculator tool in chat tool-call form, for instruct models with a chat template
(SmolLM2-135M-Instruct's ChatML), on token ids like every environment (`jaxrl.env.base`).

The prompt is the system turn (which describes the tool) and the user's question, rendered by
the tokenizer's own chat template up to the start of the assistant's reply. The model calls the
tool by writing, in its turn,

    <tool_call>{"name": "calculator", "arguments": {"expression": "37*48"}}</tool_call>

and ends the turn with the template's end-of-turn token (`<|im_end|>`, an EOS the engine stops
at). The environment appends the tool's reply in the template's delta form, the ids the template
writes between the end of that assistant turn and the start of the next one; for ChatML:

    <|im_end|>\\n<|im_start|>tool\\n{"result": 1776}<|im_end|>\\n<|im_start|>assistant\\n

(without the leading `<|im_end|>` when the model's turn already ends with it, as it does when
EOS stopped it). The history is then exactly what the template renders for the whole
conversation [system, user, assistant, tool, ..., generation prompt], and the trainer gets the
ids the engine sampled and the environment appended, never a re-rendering. A turn without a
`<tool_call>` is the final answer: it is scored (the last number against the product, as the
"math_answer" reward reads it) and the episode ends.

The delta is found by rendering a probe conversation and taking what the template writes after
the assistant's reply (`observation_text`), so any template that renders each message on its
own works (ChatML, Llama 3); `check_delta_form`, run when the source is built, refuses one
whose full rendering of a conversation is not prompt + replies + deltas (e.g. a template that
rewrites earlier turns).

A call is read by string search and `json.loads` of at most `MAX_CALL_CHARS` characters; its
expression (spaces removed) goes to the calculator's bounded parser
(`jaxrl.env.calculator.calculate`), never `eval`. A call that cannot be read (no closing tag,
a special token such as `<|im_start|>` inside it, not JSON, another tool's name, arguments of
another JSON type, an expression the parser refuses) gets an error reply,
`{"error": ...}` in a tool message, and the step status "malformed"; the episode goes on.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence

from jaxrl.env.base import Step
from jaxrl.env.calculator import CalculatorError, CalculatorTask, calculate, calculator_task
from jaxrl.tasks.answers import answers_match, extract_answer
from jaxrl.tasks.chat import ChatTemplateError, end_of_turn_id, require_chat_template
from jaxrl.tasks.source import PromptItem, register_task

TOOL_NAME = "calculator"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
MAX_CALL_CHARS = 512  # the JSON between the tags
MAX_TURN_CHARS = 8192  # a longer turn is not searched for a call (it ends the episode, scored)
SYSTEM_PROMPT = (
    "You are a helpful assistant with a calculator tool. To use it, write\n"
    '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>\n'
    "and the result comes back in a tool message. When you know the answer, reply with the "
    "number only."
)
_MARK = "Qz7Xv"  # an assistant reply no template rewrites
# Fast tokenizers are not safe to call from several threads at once; steps run on a pool.
_TOKENIZER_LOCK = threading.Lock()


class ToolCallError(ValueError):
    """The turn opens a tool call that cannot be read; the message is the error reply."""


def parse_tool_call(text: str, special_tokens: Sequence[str] = ()) -> str | None:
    """The expression of the first `<tool_call>` in `text`, spaces removed; None when `text`
    holds no `<tool_call>` (a final answer). Raises `ToolCallError` for a call that cannot be
    read (module docstring), one holding any of `special_tokens` (the tokenizer's control
    tokens, as the turn decodes with them kept) included."""
    start = text.find(CALL_OPEN, 0, MAX_TURN_CHARS)
    if start < 0:
        return None
    start += len(CALL_OPEN)
    end = text.find(CALL_CLOSE, start, start + MAX_CALL_CHARS + len(CALL_CLOSE))
    if end < 0:
        raise ToolCallError(f"no {CALL_CLOSE} within {MAX_CALL_CHARS} characters of {CALL_OPEN}")
    body = text[start:end]
    for token in special_tokens:
        if token in body:
            raise ToolCallError(
                f"the tool call holds the special token {token}; write it as plain text "
                f"between {CALL_OPEN} and {CALL_CLOSE}"
            )
    try:
        call = json.loads(body)
    except ValueError:
        raise ToolCallError("the tool call is not JSON") from None
    if not isinstance(call, dict) or call.get("name") != TOOL_NAME:
        name = call.get("name") if isinstance(call, dict) else None
        raise ToolCallError(f"unknown tool {name!r}: the tool's name is {TOOL_NAME}")
    arguments = call.get("arguments")
    expression = arguments.get("expression") if isinstance(arguments, dict) else None
    if not isinstance(expression, str):
        raise ToolCallError(
            'the arguments must be {"expression": "<integers joined by * + ->"} with a string '
            f"expression; got {json.dumps(arguments)[:64]}"
        )
    return "".join(expression.split())


def special_token_texts(tokenizer) -> tuple[str, ...]:
    """The text of each special (control) token of `tokenizer`: its added tokens marked special
    (SmolLM2: `<|im_start|>`, `<|im_end|>`, `<|endoftext|>`, `<file_sep>`, ...), else its
    `all_special_tokens`."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    texts = [t.content for t in added.values() if getattr(t, "special", False)]
    return tuple(dict.fromkeys(texts or getattr(tokenizer, "all_special_tokens", ())))


def observation_text(
    tokenizer, content: str, *, role: str = "tool", system_prompt: str = ""
) -> str:
    """What the chat template writes after an assistant's reply when a `role` message holding
    `content` follows, up to where the next assistant reply starts (ChatML:
    `<|im_end|>\\n<|im_start|>tool\\n{content}<|im_end|>\\n<|im_start|>assistant\\n`)."""
    messages = [
        {"role": "system", "content": system_prompt},
        {"role": "user", "content": "?"},
        {"role": "assistant", "content": _MARK},
        {"role": role, "content": content},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if not isinstance(text, str) or text.count(_MARK) != 1:
        raise ChatTemplateError(
            f"the chat template of {getattr(tokenizer, 'name_or_path', '')!r} does not render an "
            f"assistant reply verbatim before a {role!r} message; use a ChatML-style template"
        )
    return text[text.index(_MARK) + len(_MARK) :]


def check_delta_form(tokenizer, system_prompt: str, role: str = "tool") -> None:
    """Raises `ChatTemplateError` unless the template renders a two-call conversation as its
    prompt + each reply + `observation_text` of each tool message (the delta form the
    environment appends), as text and as ids."""
    replies, results = ['<tool_call>{"a": 1}</tool_call>', "<tool_call>2</tool_call>"], ["3", "4"]
    messages = [{"role": "system", "content": system_prompt}, {"role": "user", "content": "1*3?"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    pieces = [prompt]
    for reply, result in zip(replies, results, strict=True):
        messages += [{"role": "assistant", "content": reply}, {"role": role, "content": result}]
        pieces += [
            reply,
            observation_text(tokenizer, result, role=role, system_prompt=system_prompt),
        ]
    full = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = [i for p in pieces for i in tokenizer.encode(p, add_special_tokens=False)]
    if "".join(pieces) != full or ids != list(tokenizer.encode(full, add_special_tokens=False)):
        raise ChatTemplateError(
            f"the chat template of {getattr(tokenizer, 'name_or_path', '')!r} does not render a "
            "conversation as its prompt followed by each turn's delta (it rewrites earlier "
            "turns?), so tool replies cannot be appended as ids; use a ChatML-style template"
        )


def final_answer_reward(text: str, reference: str | None) -> float:
    """1.0 when the reply's final answer (`\\boxed{}`, `#### x` or the last number) is the
    reference, as the "math_answer" reward scores it."""
    return float(reference is not None and answers_match(extract_answer(text), reference))


class ChatCalculatorEnv:
    """One episode of the chat calculator (module docstring).

    system_prompt: the system turn the prompt was rendered with (the probe of the delta).
    tool_role: the role of the tool's messages. tool: the function expressions are evaluated
    with (default `calculate`). disabled: every call gets `{"result": "?"}`.
    """

    def __init__(
        self,
        tokenizer,
        *,
        system_prompt: str = SYSTEM_PROMPT,
        tool_role: str = "tool",
        tool: Callable[[str], int] = calculate,
        disabled: bool = False,
    ):
        self.tokenizer, self.system_prompt, self.tool_role = tokenizer, system_prompt, tool_role
        self.tool, self.disabled = tool, disabled
        self.end_of_turn = end_of_turn_id(tokenizer)
        self.special_tokens = special_token_texts(tokenizer)
        self.reference: str | None = None

    def reset(self, item: PromptItem) -> list[int]:
        """`item.text` is the rendered prompt (`ChatCalculatorSource`): its special tokens are
        written by the template, so no others are added."""
        self.reference = item.reference
        with _TOKENIZER_LOCK:
            return list(self.tokenizer.encode(item.text, add_special_tokens=False))

    def step(self, turn_ids: Sequence[int]) -> Step:
        ids = [int(t) for t in turn_ids]
        body = ids[:-1] if ids and ids[-1] == self.end_of_turn else ids
        with _TOKENIZER_LOCK:  # the call is read with special tokens kept, the answer without
            raw = self.tokenizer.decode(body, skip_special_tokens=False)
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
        try:
            expression = parse_tool_call(raw, self.special_tokens)
        except ToolCallError as error:
            return Step(self.reply(ids, {"error": str(error)}), status="malformed")
        if expression is None:
            return Step(reward=final_answer_reward(text, self.reference), done=True)
        if self.disabled:
            return Step(self.reply(ids, {"result": "?"}))
        try:
            value = self.tool(expression)
        except CalculatorError:
            error = "the expression must be integers joined by * + - (at most 32 characters)"
            return Step(self.reply(ids, {"error": error}), status="malformed")
        return Step(self.reply(ids, {"result": value}))

    def reply(self, turn_ids: Sequence[int], content: dict) -> list[int]:
        """The ids of a tool message holding `content` (as JSON) after the turn `turn_ids`, in
        delta form: without the template's end-of-turn token when the turn ends with it."""
        text = observation_text(
            self.tokenizer,
            json.dumps(content),
            role=self.tool_role,
            system_prompt=self.system_prompt,
        )
        with _TOKENIZER_LOCK:
            ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        if turn_ids and turn_ids[-1] == self.end_of_turn and ids[:1] == [self.end_of_turn]:
            ids = ids[1:]
        return ids


class ChatCalculatorSource:
    """The calculator task for chat models as a `PromptSource`: the items of a
    `CalculatorTask` (the same operands, train and held-out splits) asked as "What is 37*48?"
    in a user turn after `system_prompt`, rendered with the tokenizer's chat template;
    episodes run in `ChatCalculatorEnv`s (`make_env`). Registered as the task
    "calculator_chat" (`TaskSpec.operators` "*" or "*+", `TaskSpec.system_prompt` None: the
    default `SYSTEM_PROMPT`). `examples`: (a, b) pairs whose worked exchanges (question, tool
    call, result, answer) come before the question, as turns of the conversation (few-shot).
    `tool_disabled`: its environments answer every call `{"result": "?"}` (a control). No SFT
    demonstrations: it starts from an instruct model."""

    chat_formatted = True  # the chat template writes the special tokens itself
    reward_name = "math_answer"  # single-turn scoring of a final answer

    def __init__(
        self,
        task: CalculatorTask,
        tokenizer,
        *,
        system_prompt: str = SYSTEM_PROMPT,
        tool_role: str = "tool",
        examples: Sequence[tuple[int, int]] = (),
        tool_disabled: bool = False,
    ):
        require_chat_template(tokenizer, "calculator_chat")
        check_delta_form(tokenizer, system_prompt, tool_role)
        self.task, self.tokenizer = task, tokenizer
        self.system_prompt, self.tool_role = system_prompt, tool_role
        self.examples, self.tool_disabled = tuple(examples), tool_disabled

    def question(self, values: Sequence[int]) -> str:
        return f"What is {self.task.text(values)[:-1]}?"

    def prompt(self, values: Sequence[int]) -> str:
        messages = [{"role": "system", "content": self.system_prompt}]
        for a, b in self.examples:  # worked exchanges: question, call, result, answer
            call = {"name": TOOL_NAME, "arguments": {"expression": f"{a}*{b}"}}
            messages += [
                {"role": "user", "content": f"What is {a}*{b}?"},
                {"role": "assistant", "content": CALL_OPEN + json.dumps(call) + CALL_CLOSE},
                {"role": self.tool_role, "content": json.dumps({"result": a * b})},
                {"role": "assistant", "content": str(a * b)},
            ]
        messages.append({"role": "user", "content": self.question(values)})
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )

    def _item(self, index: int, split: str) -> PromptItem:
        values = self.task.operands(index, split)
        return PromptItem(self.prompt(values), str(self.task.answer(values)))

    def item(self, index: int) -> PromptItem:
        return self._item(index, "train")

    def eval_items(self, limit: int) -> list[PromptItem]:
        return [self._item(i, "heldout") for i in range(limit)]

    def make_env(self, **kwargs) -> ChatCalculatorEnv:
        kwargs = {
            "system_prompt": self.system_prompt,
            "tool_role": self.tool_role,
            "disabled": self.tool_disabled,
        } | kwargs
        return ChatCalculatorEnv(self.tokenizer, **kwargs)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The template's end-of-turn token (a turn, call or answer, ends there)."""
        end = end_of_turn_id(self.tokenizer)
        return () if end is None else (end,)


def _calculator_chat(spec, tokenizer) -> ChatCalculatorSource:
    """The "calculator_chat" task of a `TaskSpec`: digits, seed, `operators` ("*" or "*+"),
    `system_prompt` (None: `SYSTEM_PROMPT`), `few_shot` (the worked exchanges) and
    `tool_disabled`."""
    task = calculator_task(spec, "calculator_chat")
    system_prompt = SYSTEM_PROMPT if spec.system_prompt is None else spec.system_prompt
    return ChatCalculatorSource(
        task,
        tokenizer,
        system_prompt=system_prompt,
        examples=spec.few_shot,
        tool_disabled=spec.tool_disabled,
    )


register_task("calculator_chat", _calculator_chat)

"""Chat-templated prompts: a question rendered with the tokenizer's chat template, the token that
ends the assistant's turn, and the final answer read back from the assistant's text.

A task that talks to an instruct model writes each prompt as a conversation, rendered by the
tokenizer's own Jinja template (`apply_chat_template`, `add_generation_prompt=True`): an optional
system turn (`system_prompt`; None keeps the template's own default, e.g. SmolLM2's "You are a
helpful AI assistant named SmolLM ...") and a user turn `question + "\\n" + instruction`. The
prompt text ends where the assistant's reply starts and already holds the template's special
tokens, so it is tokenised with `add_special_tokens=False`.

Generation ends at the template's end-of-turn token (`end_of_turn_id`: `<|im_end|>` in ChatML,
`<|eot_id|>` in Llama 3), found by rendering a one-turn conversation, not by a table of names.
`jaxrl.job.specs.build_model_config` adds it to the model's stop ids when a checkpoint's config
names only `<|endoftext|>`. Completions are decoded without special tokens, so a reward reads the
assistant's text only: the prompt is not part of a completion, and generation stopped at the end
of the turn.

Answer formats (`AnswerFormat`, by name): where the final answer sits in the assistant's text, and
what a demonstration writes. Extraction only parses text (`jaxrl.tasks.answers`, bounded and
linear-time); nothing evaluates it.

    boxed        the content of the last `\\boxed{...}`            (instruction must ask for it)
    answer_tag   the content of the last `<answer>...</answer>`   (reasoning-gym's convention)
    last_number  the last number (ASCII digits) in the text
    text         the whole reply, stripped
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

from jaxrl.infra.errors import DataError
from jaxrl.tasks.answers import MAX_ANSWER_CHARS, MAX_SCAN_CHARS, extract_boxed, extract_last_number


class ChatTemplateError(DataError):
    """The tokenizer has no chat template (or one that cannot render a conversation), and the
    task needs one; the message names the tokenizer's path and the fix."""


def tokenizer_name(tokenizer) -> str:
    """Where the tokenizer was loaded from, for messages (its class name when it has no path)."""
    return getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__


def require_chat_template(tokenizer, task: str) -> None:
    """Raises `ChatTemplateError` when `tokenizer` has no chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError(
            f"task {task!r} renders prompts with the tokenizer's chat template, but the tokenizer "
            f"of {tokenizer_name(tokenizer)!r} has none: start from an instruct model "
            "(PolicySpec.init_from = its directory, whose tokenizer_config.json or "
            "chat_template.jinja holds the template), or set `tokenizer.chat_template` to a Jinja "
            "string"
        )


def render_prompt(
    tokenizer,
    question: str,
    *,
    instruction: str | None = None,
    system_prompt: str | None = None,
) -> str:
    """The conversation [system (when `system_prompt` is not None), user] rendered with the
    tokenizer's chat template up to the start of the assistant's reply. The user turn is
    `question + "\\n" + instruction` (instruction None or "": the question alone)."""
    require_chat_template(tokenizer, "chat")
    user = f"{question}\n{instruction}" if instruction else question
    messages = [{"role": "user", "content": user}]
    if system_prompt is not None:
        messages.insert(0, {"role": "system", "content": system_prompt})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


_MARK = "Xq7Zk"  # an assistant reply no template rewrites


def end_of_turn_id(tokenizer) -> int | None:
    """The special token the chat template writes right after an assistant's reply, or None
    (no template, a template that does not render a [user, assistant] exchange, or plain text
    after the reply). ChatML (SmolLM2, Qwen): `<|im_end|>`; Llama 3: `<|eot_id|>`."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _MARK}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception:  # a template's own raise_exception (e.g. a required system turn)
        return None
    if not isinstance(text, str) or _MARK not in text:
        return None
    after = text[text.rindex(_MARK) + len(_MARK) :]
    ids = tokenizer.encode(after, add_special_tokens=False) if after else []
    special = set(getattr(tokenizer, "all_special_ids", ())) | set(
        getattr(tokenizer, "get_added_vocab", dict)().values()
    )
    return int(ids[0]) if ids and ids[0] in special else None


def stop_token_ids(eos_ids: tuple[int, ...], tokenizer) -> tuple[int, ...]:
    """`eos_ids` plus the chat template's end-of-turn token when it is not among them."""
    turn_end = end_of_turn_id(tokenizer)
    if turn_end is None or turn_end in eos_ids:
        return tuple(eos_ids)
    return (*eos_ids, turn_end)


# Answer formats ----------------------------------------------------------------------------------

_ANSWER_TAG = re.compile(r"<answer>([^<]*)</answer>")


def _extract_tag(text: str) -> str | None:
    """Content of the last `<answer>...</answer>` (no `<` inside), stripped."""
    if not isinstance(text, str):
        return None
    last = None
    for match in _ANSWER_TAG.finditer(text[-MAX_SCAN_CHARS:]):
        last = match
    if last is None:
        return None
    answer = last.group(1).strip()
    return answer if 0 < len(answer) <= MAX_ANSWER_CHARS else None


def _extract_text(text: str) -> str | None:
    if not isinstance(text, str):
        return None
    answer = text[-MAX_SCAN_CHARS:].strip()
    return answer if 0 < len(answer) <= MAX_ANSWER_CHARS else None


@dataclasses.dataclass(frozen=True)
class AnswerFormat:
    """Where a reply's final answer sits.

    extract: reply text -> the answer (None: the reply holds none; it scores 0).
    write: an answer -> how a demonstration ends with it.
    marker: what the instruction or system prompt must mention so that the model is asked for
      this format ("" for formats any reply has).
    """

    name: str
    extract: Callable[[str], str | None]
    write: Callable[[str], str]
    marker: str = ""


ANSWER_FORMATS = {
    f.name: f
    for f in (
        AnswerFormat("boxed", extract_boxed, lambda a: f"The answer is \\boxed{{{a}}}.", "\\boxed"),
        AnswerFormat("answer_tag", _extract_tag, lambda a: f"<answer>{a}</answer>", "<answer>"),
        AnswerFormat("last_number", extract_last_number, lambda a: f"The answer is {a}."),
        AnswerFormat("text", _extract_text, lambda a: a),
    )
}


def answer_format(name: str) -> AnswerFormat:
    """The format called `name`; ValueError listing the known ones."""
    if name not in ANSWER_FORMATS:
        raise ValueError(f"answer_format={name!r}; choose one of {sorted(ANSWER_FORMATS)}")
    return ANSWER_FORMATS[name]


def check_format_is_asked(name: str, instruction: str, system_prompt: str | None) -> None:
    """ValueError when format `name` has a marker that neither the instruction nor the system
    prompt mentions: the model would never be asked to write its answer there, and every
    reward would be 0."""
    marker = answer_format(name).marker
    if marker and marker not in (instruction or "") + (system_prompt or ""):
        raise ValueError(
            f"answer_format={name!r} reads the answer from {marker!r}, but neither "
            f"TaskSpec.instruction ({instruction!r}) nor TaskSpec.system_prompt mentions it; ask "
            f"for it there, or choose a format the prompt asks for (e.g. 'last_number')"
        )

"""reasoning-gym tasks and chat-templated prompts: the index layout (determinism, a held-out split
disjoint from the train stream), the reward through reasoning-gym's own `score_answer`, prompt
rendering and the end-of-turn stop id, SFT demonstrations, and the errors a bad config gets
before any device work. Offline: a ChatML character tokenizer built here, no download."""

from __future__ import annotations

import json
import os

import gin
import numpy as np
import pytest
import tokenizers
import transformers
from tokenizers import decoders, models

from jaxrl.infra.errors import DataError
from jaxrl.job.specs import PolicySpec, TaskSpec, build_model_config, with_end_of_turn
from jaxrl.models.config import ModelConfig
from jaxrl.tasks.chat import (
    ChatTemplateError,
    end_of_turn_id,
    render_prompt,
    stop_token_ids,
)
from jaxrl.tasks.reasoning_gym import TRAIN_BASE, ReasoningGymSource, is_heldout, score_reply
from jaxrl.tasks.rewards import compute_rewards, decode_completions
from jaxrl.tasks.tokenizer import build_arithmetic_tokenizer

pytest.importorskip("reasoning_gym")

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
ADDITION = {
    "min_terms": 2,
    "max_terms": 2,
    "min_digits": 1,
    "max_digits": 2,
    "operators": ["+", "-"],
    "allow_parentheses": False,
    "allow_negation": False,
}


def chatml_tokenizer(chat_template: str | None = CHATML) -> transformers.PreTrainedTokenizerFast:
    """Characters of printable ASCII plus ChatML's special tokens; EOS is `<|endoftext|>`, as in
    a checkpoint whose config names the document end, not the end of a turn."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for code in [*range(32, 127), *range(160, 256)]:  # ASCII and Latin-1 ("£" in gsm_symbolic)
        vocab[chr(code)] = len(vocab)
    vocab["\n"] = len(vocab)
    core = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.add_special_tokens(SPECIALS)
    core.decoder = decoders.Fuse()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        chat_template=chat_template,
    )


def addition_source(tokenizer=None, **overrides) -> ReasoningGymSource:
    kwargs = dict(
        seed=3, instruction="Give only the final answer.", answer_format_name="last_number"
    )
    kwargs.update(heldout_size=overrides.pop("heldout_size", 64), **overrides)
    return ReasoningGymSource(
        "basic_arithmetic", dict(ADDITION), tokenizer or chatml_tokenizer(), **kwargs
    )


def test_items_are_a_pure_function_of_config_and_index():
    a, b = addition_source(), addition_source()
    for i in (0, 1, 7, 2**20 - 1, 2**20, 5 * 2**20 + 3):  # across train chunks
        assert a.item(i) == b.item(i)
    assert a.eval_items(16) == b.eval_items(16)
    other_seed = addition_source(seed=4)
    assert [other_seed.item(i).text for i in range(8)] != [a.item(i).text for i in range(8)]
    # The train stream is not the held-out list shifted: train item 0 is drawn from the seed
    # TRAIN_BASE past the task's own.
    assert json.loads(a.item(0).reference)["seed"] >= 3 + TRAIN_BASE


def test_train_stream_never_holds_a_heldout_question():
    # One-digit products: 100 ordered pairs, so the raw draws repeat held-out questions often;
    # the train stream must redraw every one of them, and keep the others.
    config = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    source = ReasoningGymSource(
        "products", config, chatml_tokenizer(), seed=0, instruction="", heldout_size=60,
        answer_format_name="last_number",
    )  # fmt: skip
    heldout = {it.text for it in source.eval_items(60)}
    ask = "Solve the following multiplication: {} * {}. Give only the result as your final answer."
    questions = {ask.format(a, b) for a in range(10) for b in range(10)}
    space = {source.prompt(q) for q in questions}
    assert heldout <= space and 5 <= len(heldout) <= 25  # ~1 in 8 of the 100 questions
    raw = [source._dataset(source._train_entry(p)[0])[p]["question"] for p in range(300)]
    assert sum(is_heldout(q) for q in raw) > 15  # the exclusion has work to do
    train = {source.item(i).text for i in range(1500)}
    assert not train & heldout
    assert train == {source.prompt(q) for q in questions if not is_heldout(q)}  # all the others
    # The held-out sample keeps the task's proportions: two-digit sums, half of which are
    # one-digit problems in the draws, stay about half one-digit in the held-out set.
    mixed = addition_source(heldout_size=400)
    one_digit = [json.loads(it.reference) for it in mixed.eval_items(400)]
    share = np.mean(
        [mixed.entry((r["seed"], r["index"]))["metadata"]["num_digits"] == 1 for r in one_digit]
    )
    assert 0.35 < share < 0.65


def test_eval_size_above_the_heldout_pool_is_refused():
    with pytest.raises(ValueError, match="raise heldout_size"):
        addition_source(heldout_size=8).eval_items(9)


def test_reward_is_score_answer_of_the_extracted_answer():
    source = addition_source()
    items = [source.item(i) for i in range(6)] + source.eval_items(6)
    for it in items:
        record = json.loads(it.reference)
        entry = source.entry((record["seed"], record["index"]))
        gold = entry["answer"]
        dataset = source._dataset(record["seed"])
        right = f"First, {entry['question']} Adding up, we get {gold}."
        assert score_reply(right, it.reference) == dataset.score_answer(gold, entry) == 1.0
        wrong = f"The answer is {int(gold) + 1}."
        assert score_reply(wrong, it.reference) == dataset.score_answer(str(int(gold) + 1), entry)
        assert score_reply(wrong, it.reference) == 0.0
        assert score_reply("I do not know.", it.reference) == 0.0
    # Batched through the registry, as the RL loop and the evaluation call it.
    refs = [it.reference for it in items[:2]]
    golds = [
        source.entry(tuple(json.loads(r)[k] for k in ("seed", "index")))["answer"] for r in refs
    ]
    rewards = compute_rewards("reasoning_gym", ["p", "p"], [f"= {golds[0]}", "none"], refs)
    np.testing.assert_array_equal(rewards, [1.0, 0.0])


def test_reward_reads_the_assistant_reply_only():
    """The prompt holds the question's numbers and the chat markup; only the completion's
    decoded text (special tokens dropped) is scored."""
    tokenizer = chatml_tokenizer()
    source = addition_source(tokenizer)
    it = source.item(0)
    record = json.loads(it.reference)
    gold = source.entry((record["seed"], record["index"]))["answer"]
    turn_end = end_of_turn_id(tokenizer)
    reply_ids = tokenizer.encode(f"It is {gold}", add_special_tokens=False) + [turn_end]
    texts = decode_completions(tokenizer, [reply_ids])
    assert texts == [f"It is {gold}"]
    assert compute_rewards("reasoning_gym", [it.text], texts, [it.reference])[0] == 1.0
    prompt_with_answer = it.text + gold  # the answer in the prompt does not count
    assert (
        compute_rewards("reasoning_gym", [prompt_with_answer], ["no idea"], [it.reference])[0]
        == 0.0
    )


@pytest.mark.parametrize(
    "fmt, instruction, reply, expected",
    [
        ("boxed", "Put it in \\boxed{}.", "so \\boxed{ANS} and 3", 1.0),
        ("boxed", "Put it in \\boxed{}.", "ANS", 0.0),
        ("answer_tag", "Answer in <answer></answer>.", "x <answer> ANS </answer> 3", 1.0),
        ("text", "", " ANS \n", 1.0),
        ("text", "", "ANS.", None),  # None: the dataset's partial credit, len(gold) / len(reply)
    ],
)
def test_answer_formats(fmt, instruction, reply, expected):
    source = addition_source(instruction=instruction, answer_format_name=fmt)
    it = source.item(0)
    record = json.loads(it.reference)
    gold = source.entry((record["seed"], record["index"]))["answer"]
    assert record["format"] == fmt
    if expected is None:
        entry = source.entry((record["seed"], record["index"]))
        expected = source._dataset(record["seed"]).score_answer(gold + ".", entry)
        assert 0 < expected < 1
    assert score_reply(reply.replace("ANS", gold), it.reference) == expected


def test_chat_rendering_and_end_of_turn_stop_id():
    tokenizer = chatml_tokenizer()
    text = render_prompt(tokenizer, "Calculate 2 + 3.", instruction="Be brief.", system_prompt="S")
    assert text == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nCalculate 2 + 3.\nBe brief.<|im_end|>"
        "\n<|im_start|>assistant\n"
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert end_of_turn_id(tokenizer) == im_end
    eos = tokenizer.eos_token_id
    assert stop_token_ids((eos,), tokenizer) == (eos, im_end)
    assert stop_token_ids((eos, im_end), tokenizer) == (eos, im_end)
    # A checkpoint whose config.json names <|endoftext|> only: the model config that
    # build_model_config gives the RL loop, the samplers and the evaluation stops at <|im_end|>.
    config = ModelConfig("llama", 128, 16, 32, 1, 2, 1, 8, eos_token_id=eos)
    assert with_end_of_turn(config, tokenizer).eos_token_ids == (eos, im_end)
    # The character tasks keep their tokenizer, whose template ends a turn with <eos>.
    char = build_arithmetic_tokenizer()
    assert end_of_turn_id(char) == char.eos_token_id
    assert build_model_config(PolicySpec(), char).eos_token_ids == (char.eos_token_id,)


def test_gsm_symbolic_worked_solutions_as_demonstrations():
    tokenizer = chatml_tokenizer()
    source = ReasoningGymSource(
        "gsm_symbolic", {}, tokenizer, seed=0, heldout_size=4,
        instruction="Put your final answer within \\boxed{}.",
    )  # fmt: skip
    text = source.demonstration_text(0)
    record = json.loads(source.item(0).reference)
    entry = source.entry((record["seed"], record["index"]))
    cot = entry["metadata"]["answer_cot"]
    assert text.startswith(cot.split("\n")[0]) and "####" not in text
    assert text.endswith(f"\\boxed{{{entry['answer']}}}.")
    assert score_reply(text, source.item(0).reference) == 1.0  # a demonstration earns the reward
    tokens, mask = source.demonstrations(0, 2, tokenizer, seq_len=1024)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    taught = tokens[0][mask[0]].tolist()
    assert taught[-1] == im_end
    assert tokenizer.decode(taught[:-1]) == text
    prompt = tokens[0][: np.argmax(mask[0])].tolist()
    assert prompt == tokenizer.encode(source.item(0).text, add_special_tokens=False)


# Errors, each before any device work ------------------------------------------------------------


def test_unknown_dataset_lists_close_names():
    with pytest.raises(
        ValueError, match=r"not a reasoning-gym dataset; close names: \['basic_arithmetic'"
    ):
        TaskSpec(name="reasoning_gym", dataset="basic_arithmetc").validate()


@pytest.mark.parametrize(
    "config, message",
    [
        ({"max_term": 2}, r"unknown field\(s\) \['max_term'\]; BasicArithmeticDatasetConfig takes"),
        ({"min_terms": 3, "max_terms": 2}, "rejected by BasicArithmeticDatasetConfig: max_terms"),
        ({"operators": ["^"]}, "unsupported operator"),
        ({"seed": 1}, "set TaskSpec.seed instead"),
    ],
)
def test_bad_dataset_config(config, message):
    with pytest.raises(ValueError, match=message):
        TaskSpec(name="reasoning_gym", dataset="basic_arithmetic", dataset_config=config).validate()


def test_scorers_that_evaluate_text_and_unasked_formats_are_refused():
    with pytest.raises(ValueError, match="evaluating the model's text"):
        TaskSpec(name="reasoning_gym", dataset="countdown").validate()
    with pytest.raises(ValueError, match="neither TaskSpec.instruction"):
        TaskSpec(
            name="reasoning_gym",
            dataset="chain_sum",
            instruction="Be brief.",
            answer_format="boxed",
        ).validate()


def test_missing_chat_template_is_a_clear_error():
    with pytest.raises(ChatTemplateError, match="has none: start from an instruct model"):
        addition_source(chatml_tokenizer(chat_template=None))
    with pytest.raises(ValueError, match="cannot spell reasoning-gym"):
        addition_source(build_arithmetic_tokenizer())  # no uppercase: the preset's tokenizer
    assert issubclass(ChatTemplateError, DataError)  # launchers report it in one line


def test_launch_refuses_an_unknown_dataset_before_the_workdir(tmp_path):
    from jaxrl.infra.launcher import launch
    from launch.rl import rl_main

    workdir = tmp_path / "run"
    config = os.path.join(
        os.path.dirname(os.path.dirname(__file__)), "configs/rl/smollm2_arith.gin"
    )
    flags = ["--gin_file", config, "--workdir", str(workdir)]
    flags += ["--gin_param", "TaskSpec.dataset = 'basic_arithmatic'"]
    flags += ["--gin_param", f"PolicySpec.init_from = '{tmp_path}'"]  # the config requires one
    try:
        with pytest.raises(SystemExit, match="config error: .*close names: \\['basic_arithmetic'"):
            launch(rl_main, flags)
    finally:
        gin.clear_config()
    assert not os.path.exists(workdir)

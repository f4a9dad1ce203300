"""The arithmetic tokenizer: fixed small ids, character-level, offline save/load round trip."""

import json

import pytest
import transformers

from jaxrl.tasks.tokenizer import (
    ARITHMETIC_CHARS,
    SPECIAL_TOKENS,
    build_arithmetic_tokenizer,
)

TEXTS = ["37+45=82", "what is 3 * 4?\n", "9-10=-1", "", "A٣#"]
CHAT = [
    {"role": "user", "content": "37+45="},
    {"role": "assistant", "content": "82"},
    {"role": "user", "content": "1+2="},
]


@pytest.fixture(scope="module")
def tokenizer():
    return build_arithmetic_tokenizer()


def test_ids_are_small_and_fixed(tokenizer):
    assert len(tokenizer) == len(SPECIAL_TOKENS) + len(ARITHMETIC_CHARS) == 53
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id) == (0, 1)
    assert (tokenizer.eos_token_id, tokenizer.unk_token_id) == (2, 3)
    # Independent reference: '<bos>' then one id per character, digits at 4..13, '+' 15, '=' 18.
    assert tokenizer.encode("37+45=82") == [1, 7, 11, 15, 8, 9, 18, 12, 6]
    # Characters outside the vocabulary (upper case, Arabic-Indic digit, '#') are <unk>.
    assert tokenizer.encode("A٣#") == [1, 3, 3, 3]


def test_decode_concatenates_characters(tokenizer):
    ids = tokenizer.encode("12 + 3=15") + [tokenizer.eos_token_id]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "12 + 3=15"
    assert tokenizer.decode(ids) == "<bos>12 + 3=15<eos>"


def test_chat_template_is_the_raw_arithmetic_format(tokenizer):
    text = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert text == "<bos>37+45=82<eos>1+2="
    ids = tokenizer.apply_chat_template(CHAT[:1], tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict | transformers.BatchEncoding) else ids
    assert list(ids) == [1, 7, 11, 15, 8, 9, 18]  # one <bos>, not two


def test_save_pretrained_round_trips_through_auto_tokenizer(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<eos>"
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert len(loaded) == len(tokenizer)
    for text in TEXTS:
        assert loaded.encode(text) == tokenizer.encode(text)
        ids = tokenizer.encode(text)
        assert loaded.decode(ids) == tokenizer.decode(ids)
    for attr in ("pad_token_id", "bos_token_id", "eos_token_id", "unk_token_id"):
        assert getattr(loaded, attr) == getattr(tokenizer, attr)
    assert loaded.apply_chat_template(CHAT, tokenize=False) == tokenizer.apply_chat_template(
        CHAT, tokenize=False
    )
    batch = loaded(["1+2=", "11+22="], padding=True)
    assert batch["input_ids"] == [[1, 5, 15, 6, 18, 0, 0], [1, 5, 5, 15, 6, 6, 18]]

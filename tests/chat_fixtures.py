"""Tokenizers for tests of chat tasks (nothing is downloaded): an offline ChatML character
tokenizer with SmolLM2-135M-Instruct's chat template, and SmolLM2's own tokenizer."""

from __future__ import annotations

import lzma
import os
import shutil

import tokenizers
import transformers
from tokenizers import decoders, models

# SmolLM2-135M-Instruct's chat template (its tokenizer_config.json), default system turn included.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def chatml_tokenizer(template: str | None = SMOLLM2_TEMPLATE):
    """Printable ASCII characters and ChatML's special tokens; EOS and pad `<|im_end|>` (as
    SmolLM2's)."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in [*map(chr, range(32, 127)), "\n"]:
        vocab[ch] = len(vocab)
    core = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<|endoftext|>"))
    core.add_special_tokens(SPECIALS)
    core.decoder = decoders.Fuse()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
        chat_template=template,
    )


SMOLLM2_TOKENIZER = os.path.join(os.path.dirname(__file__), "data", "smollm2_tokenizer")


def smollm2_tokenizer(directory: str):
    """SmolLM2-135M-Instruct's own tokenizer (tests/data/smollm2_tokenizer), unpacked into
    `directory` and loaded as the library loads a checkpoint's (`jaxrl.models.hf`)."""
    from jaxrl.models import hf

    os.makedirs(directory, exist_ok=True)
    shutil.copy(os.path.join(SMOLLM2_TOKENIZER, "tokenizer_config.json"), directory)
    with lzma.open(os.path.join(SMOLLM2_TOKENIZER, "tokenizer.json.xz")) as packed:
        with open(os.path.join(directory, "tokenizer.json"), "wb") as out:
            shutil.copyfileobj(packed, out)
    return hf.load_tokenizer(directory)

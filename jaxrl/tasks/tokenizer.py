"""An offline, character-level tokenizer for the synthetic arithmetic task.

Built with the `tokenizers` library and wrapped as a `transformers.PreTrainedTokenizerFast`, so it
saves and loads like any Hugging Face tokenizer (`save_pretrained`, then
`AutoTokenizer.from_pretrained`) and nothing is ever downloaded.

Ids are small and fixed: the four special tokens come first, then the characters in
`ARITHMETIC_CHARS` in order::

    0 <pad>   1 <bos>   2 <eos>   3 <unk>   4 '0' ... 13 '9'   14 ' '   15 '+'   16 '-' ...

Every character is one token (a BPE model with no merges over a character vocabulary); characters
outside the vocabulary map to `<unk>`. `encode(text)` prepends `<bos>` (like Llama), decoding
concatenates characters without separators.

The chat template is deliberately minimal: user (and system) contents are emitted verbatim and each
assistant turn ends with `<eos>`. So `[{"role": "user", "content": "37+45="}]` renders to
`<bos>37+45=`: the chat form of a prompt is its raw arithmetic form, and a 0.4M-parameter model
spends no capacity on role markers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import tokenizers
from tokenizers import decoders, models, processors

if TYPE_CHECKING:
    import transformers

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<bos>"
EOS_TOKEN = "<eos>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)

# Digits and operators first so that arithmetic uses ids 4-18; lowercase letters and a little
# punctuation let the same tokenizer spell short instructions ("what is 3+4?").
ARITHMETIC_CHARS = "0123456789 +-*=\n.,?:/()" + "abcdefghijklmnopqrstuvwxyz"

ARITHMETIC_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{{ message['content'] }}{{ eos_token }}"
    "{% else %}{{ message['content'] }}{% endif %}"
    "{% endfor %}"
)

# Prompts plus completions of the arithmetic task are a few dozen characters.
_MODEL_MAX_LENGTH = 512


def arithmetic_vocab() -> dict[str, int]:
    """The token -> id table: special tokens 0-3, then `ARITHMETIC_CHARS` in order."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in ARITHMETIC_CHARS:
        vocab[ch] = len(vocab)
    return vocab


def build_arithmetic_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """Build the character-level arithmetic tokenizer (vocab size `len(tokenizer)`, 53 ids).

    Returns a `PreTrainedTokenizerFast` with pad/bos/eos/unk set and `ARITHMETIC_CHAT_TEMPLATE`.
    `save_pretrained(dir)` followed by `AutoTokenizer.from_pretrained(dir)` gives the same ids and
    the same chat-template output.
    """
    # Imported here: reward workers use this module's token constants, and importing
    # transformers costs ~0.6 s.
    import transformers

    vocab = arithmetic_vocab()
    # BPE without merges over a character vocabulary is exactly a character tokenizer, with <unk>
    # for anything else; no pre-tokenizer so spaces and newlines are ordinary tokens.
    core = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK_TOKEN))
    core.add_special_tokens(list(SPECIAL_TOKENS))
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A $B",
        special_tokens=[(BOS_TOKEN, vocab[BOS_TOKEN])],
    )
    # Without a decoder `tokenizers` joins tokens with spaces; Fuse concatenates them.
    core.decoder = decoders.Fuse()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        chat_template=ARITHMETIC_CHAT_TEMPLATE,
        model_max_length=_MODEL_MAX_LENGTH,
    )

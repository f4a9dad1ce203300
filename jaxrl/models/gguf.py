"""GGUF (llama.cpp) checkpoints -> a Hugging Face directory this library loads, without torch.

    from jaxrl.models import gguf
    gguf.import_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2/")
    model = hf.load_model("smollm2/")

The directory written is a standard `save_pretrained` one (`config.json`, `model.safetensors`,
`tokenizer.json` + `tokenizer_config.json` with the chat template and special tokens,
`generation_config.json`), so everything that reads HF directories (`hf.load_model`,
`PolicySpec.init_from`, `launch.generate`, `launch.eval`, `launch.export`, `transformers`)
reads it unchanged. It is written under a temporary name and renamed into place: an import
that fails leaves nothing at the target.

What is converted:
- architecture `llama` only (`general.architecture`; SmolLM2, Llama 2/3, TinyLlama layouts);
- tensor types `SUPPORTED_TENSOR_TYPES`, dequantised to float32 by `gguf.quants.dequantize`
  (the GGML reference formulas, e.g. Q4_1: `w = d * q + m` per block of 32);
- llama.cpp's converter permutes the rows of `attn_q` / `attn_k` so that its RoPE rotates
  adjacent pairs (x[2i], x[2i+1]); HF's `rotate_half` rotates (x[i], x[i + d/2]) within each
  head. `unpermute_rope_rows` applies the inverse (the one transformers' GGUF loader applies);
- no `output.weight`: tied embeddings (`tie_word_embeddings`);
- the tokenizer: `jaxrl.models.gguf_tokenizer`.

The config's `eos_token_id` is the end-of-turn token (`tokenizer.ggml.eot_token_id`, else
`eos_token_id`; both when they differ), so generation stops at the end of an assistant turn.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxrl.models.config import ModelConfig, RopeConfig, UnsupportedModelError

SUPPORTED_ARCHITECTURES = ("llama",)
# Tensor types dequantised here. tests/test_gguf.py checks each: the ones `gguf` can quantise
# against the weights they were quantised from, the K-quants against transformers' dequantiser.
SUPPORTED_TENSOR_TYPES = (
    *("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"),
    *("Q4_K", "Q5_K", "Q6_K"),
)

# GGUF tensor name (per layer: `blk.{i}.` prefix) -> HF name (per layer: `model.layers.{i}.`).
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


class GGUFError(ValueError):
    """A GGUF file is unreadable (not GGUF, truncated, corrupt) or inconsistent."""


class UnsupportedGGUFError(GGUFError, UnsupportedModelError):
    """A GGUF file asks for an architecture, tensor type or feature not converted here."""


def open_gguf(path: str):
    """A `gguf.GGUFReader` over `path` (memory-mapped), with readable errors for files that are
    missing, empty, not GGUF, truncated or whose header is corrupt."""
    import gguf

    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file {path!r} does not exist")
    size = os.path.getsize(path)
    if size == 0:
        raise GGUFError(f"{path} is empty (0 bytes); download it again")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise GGUFError(
            f"{path} is not a GGUF file: it starts with {magic!r}, not b'GGUF' (is it a "
            "safetensors or pickle checkpoint, or a download error page?)"
        )
    try:
        return gguf.GGUFReader(path)
    except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError, MemoryError) as e:
        raise GGUFError(
            f"{path} ({size:,} bytes) is truncated or corrupt: its header or tensor table does "
            f"not fit the file ({type(e).__name__}: {e}). Download it again."
        ) from None


def read_metadata(reader) -> dict[str, Any]:
    """Every key-value field of the GGUF header as Python values (strings, numbers, lists)."""
    out = {}
    for name, field in reader.fields.items():
        try:
            out[name] = field.contents()
        except (ValueError, IndexError, UnicodeDecodeError) as e:
            raise GGUFError(
                f"GGUF metadata field {name!r} is unreadable ({e}); the file is corrupt"
            ) from None
    return out


def _required(metadata: dict, key: str):
    if key not in metadata:
        raise GGUFError(f"the GGUF has no {key!r} metadata, which a llama model needs")
    return metadata[key]


def model_config(metadata: dict[str, Any]) -> ModelConfig:
    """The `ModelConfig` a llama-architecture GGUF describes (float32 parameters)."""
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedGGUFError(
            f"GGUF architecture {arch!r} is not supported: this importer converts "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} only (SmolLM2, Llama 2/3, TinyLlama). For a "
            "Qwen2/Qwen3 model, load its Hugging Face safetensors directory instead."
        )
    if metadata.get(f"{arch}.expert_count", 0):
        raise UnsupportedGGUFError(
            f"{arch}.expert_count = {metadata[f'{arch}.expert_count']}: mixture-of-experts "
            "models are not supported (dense llama only)"
        )
    scaling = metadata.get(f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        raise UnsupportedGGUFError(
            f"{arch}.rope.scaling.type = {scaling!r}: RoPE scaling in GGUF files is not "
            "converted here (only unscaled RoPE); load the model's HF directory instead"
        )
    hidden = int(_required(metadata, f"{arch}.embedding_length"))
    heads = int(_required(metadata, f"{arch}.attention.head_count"))
    kv_heads = int(metadata.get(f"{arch}.attention.head_count_kv", heads))
    head_dim = int(metadata.get(f"{arch}.attention.key_length", hidden // heads))
    rotated = int(metadata.get(f"{arch}.rope.dimension_count", head_dim))
    if rotated != head_dim:
        raise UnsupportedGGUFError(
            f"{arch}.rope.dimension_count = {rotated} rotates part of each head of {head_dim}: "
            "partial RoPE is not supported"
        )
    tokens = metadata.get("tokenizer.ggml.tokens") or ()
    vocab = int(metadata.get(f"{arch}.vocab_size", len(tokens)))
    eos = metadata.get("tokenizer.ggml.eos_token_id")
    eot = metadata.get("tokenizer.ggml.eot_token_id")
    eos_ids = tuple(dict.fromkeys(int(i) for i in (eot, eos) if i is not None))
    bos = metadata.get("tokenizer.ggml.bos_token_id")
    pad = metadata.get("tokenizer.ggml.padding_token_id")
    return ModelConfig(
        model_type="llama",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(_required(metadata, f"{arch}.feed_forward_length")),
        num_layers=int(_required(metadata, f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(metadata.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope=RopeConfig(theta=float(metadata.get(f"{arch}.rope.freq_base", 10000.0))),
        max_position_embeddings=int(metadata.get(f"{arch}.context_length", 4096)),
        tie_word_embeddings=True,  # set to False below when the file has output.weight
        bos_token_id=None if bos is None else int(bos),
        eos_token_id=(eos_ids[0] if len(eos_ids) == 1 else eos_ids) if eos_ids else None,
        pad_token_id=None if pad is None else int(pad),
    )


def unpermute_rope_rows(w_oi: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's Q / K row order -> HF's rotate-half order.

    llama.cpp's converter writes, per head, the rows `[h, 2, d/2]` transposed to `[h, d/2, 2]`
    (interleaving the two halves that HF's `rotate_half` pairs up); this is the inverse:
    `w.reshape(h, d/2, 2, in).swapaxes(1, 2)`. `w_oi` is `[num_heads * head_dim, in]`.
    """
    rows = w_oi.shape[0]
    if rows % (2 * num_heads):
        raise GGUFError(f"{rows} rows do not split into {num_heads} heads of even size")
    half = rows // num_heads // 2
    w = w_oi.reshape(num_heads, half, 2, *w_oi.shape[1:])
    return w.swapaxes(1, 2).reshape(w_oi.shape)


def _hf_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> the shape the config needs (torch Linear layout: [out, in])."""
    e, d = c.hidden_size, c.head_dim
    shapes = {"model.embed_tokens.weight": (c.vocab_size, e), "model.norm.weight": (e,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, e)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (e,),
            p + "post_attention_layernorm.weight": (e,),
            p + "self_attn.q_proj.weight": (c.num_heads * d, e),
            p + "self_attn.k_proj.weight": (c.num_kv_heads * d, e),
            p + "self_attn.v_proj.weight": (c.num_kv_heads * d, e),
            p + "self_attn.o_proj.weight": (e, c.num_heads * d),
            p + "mlp.gate_proj.weight": (c.intermediate_size, e),
            p + "mlp.up_proj.weight": (c.intermediate_size, e),
            p + "mlp.down_proj.weight": (e, c.intermediate_size),
        }
    return shapes


def hf_name(gguf_name: str) -> str:
    """The HF tensor name of a llama GGUF tensor; `UnsupportedGGUFError` for any other tensor."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{int(parts[1])}.{_LAYER_TENSORS[parts[2]]}"
    raise UnsupportedGGUFError(
        f"GGUF tensor {gguf_name!r} has no counterpart in the llama model converted here "
        "(e.g. rope_freqs for llama3 RoPE scaling, or biases); this file is not supported"
    )


def dequantize_tensor(tensor) -> np.ndarray:
    """One `ReaderTensor` as float32 in its logical shape (row-major: `[rows, columns]`, the
    reverse of GGUF's `ne` order), checked finite."""
    from gguf import quants

    type_name = tensor.tensor_type.name
    if type_name not in SUPPORTED_TENSOR_TYPES:
        raise UnsupportedGGUFError(
            f"tensor {tensor.name!r} has type {type_name}, which is not supported (supported: "
            f"{', '.join(SUPPORTED_TENSOR_TYPES)}). Re-quantise the model with llama.cpp's "
            "`llama-quantize` to one of these (e.g. Q8_0), or import an F16 GGUF."
        )
    try:
        values = quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
    except (ValueError, AssertionError) as e:
        raise GGUFError(f"tensor {tensor.name!r} ({type_name}) is corrupt: {e}") from None
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    values = np.asarray(values, np.float32).reshape(shape)
    if not np.isfinite(values).all():
        raise GGUFError(
            f"tensor {tensor.name!r} ({type_name}) dequantises to NaN or infinite values: the "
            "file is corrupt; download it again"
        )
    return values


def read_tensors(
    reader, config: ModelConfig, progress: Callable[[str], None] | None = None
) -> tuple[dict[str, np.ndarray], ModelConfig]:
    """Every tensor in HF names and layout (float32), and the config (tied embeddings resolved).

    Raises before dequantising anything if a tensor is of an unsupported type or name, and
    names any tensor that is missing or of the wrong shape.
    """
    by_name = {}
    for t in reader.tensors:
        hf_name(t.name)  # refuses unknown tensors up front
        if t.tensor_type.name not in SUPPORTED_TENSOR_TYPES:
            dequantize_tensor(t)  # raises UnsupportedGGUFError naming the type
        by_name[t.name] = t
    config = config.replace(tie_word_embeddings="output.weight" not in by_name)
    shapes = _hf_shapes(config)
    missing = sorted(set(shapes) - {hf_name(n) for n in by_name})
    if missing:
        raise GGUFError(
            f"the GGUF lacks {len(missing)} tensor(s) a {config.num_layers}-layer llama needs: "
            f"{missing[:4]}{' ...' if len(missing) > 4 else ''}"
        )
    out = {}
    start = time.perf_counter()
    for number, (name, tensor) in enumerate(by_name.items(), start=1):
        target = hf_name(name)
        values = dequantize_tensor(tensor)
        if values.shape != shapes[target]:
            raise GGUFError(
                f"tensor {name!r} has shape {values.shape} but the GGUF's config needs "
                f"{shapes[target]} (as {target})"
            )
        if name.endswith("attn_q.weight"):
            values = unpermute_rope_rows(values, config.num_heads)
        elif name.endswith("attn_k.weight"):
            values = unpermute_rope_rows(values, config.num_kv_heads)
        out[target] = values
        if progress is not None and (number % 50 == 0 or number == len(by_name)):
            progress(
                f"dequantised {number}/{len(by_name)} tensors ({time.perf_counter() - start:.1f}s)"
            )
    return out, config


def import_gguf(
    gguf_path: str,
    out_dir: str,
    *,
    dtype: str = "float32",
    overwrite: bool = False,
    progress: Callable[[str], None] | None = None,
) -> ModelConfig:
    """Writes the HF directory of the llama GGUF `gguf_path` at `out_dir`; returns its config.

    `dtype` ("float32" or "bfloat16") is the dtype the dequantised weights are stored in. The
    directory is assembled under a temporary name next to `out_dir` and renamed into place.
    """
    import ml_dtypes

    from jaxrl.models import hf
    from jaxrl.models.gguf_tokenizer import build_tokenizer
    from jaxrl.models.safetensors_io import SINGLE_FILE, write_safetensors

    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype {dtype!r}; use 'float32' or 'bfloat16'")
    if os.path.exists(out_dir) and not overwrite:
        raise FileExistsError(f"{out_dir} exists; pass overwrite=True (--overwrite) to replace it")
    say = progress or (lambda _: None)
    reader = open_gguf(gguf_path)
    metadata = read_metadata(reader)
    config = model_config(metadata)
    tokenizer = build_tokenizer(metadata)  # before the slow part: a bad vocabulary fails fast
    if len(tokenizer) > config.vocab_size:
        raise GGUFError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's vocabulary is "
            f"{config.vocab_size}"
        )
    say(
        f"{os.path.basename(gguf_path)}: {metadata.get('general.name', '?')}, {config.num_layers} "
        f"layers, hidden {config.hidden_size}, {config.num_heads}/{config.num_kv_heads} heads, "
        f"{len(reader.tensors)} tensors"
    )
    tensors, config = read_tensors(reader, config, progress=say)
    config = config.replace(param_dtype=dtype)
    if dtype == "bfloat16":
        tensors = {k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}

    parent = os.path.dirname(os.path.abspath(out_dir)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".gguf-import-", dir=parent)
    try:
        hf_config = config.to_hf()
        hf_config.architectures = ["LlamaForCausalLM"]
        hf_config.save_pretrained(tmp)
        write_safetensors(os.path.join(tmp, SINGLE_FILE), tensors, {"format": "pt"})
        hf._save_generation_config(config, tmp)
        tokenizer.save_pretrained(tmp, save_jinja_files=False)  # template in tokenizer_config
        hf._fit_tokenizer_config(tmp, config.max_position_embeddings)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it 0700
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    say(f"wrote {os.path.abspath(out_dir)}")
    return config

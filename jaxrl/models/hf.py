"""Hugging Face checkpoints: the name/layout map, loading from a `save_pretrained` directory.

A `save_pretrained` directory holds `config.json`, safetensors weights (one file or shards plus
an index) and usually a tokenizer. Weights are read one tensor at a time from memory-mapped
files, transformed to this model's layout, checked, cast and placed (optionally straight into a
target sharding), so host memory holds at most one tensor's worth beyond what was placed.

Only safetensors are read. Pickle-based weights (`pytorch_model.bin`, `*.pt`) can run code when
loaded and are refused with instructions to convert them.
"""

from __future__ import annotations

import dataclasses
import glob
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from jaxrl.infra.paths import missing_dir_message, user_path
from jaxrl.models.config import ModelConfig, UnsupportedModelError
from jaxrl.models.safetensors_io import SafetensorsReader
from jaxrl.models.transformer import Transformer

SAVE_PRETRAINED = "a save_pretrained directory: config.json, *.safetensors, the tokenizer files"
_PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
# Tensors some checkpoints carry that the model recomputes or does not use.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointMismatchError(ValueError):
    """A checkpoint's tensors do not fit the model its config describes."""


@dataclasses.dataclass(frozen=True)
class TensorMap:
    """How one model parameter is stored in a HF checkpoint.

    `to_model` turns the HF array into this model's layout; `to_hf` is its inverse.
    """

    hf_name: str
    to_model: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]


@dataclasses.dataclass(frozen=True)
class StackedTensorMap:
    """A model parameter stored as several HF tensors (one per expert: `hf_names[j]` is expert
    j's). `to_model` stacks the list of HF arrays into this model's layout; `to_hf` splits it
    back into that list."""

    hf_names: tuple[str, ...]
    to_model: Callable[[list[np.ndarray]], np.ndarray]
    to_hf: Callable[[np.ndarray], list[np.ndarray]]

    @property
    def hf_name(self) -> str:  # for messages: the first expert's tensor
        return self.hf_names[0]


def _stacked_experts() -> tuple[Callable, Callable]:
    # torch Linear [out, in] per expert <-> model [experts, in, out].
    return (lambda ws: np.stack([w.T for w in ws])), (lambda w: [x.T for x in w])


def _hf_names(spec) -> tuple[str, ...]:
    return spec.hf_names if isinstance(spec, StackedTensorMap) else (spec.hf_name,)


def _identity() -> tuple[Callable, Callable]:
    return (lambda w: w), (lambda w: w)


def _transpose() -> tuple[Callable, Callable]:
    # torch Linear stores [out, in]; this model's kernels are [in, out].
    return (lambda w: w.T), (lambda w: w.T)


def _in_heads(heads: int, head_dim: int) -> tuple[Callable, Callable]:
    # q/k/v: HF [heads * head_dim, embed] <-> model [embed, heads, head_dim].
    def to_model(w):
        return w.T.reshape(w.shape[1], heads, head_dim)

    def to_hf(w):
        return w.reshape(w.shape[0], heads * head_dim).T

    return to_model, to_hf


def _out_heads(heads: int, head_dim: int) -> tuple[Callable, Callable]:
    # o: HF [embed, heads * head_dim] <-> model [heads, head_dim, embed].
    def to_model(w):
        return w.T.reshape(heads, head_dim, w.shape[0])

    def to_hf(w):
        return w.reshape(heads * head_dim, w.shape[-1]).T

    return to_model, to_hf


def _bias_heads(heads: int, head_dim: int) -> tuple[Callable, Callable]:
    return (lambda w: w.reshape(heads, head_dim)), (lambda w: w.reshape(heads * head_dim))


def param_map(config: ModelConfig) -> dict[tuple, TensorMap | StackedTensorMap]:
    """Model parameter path (as in `nnx.state(model)`) -> how it is stored in HF checkpoints."""
    c = config
    out: dict[tuple, TensorMap] = {}

    def add(path, name, fns):
        out[path] = TensorMap(name, *fns)

    add(("embedding",), "model.embed_tokens.weight", _identity())
    add(("final_norm", "weight"), "model.norm.weight", _identity())
    if not c.tie_word_embeddings:
        add(("lm_head",), "lm_head.weight", _transpose())
    heads = {"q": c.num_heads, "k": c.num_kv_heads, "v": c.num_kv_heads}
    for i in range(c.num_layers):
        hf = f"model.layers.{i}"
        layer = ("layers", i)
        add((*layer, "input_norm", "weight"), f"{hf}.input_layernorm.weight", _identity())
        add(
            (*layer, "post_attention_norm", "weight"),
            f"{hf}.post_attention_layernorm.weight",
            _identity(),
        )
        attn = (*layer, "attention")
        for p, n in heads.items():
            add((*attn, f"{p}_kernel"), f"{hf}.self_attn.{p}_proj.weight", _in_heads(n, c.head_dim))
            if c.qkv_bias:
                add(
                    (*attn, f"{p}_bias"),
                    f"{hf}.self_attn.{p}_proj.bias",
                    _bias_heads(n, c.head_dim),
                )
        add(
            (*attn, "o_kernel"),
            f"{hf}.self_attn.o_proj.weight",
            _out_heads(c.num_heads, c.head_dim),
        )
        if c.o_bias:
            add((*attn, "o_bias"), f"{hf}.self_attn.o_proj.bias", _identity())
        if c.qk_norm:
            add((*attn, "q_norm", "weight"), f"{hf}.self_attn.q_norm.weight", _identity())
            add((*attn, "k_norm", "weight"), f"{hf}.self_attn.k_norm.weight", _identity())
        if c.is_moe_layer(i):
            # Qwen3-MoE, as save_pretrained writes it: the router `mlp.gate` and one
            # gate/up/down Linear per expert, stacked here on a leading expert axis.
            add((*layer, "mlp", "router_kernel"), f"{hf}.mlp.gate.weight", _transpose())
            for p in ("gate", "up", "down"):
                names = tuple(f"{hf}.mlp.experts.{j}.{p}_proj.weight" for j in range(c.num_experts))
                out[(*layer, "mlp", f"{p}_kernel")] = StackedTensorMap(names, *_stacked_experts())
            continue
        for p in ("gate", "up", "down"):
            add((*layer, "mlp", f"{p}_kernel"), f"{hf}.mlp.{p}_proj.weight", _transpose())
            if c.mlp_bias:
                add((*layer, "mlp", f"{p}_bias"), f"{hf}.mlp.{p}_proj.bias", _identity())
    return out


# What a full-precision checkpoint's tensors are stored as.
_FLOAT_TENSORS = tuple(
    np.dtype(t) for t in (np.float32, np.float16, np.float64, ml_dtypes.bfloat16)
)


def full_precision(array: np.ndarray, name: str, path: str) -> np.ndarray:
    """`array` (tensor `name` of the checkpoint at `path`), refused unless a full-precision
    float: an integer or 8-bit float tensor is a quantized checkpoint's."""
    if array.dtype not in _FLOAT_TENSORS:
        raise CheckpointMismatchError(
            f"tensor {name!r} in {path} is {array.dtype}, not a full-precision float (float32 / "
            "bfloat16 / float16): a quantized checkpoint. Policies load in full precision and "
            "the generator quantizes its own copy (GeneratorConfig.weights); load the model's "
            "bf16 / fp32 release, or dequantize this one first"
        )
    return array


def check_weights_dir(path: str) -> None:
    """Raises a clear error unless `path` is a directory with safetensors weights."""
    missing = missing_dir_message(path, SAVE_PRETRAINED)
    if missing:
        raise FileNotFoundError(missing)
    if glob.glob(os.path.join(path, "*.safetensors")):
        return
    pickles = [os.path.basename(p) for pat in _PICKLE_PATTERNS for p in glob.glob(f"{path}/{pat}")]
    if pickles:
        raise UnsupportedModelError(
            f"{path} holds only pickle-based weights ({', '.join(sorted(pickles))}). Pickle files "
            "can execute code when loaded, so they are never read here. Convert them once, in an "
            "environment you trust: `transformers.AutoModelForCausalLM.from_pretrained(DIR)"
            ".save_pretrained(OUT_DIR)` writes safetensors; then load OUT_DIR."
        )
    raise FileNotFoundError(f"no *.safetensors weights in {path}")


def load_config(path: str, **overrides: Any) -> ModelConfig:
    """Reads `config.json` through `transformers.AutoConfig` (never `trust_remote_code`)."""
    import transformers

    path = user_path(path)
    missing = missing_dir_message(path, SAVE_PRETRAINED)
    if missing:
        raise FileNotFoundError(missing)
    if not os.path.exists(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"{path} has no config.json; is it a save_pretrained directory?")
    try:
        hf_config = transformers.AutoConfig.from_pretrained(path, trust_remote_code=False)
    except ValueError as e:
        # AutoConfig refuses model types it does not know; say what this library supports.
        raise UnsupportedModelError(f"{path}/config.json: {e}") from None
    quantized = getattr(hf_config, "quantization_config", None)
    if quantized:
        method = (quantized if isinstance(quantized, dict) else vars(quantized)).get(
            "quant_method", "?"
        )
        raise UnsupportedModelError(
            f"{path} is a quantized checkpoint (quantization_config, quant_method {method!r}); "
            "policies load and train in full precision, and the generator quantizes its own "
            "copy (GeneratorConfig.weights = 'int8' / 'fp8'). Load the model's bf16 / fp32 "
            "release, or dequantize this one first"
        )
    return ModelConfig.from_hf(hf_config, **overrides)


def load_tokenizer(path: str):
    """The tokenizer saved next to the weights, through `AutoTokenizer` (local files only)."""
    import transformers

    path = user_path(path)
    missing = missing_dir_message(path, SAVE_PRETRAINED)
    if missing:
        raise FileNotFoundError(missing)
    return transformers.AutoTokenizer.from_pretrained(path, trust_remote_code=False)


def _path_key(path) -> tuple:
    return tuple(p.key if hasattr(p, "key") else p for p in path)


def load_params(path: str, config: ModelConfig, shardings: Any | None = None) -> nnx.State:
    """Reads the weights of `config`'s model from `path` into an `nnx.State`.

    `shardings`, if given, matches the state (an `nnx.State` of `Sharding`s as
    `jaxrl.infra.sharding.param_shardings` returns, or its pure dict); each tensor is then placed
    shard by shard, so no device ever holds more than its shards. Without it, parameters go to
    the default device. Host memory peaks at about two copies of the largest tensor (the bytes
    read and their transformed layout) on top of what was placed.
    """
    path = user_path(path)
    check_weights_dir(path)
    reader = SafetensorsReader(path)
    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    _, abstract_state = nnx.split(abstract)
    mapping = param_map(config)
    flat_shardings = None
    if shardings is not None:
        if isinstance(shardings, nnx.State):
            shardings = nnx.to_pure_dict(shardings)
        flat_shardings = {
            _path_key(p): s for p, s in jax.tree_util.tree_leaves_with_path(shardings)
        }

    expected_names = {n for m in mapping.values() for n in _hf_names(m)}
    unexpected = [
        n
        for n in reader
        if n not in expected_names
        and not n.endswith(_IGNORED_SUFFIXES)
        and not (config.tie_word_embeddings and n == "lm_head.weight")
    ]
    if unexpected:
        raise CheckpointMismatchError(
            f"{path} has tensors the {config.model_type} config does not describe: "
            f"{sorted(unexpected)[:8]}{' ...' if len(unexpected) > 8 else ''}. Is config.json from "
            "the same model?"
        )

    _check_present(path, reader, mapping, abstract_state, config)

    def read(key: tuple, shape: tuple, dtype) -> np.ndarray:
        """One HF tensor, checked and in this model's layout and dtype (host memory)."""
        spec = mapping.get(key)
        if spec is None:
            raise CheckpointMismatchError(f"no HF name known for model parameter {key}")
        if isinstance(spec, StackedTensorMap):
            return read_stacked(key, spec, shape, dtype)
        if spec.hf_name not in reader:
            raise CheckpointMismatchError(
                f"tensor {spec.hf_name!r} is missing from {path} (needed for model parameter "
                f"{'/'.join(map(str, key))}, shape {shape})"
            )
        hf_array = full_precision(reader[spec.hf_name], spec.hf_name, path)
        expected_hf_shape = spec.to_hf(np.empty(shape, np.uint8)).shape
        if hf_array.shape != expected_hf_shape:
            raise CheckpointMismatchError(
                f"tensor {spec.hf_name!r} in {path} has shape {hf_array.shape}, but the config "
                f"needs {expected_hf_shape} (model parameter {'/'.join(map(str, key))})"
            )
        host = np.asarray(spec.to_model(hf_array))
        del hf_array  # at most two host copies of this tensor are alive at once
        return host.astype(dtype, copy=False)

    def read_stacked(key, spec: StackedTensorMap, shape: tuple, dtype) -> np.ndarray:
        # Names and shapes were checked by _check_present.
        host = np.asarray(
            spec.to_model([full_precision(reader[n], n, path) for n in spec.hf_names])
        )
        return host.astype(dtype, copy=False)

    def load_leaf(key_path, variable):
        key = _path_key(key_path)
        target_shape = tuple(variable.shape)
        if config.scan_layers and key[0] == "layers":
            # Stacked: layer i of the leaf is HF tensor model.layers.{i}...; each device shard
            # reads the layers it holds (all of them: the layer axis is never sharded).
            layer_keys = [("layers", i, *key[1:]) for i in range(config.num_layers)]
            for k in layer_keys[:1]:  # shape / name errors before any placement
                read(k, target_shape[1:], variable.dtype)

            def host_slice(idx):
                rows = range(config.num_layers)[idx[0]]
                return np.stack([read(layer_keys[i], target_shape[1:], variable.dtype)[idx[1:]]
                                 for i in rows])  # fmt: skip
        else:
            host = read(key, target_shape, variable.dtype)

            def host_slice(idx):
                return host[idx]

        if flat_shardings is None:
            return jnp.asarray(host_slice((slice(None),) * len(target_shape)))
        sharding = flat_shardings[key]
        return jax.make_array_from_callback(target_shape, sharding, host_slice)

    values = jax.tree_util.tree_map_with_path(load_leaf, nnx.to_pure_dict(abstract_state))
    nnx.replace_by_pure_dict(abstract_state, values)
    return abstract_state


def _check_present(path, reader, mapping, abstract_state, config: ModelConfig) -> None:
    """Every tensor the model needs is in the checkpoint with its shape, from the files' headers
    alone: a missing or mis-shaped tensor (an expert of a mixture-of-experts layer, say) is
    refused before anything is read or placed on a device."""
    abstract = {
        _path_key(p): tuple(v.shape)
        for p, v in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(abstract_state))
    }
    for key, shape in abstract.items():
        if config.scan_layers and key[0] == "layers":
            keys = [(("layers", i, *key[1:]), shape[1:]) for i in range(config.num_layers)]
        else:
            keys = [(key, shape)]
        for k, s in keys:
            spec = mapping.get(k)
            if spec is None:
                raise CheckpointMismatchError(f"no HF name known for model parameter {k}")
            names = _hf_names(spec)
            expected = spec.to_hf(np.empty(s, np.uint8))
            expected = expected if isinstance(spec, StackedTensorMap) else [expected]
            where = "/".join(map(str, k))
            missing = [n for n in names if n not in reader]
            if missing and isinstance(spec, StackedTensorMap):
                raise CheckpointMismatchError(
                    f"expert tensors {missing[:4]}{' ...' if len(missing) > 4 else ''} are missing "
                    f"from {path} ({len(missing)} of the {len(names)} experts of model parameter "
                    f"{where}). config.json says num_experts={config.num_experts}: use the "
                    "config.json saved with these weights, or re-save the checkpoint with every "
                    "expert (save_pretrained writes model.layers.{i}.mlp.experts.{j}.*)."
                )
            if missing:
                continue  # read() names the missing tensor as before
            for n, e in zip(names, expected, strict=True):
                if tuple(reader.shape(n)) != tuple(e.shape):
                    hint = (
                        " Check hidden_size / moe_intermediate_size / num_experts in config.json "
                        "against the weights."
                        if ".mlp.experts." in n or n.endswith(".mlp.gate.weight")
                        else ""
                    )
                    raise CheckpointMismatchError(
                        f"tensor {n!r} in {path} has shape {tuple(reader.shape(n))}, but the "
                        f"config needs {tuple(e.shape)} (model parameter {where}).{hint}"
                    )


def load_model(
    path: str,
    *,
    mesh: jax.sharding.Mesh | None = None,
    rules: Any | None = None,
    **config_overrides: Any,
) -> Transformer:
    """A `Transformer` with the weights of the `save_pretrained` directory `path`.

    With `mesh` and `rules` (a logical-axis rules table, e.g.
    `jaxrl.infra.sharding.TRAINER_RULES`), every parameter is loaded straight into its sharding.
    `config_overrides` set what HF configs do not carry, e.g. `param_dtype="bfloat16"`,
    `dtype="bfloat16"`, `attention_impl="cudnn"`.
    """
    path = user_path(path)
    config = load_config(path, **config_overrides)
    graphdef, abstract_state = nnx.split(
        nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    )
    shardings = None
    if mesh is not None:
        from jaxrl.infra.sharding import param_shardings

        if rules is None:
            raise ValueError("load_model(mesh=...) needs the rules table that maps logical axes")
        shardings = param_shardings(abstract_state, mesh, rules)
    state = load_params(path, config, shardings)
    return nnx.merge(graphdef, state)


def save_hf(model: Transformer, path: str, tokenizer=None, dtype: str | None = None) -> None:
    """Writes a `save_pretrained`-style directory that `transformers` loads.

    Tensors are fetched and converted one at a time. `dtype` (e.g. "bfloat16") casts on the way;
    by default the parameters keep their dtype. The directory is written under a temporary name
    and renamed into place, so a crash never leaves a half-written export at `path`.
    """
    import shutil
    import tempfile

    import ml_dtypes

    from jaxrl.models.safetensors_io import SINGLE_FILE, write_safetensors

    config = model.config
    target = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else None
    if dtype not in (None, "bfloat16", "float32"):
        raise ValueError(f"export dtype {dtype!r}; use 'float32' or 'bfloat16'")
    if dtype == "float32":
        target = np.dtype(np.float32)
    state = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    mapping = param_map(config)
    tensors = {}
    for key_path, value in jax.tree_util.tree_leaves_with_path(state):
        key = _path_key(key_path)
        host = np.asarray(jax.device_get(value))
        host = host if target is None else host.astype(target)
        if config.scan_layers and key[0] == "layers":  # one HF tensor per layer
            pieces = {("layers", i, *key[1:]): host[i] for i in range(config.num_layers)}
        else:
            pieces = {key: host}
        for k, array in pieces.items():
            spec = mapping[k]
            if isinstance(spec, StackedTensorMap):
                for name, part in zip(spec.hf_names, spec.to_hf(array), strict=True):
                    tensors[name] = np.ascontiguousarray(part)
            else:
                tensors[spec.hf_name] = np.ascontiguousarray(spec.to_hf(array))
    parent = os.path.dirname(os.path.abspath(path)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".export-", dir=parent)
    try:
        hf_config = config.to_hf()
        if dtype is not None:
            hf_config.dtype = dtype
        hf_config.architectures = [
            {
                "llama": "LlamaForCausalLM",
                "qwen2": "Qwen2ForCausalLM",
                "qwen3": "Qwen3ForCausalLM",
                "qwen3_moe": "Qwen3MoeForCausalLM",
            }[config.model_type]
        ]
        hf_config.save_pretrained(tmp)
        write_safetensors(os.path.join(tmp, SINGLE_FILE), tensors)
        _save_generation_config(config, tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
            _fit_tokenizer_config(tmp, config.max_position_embeddings)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it 0700; an export is for others to read
        if os.path.exists(path):
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _save_generation_config(config: ModelConfig, directory: str) -> None:
    """`generation_config.json`: the special tokens `transformers.generate` needs (greedy by
    default, as the model was evaluated)."""
    import transformers

    eos = config.eos_token_id
    transformers.GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=list(eos) if isinstance(eos, tuple) else eos,
        pad_token_id=config.pad_token_id,
    ).save_pretrained(directory)


def _fit_tokenizer_config(directory: str, max_positions: int) -> None:
    """The exported tokenizer pads on the left (a decoder continues the prompt's last token: with
    right padding, batched `generate` in transformers continues from pad tokens and answers
    wrongly) and announces the model's context as its `model_max_length`."""
    import json

    path = os.path.join(directory, "tokenizer_config.json")
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:
        settings = json.load(f)
    settings["padding_side"] = "left"
    settings["model_max_length"] = max_positions
    with open(path, "w", encoding="utf-8") as f:
        json.dump(settings, f, indent=2, ensure_ascii=False)

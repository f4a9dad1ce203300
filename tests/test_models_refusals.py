"""What the model loader refuses, and that each refusal says why and what to do."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import transformers
from hf_fixtures import TINY, hf_config, save_tiny_checkpoint

from jaxrl.models import hf
from jaxrl.models.config import UnsupportedModelError
from jaxrl.models.safetensors_io import SafetensorsReader, write_safetensors


def _write_config(path, config) -> str:
    config.save_pretrained(path)
    return str(path)


def test_unknown_model_type_known_to_transformers(tmp_path):
    path = _write_config(tmp_path, transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2))
    with pytest.raises(UnsupportedModelError, match=r"model_type 'gpt2' is not supported"):
        hf.load_config(path)


def test_model_type_unknown_to_transformers(tmp_path):
    with open(tmp_path / "config.json", "w") as f:
        json.dump({"model_type": "mystery_lm", "hidden_size": 8}, f)
    with pytest.raises(UnsupportedModelError, match="mystery_lm"):
        hf.load_config(str(tmp_path))


def test_unknown_rope_type(tmp_path):
    rope = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    path = _write_config(tmp_path, transformers.LlamaConfig(**TINY, rope_parameters=rope))
    with pytest.raises(UnsupportedModelError, match=r"rope_type 'yarn' is not supported"):
        hf.load_config(path)


def test_sliding_window_refused(tmp_path):
    config = hf_config("qwen2")
    config.use_sliding_window = True
    path = _write_config(tmp_path, config)
    with pytest.raises(UnsupportedModelError, match="use_sliding_window=True is not supported"):
        hf.load_config(path)


def test_pickle_only_weights_refused_without_unpickling(tmp_path):
    path = _write_config(tmp_path, hf_config("llama3"))
    # Bytes that would run code if unpickled: the loader must not even open them.
    with open(os.path.join(path, "pytorch_model.bin"), "wb") as f:
        f.write(b"cos\nsystem\n(S'echo pwned'\ntR.")
    with pytest.raises(UnsupportedModelError, match=r"only pickle-based weights.*save_pretrained"):
        hf.load_model(path)


def test_missing_tensor_is_named(tmp_path):
    save_tiny_checkpoint(tmp_path, "llama3")
    reader = SafetensorsReader(str(tmp_path))
    name = "model.layers.1.mlp.up_proj.weight"
    tensors = {k: np.array(reader[k]) for k in reader if k != name}
    del reader
    os.remove(tmp_path / "model.safetensors")
    write_safetensors(str(tmp_path / "model.safetensors"), tensors)
    with pytest.raises(hf.CheckpointMismatchError, match=rf"'{name}' is missing"):
        hf.load_model(str(tmp_path))


def test_wrong_shape_names_tensor_and_both_shapes(tmp_path):
    save_tiny_checkpoint(tmp_path, "llama3")
    reader = SafetensorsReader(str(tmp_path))
    tensors = {k: np.array(reader[k]) for k in reader}
    del reader
    name = "model.layers.0.self_attn.k_proj.weight"
    tensors[name] = tensors[name][:-8]
    write_safetensors(str(tmp_path / "model.safetensors"), tensors)
    with pytest.raises(
        hf.CheckpointMismatchError, match=rf"'{name}'.*shape \(24, 64\).*needs \(32, 64\)"
    ):
        hf.load_model(str(tmp_path))


def test_safetensors_writer_roundtrip_bf16(tmp_path):
    import ml_dtypes

    arrays = {
        "a": np.arange(6, dtype=np.float32).reshape(2, 3),
        "b": np.linspace(-1, 1, 5).astype(ml_dtypes.bfloat16),
    }
    path = str(tmp_path / "model.safetensors")
    write_safetensors(path, arrays)
    reader = SafetensorsReader(str(tmp_path))
    for k, v in arrays.items():
        assert reader[k].dtype == v.dtype
        np.testing.assert_array_equal(reader[k], v)
    # The file is valid for the reference implementation too.
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        np.testing.assert_array_equal(f.get_tensor("a").numpy(), arrays["a"])


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn"])
def test_a_quantized_checkpoint_is_refused_where_full_precision_is_expected(tmp_path, dtype):
    """An 8-bit tensor (an int8 or fp8 release) is named, not cast to float and loaded as if it
    were the weights; a config declaring its quantization is refused before any tensor."""
    import ml_dtypes

    save_tiny_checkpoint(tmp_path, "llama3")
    reader = SafetensorsReader(str(tmp_path))
    tensors = {k: np.array(reader[k]) for k in reader}
    del reader
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name] = np.clip(tensors[name] * 100, -127, 127).astype(getattr(ml_dtypes, dtype, dtype))
    write_safetensors(str(tmp_path / "model.safetensors"), tensors)
    with pytest.raises(hf.CheckpointMismatchError, match=rf"'{name}'.*is {dtype}.*dequantize"):
        hf.load_model(str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match=r"quantized checkpoint.*'fp8'.*bf16 / fp32"):
        hf.load_config(str(tmp_path))

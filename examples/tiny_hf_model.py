"""A tiny random Llama written as a Hugging Face directory, to try the README's "your model, your
data" recipe (or `docs/API.md`) without downloading anything:

    python examples/tiny_hf_model.py my_model/

The directory is what `save_pretrained` writes (`config.json`, `model.safetensors`, the
tokenizer files, `generation_config.json`): a 2-layer, d=64 Llama (~0.1M parameters, 512
positions) with random weights and the offline character tokenizer of the arithmetic task
(lowercase letters, digits, punctuation; a chat template). It learns nothing useful; it runs
every step of the recipe in seconds on a CPU.
"""

from __future__ import annotations

import sys

from flax import nnx

from jaxrl.models import hf
from jaxrl.models.config import ModelConfig
from jaxrl.models.transformer import Transformer
from jaxrl.tasks.tokenizer import build_arithmetic_tokenizer


def tiny_hf_model(path: str, max_positions: int = 512, seed: int = 0) -> str:
    """Writes the model and its tokenizer to `path` (a new directory); returns `path`."""
    tokenizer = build_arithmetic_tokenizer()
    config = ModelConfig(
        model_type="llama",
        vocab_size=64,  # the tokenizer's 53 ids, rounded up
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=max_positions,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    hf.save_hf(Transformer(config, rngs=nnx.Rngs(seed)), path, tokenizer=tokenizer)
    return path


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python examples/tiny_hf_model.py OUT_DIR")
    print(tiny_hf_model(sys.argv[1]))

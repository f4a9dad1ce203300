"""`make demo`: the smallest end-to-end run of the library on any machine.

Builds a tiny random Llama 3 (the arithmetic tokenizer's vocabulary), saves it as a Hugging Face
`save_pretrained` directory, loads it back through the safetensors loader, and greedily continues
a few prompts on the CPU (or whatever JAX finds). It prints where the checkpoint went.

    python -m launch.demo [--workdir runs/demo] [--max_new_tokens 8]
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl.models import hf
from jaxrl.models.config import ModelConfig, RopeConfig
from jaxrl.models.transformer import Transformer
from jaxrl.tasks.tokenizer import build_arithmetic_tokenizer

PROMPTS = ("12+7=", "3+45=", "60+21=")


def tiny_llama_config(vocab_size: int, tokenizer) -> ModelConfig:
    return ModelConfig(
        model_type="llama",
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=384,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        rope=RopeConfig(
            theta=10000.0,
            rope_type="llama3",
            factor=8.0,
            original_max_position_embeddings=64,
        ),
        max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def greedy_continue(model: Transformer, prompts: list[list[int]], max_new_tokens: int, pad: int):
    """Greedy continuation of left-padded prompts, one compiled forward over a fixed buffer."""
    prompt_len = max(len(p) for p in prompts)
    total = prompt_len + max_new_tokens
    tokens = np.full((len(prompts), total), pad, np.int32)
    valid = np.zeros((len(prompts), total), bool)
    for row, p in enumerate(prompts):
        tokens[row, prompt_len - len(p) : prompt_len] = p
        valid[row, prompt_len - len(p) : prompt_len] = True

    @nnx.jit
    def next_token(model, tokens, valid, index):
        logits = model(tokens, valid)
        return jnp.argmax(logits[:, index - 1], axis=-1).astype(jnp.int32)

    tokens, valid = jnp.asarray(tokens), jnp.asarray(valid)
    for index in range(prompt_len, total):
        new = next_token(model, tokens, valid, jnp.int32(index))
        tokens = tokens.at[:, index].set(new)
        valid = valid.at[:, index].set(True)
    return np.asarray(tokens[:, prompt_len:])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="runs/demo")
    parser.add_argument("--max_new_tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    print(f"JAX {jax.__version__} on {len(jax.devices())} {jax.devices()[0].platform} device(s)")
    tokenizer = build_arithmetic_tokenizer()
    config = tiny_llama_config(len(tokenizer), tokenizer)
    # A wide init so the untrained model's greedy tokens visibly depend on the prompt.
    model = Transformer(config, rngs=nnx.Rngs(args.seed), init_std=0.2)
    hf_dir = os.path.join(os.path.abspath(args.workdir), "hf_tiny_llama")
    hf.save_hf(model, hf_dir, tokenizer=tokenizer)
    print(f"saved a random {config.num_params():,}-parameter Llama 3 to {hf_dir}")

    start = time.perf_counter()
    loaded = hf.load_model(hf_dir)
    loaded_tokenizer = hf.load_tokenizer(hf_dir)
    print(f"loaded it back (config, safetensors, tokenizer) in {time.perf_counter() - start:.2f}s")

    prompts = [loaded_tokenizer.encode(p) for p in PROMPTS]
    new = greedy_continue(loaded, prompts, args.max_new_tokens, loaded_tokenizer.pad_token_id)
    for prompt, ids in zip(PROMPTS, new, strict=True):
        text = loaded_tokenizer.decode(ids.tolist(), skip_special_tokens=False)
        print(f"  {prompt!r:>10} -> greedy next tokens {ids.tolist()} {text!r}")
    print("(an untrained model: the tokens are arbitrary; RL training makes them right)")
    print(f"outputs: {os.path.abspath(args.workdir)}")


if __name__ == "__main__":
    main()

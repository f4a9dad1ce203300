"""Named model configs used by the demo, the benchmarks and the tests."""

from __future__ import annotations

from jaxrl.models.config import ModelConfig, RopeConfig


def rlbench_tiny(vocab_size: int = 512, **overrides) -> ModelConfig:
    """The `rl` benchmark workload's policy: Llama 3 architecture, vocab 512, hidden 256,
    intermediate 768, 4 layers, 8 heads, 4 KV heads (~3.4M parameters)."""
    kwargs = dict(
        model_type="llama",
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=768,
        num_layers=4,
        num_heads=8,
        num_kv_heads=4,
        head_dim=32,
        rope=RopeConfig(theta=500000.0),
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    kwargs.update(overrides)
    return ModelConfig(**kwargs)


def llama_100m(**overrides) -> ModelConfig:
    """A ~100M-parameter Llama 3 (vocab 32000, hidden 768, 8 layers, GQA 12/4, llama3 RoPE)."""
    kwargs = dict(
        model_type="llama",
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_layers=8,
        num_heads=12,
        num_kv_heads=4,
        head_dim=64,
        rope=RopeConfig(
            theta=500000.0,
            rope_type="llama3",
            factor=8.0,
            original_max_position_embeddings=8192,
        ),
        max_position_embeddings=8192,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    kwargs.update(overrides)
    return ModelConfig(**kwargs)

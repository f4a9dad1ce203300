"""Named model configs used by the demo, the benchmarks and the tests."""

from __future__ import annotations

import dataclasses

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


# --- Real architectures, from their Hugging Face config.json (no download) ----------------------
# Shapes only: these presets let `launch.plan` compile for a TPU topology with abstract weights.
# Loading the released checkpoints goes through `jaxrl.models.hf.load_config`, which reads the same
# numbers from the checkpoint's own config.json.

_LLAMA31_ROPE = RopeConfig(
    theta=500000.0,
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
)


def _llama31(hidden: int, intermediate: int, layers: int, heads: int, **overrides) -> ModelConfig:
    """Llama 3.1 (meta-llama/Llama-3.1-*B): vocab 128256, 8 KV heads, head_dim 128."""
    kwargs = dict(
        model_type="llama",
        vocab_size=128256,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope=_LLAMA31_ROPE,
        max_position_embeddings=131072,
        bos_token_id=128000,
        eos_token_id=(128001, 128008, 128009),
        pad_token_id=128004,  # <|finetune_right_pad_id|>
    )
    kwargs.update(overrides)
    return ModelConfig(**kwargs)


def llama3_1b(**overrides) -> ModelConfig:
    """Llama 3.2 1B: hidden 2048, intermediate 8192, 16 layers, 32 / 8 heads of 64, tied
    embeddings, RoPE scaling factor 32 (1.24B params)."""
    rope = dataclasses.replace(_LLAMA31_ROPE, factor=32.0)
    kwargs = dict(head_dim=64, tie_word_embeddings=True, rope=rope)
    return _llama31(2048, 8192, 16, 32, **{**kwargs, **overrides})


def llama3_8b(**overrides) -> ModelConfig:
    """Llama 3.1 8B: hidden 4096, intermediate 14336, 32 layers, 32 / 8 heads (8.03B params)."""
    return _llama31(4096, 14336, 32, 32, **overrides)


def llama3_70b(**overrides) -> ModelConfig:
    """Llama 3.1 70B: hidden 8192, intermediate 28672, 80 layers, 64 / 8 heads (70.6B params)."""
    return _llama31(8192, 28672, 80, 64, **overrides)


def llama3_405b(**overrides) -> ModelConfig:
    """Llama 3.1 405B: hidden 16384, intermediate 53248, 126 layers, 128 / 8 heads (406B)."""
    return _llama31(16384, 53248, 126, 128, **overrides)


def _qwen3(hidden: int, intermediate: int, layers: int, heads: int, **overrides) -> ModelConfig:
    """Qwen3 dense (Qwen/Qwen3-*B): vocab 151936, 8 KV heads, head_dim 128, q/k RMSNorm."""
    kwargs = dict(
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope=RopeConfig(theta=1000000.0),
        max_position_embeddings=40960,
        qk_norm=True,
        bos_token_id=151643,
        eos_token_id=151645,
        pad_token_id=151643,
    )
    kwargs.update(overrides)
    return ModelConfig(**kwargs)


def qwen3_8b(**overrides) -> ModelConfig:
    """Qwen3 8B: hidden 4096, intermediate 12288, 36 layers, 32 / 8 heads (8.19B params)."""
    return _qwen3(4096, 12288, 36, 32, **overrides)


def qwen3_32b(**overrides) -> ModelConfig:
    """Qwen3 32B: hidden 5120, intermediate 25600, 64 layers, 64 / 8 heads (32.8B params)."""
    return _qwen3(5120, 25600, 64, 64, **overrides)


def _qwen3_moe(hidden, moe_intermediate, layers, heads, **overrides) -> ModelConfig:
    """Qwen3-MoE (Qwen/Qwen3-*-A*B): every layer sparse, 128 experts, top-8 (renormalised), 4 KV
    heads."""
    kwargs = dict(
        model_type="qwen3_moe",
        num_kv_heads=4,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=moe_intermediate,
        norm_topk_prob=True,
        router_aux_loss_coef=0.001,
    )
    kwargs.update(overrides)
    return _qwen3(hidden, 3 * hidden, layers, heads, **kwargs)


def qwen3_30b_a3b(**overrides) -> ModelConfig:
    """Qwen3-30B-A3B: hidden 2048, 48 layers, 32 / 4 heads, 128 experts of 768, top 8 (30.5B
    params, 3.3B active a token)."""
    return _qwen3_moe(2048, 768, 48, 32, **overrides)


def qwen3_235b_a22b(**overrides) -> ModelConfig:
    """Qwen3-235B-A22B: hidden 4096, 94 layers, 64 / 4 heads, 128 experts of 1536, top 8 (235B
    params, 22B active a token)."""
    return _qwen3_moe(4096, 1536, 94, 64, **overrides)


# Presets by name, for configs (`PlanConfig.model`).
PRESETS = {
    "rlbench_tiny": rlbench_tiny,
    "llama_100m": llama_100m,
    "llama3_1b": llama3_1b,
    "llama3_8b": llama3_8b,
    "llama3_70b": llama3_70b,
    "llama3_405b": llama3_405b,
    "qwen3_8b": qwen3_8b,
    "qwen3_32b": qwen3_32b,
    "qwen3_30b_a3b": qwen3_30b_a3b,
    "qwen3_235b_a22b": qwen3_235b_a22b,
}


def preset(name: str, **overrides) -> ModelConfig:
    """The preset `name` (see `PRESETS`) with `overrides` applied."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name](**overrides)

"""Tiny random `transformers` checkpoints for tests (nothing is downloaded)."""

from __future__ import annotations

import numpy as np
import torch
import transformers

TINY = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    # Large init so that logits are far from flat and every feature moves them visibly.
    initializer_range=0.2,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

# original_max_position_embeddings (8) below the test sequence length, so llama3 scaling matters.
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8,
}


def hf_config(kind: str, **overrides) -> transformers.PretrainedConfig:
    """`kind`: llama3, llama3_tied, llama3_bias (attention and MLP biases on), qwen2, qwen3."""
    kw = dict(TINY)
    if kind.startswith("llama3"):
        kw.update(rope_parameters=dict(LLAMA3_ROPE), tie_word_embeddings=kind == "llama3_tied")
        if kind == "llama3_bias":
            kw.update(attention_bias=True, mlp_bias=True)
        kw.update(overrides)
        return transformers.LlamaConfig(**kw)
    if kind == "qwen2":
        kw.update(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        kw.update(overrides)
        return transformers.Qwen2Config(**kw, use_sliding_window=False)
    if kind == "qwen3":
        # head_dim deliberately not hidden_size / num_attention_heads.
        kw.update(head_dim=24, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        kw.update(overrides)
        return transformers.Qwen3Config(**kw, use_sliding_window=False)
    raise ValueError(kind)


def random_hf_model(config: transformers.PretrainedConfig, seed: int = 0):
    """A CausalLM with random weights, including biases and norm scales (HF inits those to 0/1,
    which would make the bias and norm features invisible)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.2)
            elif "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    return model.eval()


def save_tiny_checkpoint(path, kind: str = "llama3", seed: int = 0, **overrides):
    model = random_hf_model(hf_config(kind, **overrides), seed)
    model.save_pretrained(path)
    return model


def left_padded_batch(vocab_size: int, seed: int = 0):
    """tokens [3, 12] with 0, 3 and 7 pad tokens on the left; mask 1 on real tokens."""
    rng = np.random.default_rng(seed)
    lengths = [12, 9, 5]
    tokens = rng.integers(3, vocab_size, size=(3, 12))
    mask = np.zeros((3, 12), np.int64)
    for row, n in enumerate(lengths):
        mask[row, 12 - n :] = 1
    tokens = np.where(mask == 1, tokens, 0)
    return tokens, mask


def reference_logits(model, tokens: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """HF logits with positions that skip the left padding (as the sampler uses them)."""
    positions = np.maximum(np.cumsum(mask, axis=-1) - 1, 0)
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(tokens),
            attention_mask=torch.tensor(mask),
            position_ids=torch.tensor(positions),
        )
    return out.logits.float().numpy()


def hf_greedy(torch_model, prompts, new_tokens):
    """`transformers.generate` greedy on left-padded `prompts` (eos 2, pad 0): the new tokens
    `[B, <= new_tokens]` and the per-step scores."""
    width = max(map(len, prompts))
    ids = np.zeros((len(prompts), width), np.int64)
    attention = np.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :], attention[row, width - len(p) :] = p, 1
    out = torch_model.generate(
        torch.tensor(ids),
        attention_mask=torch.tensor(attention),
        max_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=2,
        output_scores=True,
        return_dict_in_generate=True,
    )
    return out.sequences[:, width:].numpy(), out.scores

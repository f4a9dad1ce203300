"""Hand counts of the RL programs' work per device: what a program must do at the least, to set
its compiled FLOPs and bytes against (`launch.plan` prints the ratios).

Counted from the model's shapes, the mesh and the batch, per device and for a whole step (all
layers, all micro-batches, every decode row), with the terms named:

A mixture-of-experts model (`jaxrl.models.moe`) counts FLOPs on the weights a token multiplies
(`active_weights`: the router and k experts on a sparse layer) and bytes on the weights stored
(`stored_weights`: every expert, read or gathered).

- **decode step** (one token for each of the device's rows): FLOPs 2 x the matmul weights per row,
  plus attention 4 x heads x head_dim per visible key; bytes: every weight read once (the
  embedding table only at the rows' tokens), each row's keys and values read once up to its span,
  the new keys and values written.
- **prefill** (the engine's prompts, each copied into `samples` slots): FLOPs 2 x the layers'
  matmul weights per prompt token (no logits) plus causal attention (key t sees t + 1 keys);
  bytes: the layers' weights once, each layer's activations written and read once (as in the
  train step's forward) and the keys and values written into every slot.
- **train step** (the RL step, `micro_batches` passes over the device's rollouts): FLOPs 2 x the
  matmul weights per token per pass, 3 passes (forward, backward's two products) plus one with
  full remat; the LM head on completion tokens only (forward and backward); attention's matmuls
  (2 forward, 4 backward, 2 more with full remat) over the causal half. Bytes: each pass's
  weights in the compute dtype all-gathered (written and read) per micro-batch; their gradients
  (written, reduce-scattered) and the float32 accumulation; the optimizer's update (master
  weights and Adam moments read and written, the gradients read) once; each layer's activations
  (the residual stream, the norms, q / k / v, the attention output, the MLP's gate, up and their
  product: each written and read, forward, remat forward and backward twice); the logits
  (float32, written and read in the forward and the backward).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxrl.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class HandCount:
    """FLOPs and bytes per device, and the byte terms by name."""

    flops: float
    bytes: float
    terms: dict[str, float]

    def describe(self) -> str:
        return ", ".join(f"{k} {v:.3g}" for k, v in self.terms.items() if v)


def _size(dtype: str) -> int:
    return np.dtype(dtype).itemsize


def layer_weights(c: ModelConfig) -> int:
    """Matmul weights of one dense decoder layer (attention projections and the gated MLP)."""
    e, d = c.hidden_size, c.head_dim
    return e * d * (2 * c.num_heads + 2 * c.num_kv_heads) + 3 * e * c.intermediate_size


def stored_weights(c: ModelConfig) -> int:
    """Matmul weights of all the decoder layers as stored: a sparse (mixture-of-experts) layer
    holds the router and every expert's SwiGLU in place of the dense MLP."""
    sparse = len(c.moe_layers)
    e = c.hidden_size
    moe = c.num_experts * (e + 3 * e * c.moe_intermediate_size) - 3 * e * c.intermediate_size
    return c.num_layers * layer_weights(c) + sparse * moe


def active_weights(c: ModelConfig) -> int:
    """Matmul weights of all the decoder layers that one token multiplies: on a sparse layer the
    router and its k experts' SwiGLU (the active parameters of a mixture of experts), on a dense
    layer all of them (`stored_weights` for a dense model)."""
    sparse = len(c.moe_layers)
    e, k = c.hidden_size, c.num_experts_per_tok
    moe = e * c.num_experts + k * 3 * e * c.moe_intermediate_size - 3 * e * c.intermediate_size
    return c.num_layers * layer_weights(c) + sparse * moe


def _split(n: float, parts: int) -> float:
    return n / max(parts, 1)


def quantized_weights(c: ModelConfig, head: bool = True) -> tuple[int, int]:
    """(weights, scales) of the engine's 8-bit copy (`jaxrl.generation.quantize`): the attention
    projections, a dense model's MLP and (`head`) an untied LM head in one byte a weight, one
    float32 scale per output channel."""
    e, d, layers = c.hidden_size, c.head_dim, c.num_layers
    weights = layers * e * d * (2 * c.num_heads + 2 * c.num_kv_heads)
    scales = layers * (d * (c.num_heads + 2 * c.num_kv_heads) + e)
    if not c.moe_layers:
        weights += layers * 3 * e * c.intermediate_size
        scales += layers * (2 * c.intermediate_size + e)
    if head and not c.tie_word_embeddings:
        weights, scales = weights + c.vocab_size * e, scales + c.vocab_size
    return weights, scales


def _weight_bytes(c: ModelConfig, stored: int, quantized: bool, head: bool) -> float:
    """Bytes of `stored` matmul weights in the parameter dtype, less the 8-bit copy's share."""
    pb = _size(c.param_dtype)
    if not quantized:
        return stored * pb
    weights, scales = quantized_weights(c, head)
    return (stored - weights) * pb + weights + 4 * scales


def decode_step(
    c: ModelConfig,
    *,
    rows: int,
    span: int,
    capacity: int,
    cache_bytes: int,
    tp: int,
    quantized: bool = False,
) -> HandCount:
    """One decode step of `rows` rows (per device) attending `span` positions of a cache of
    `capacity` positions, `cache_bytes` per device (keys and values, all layers); `quantized`:
    on the engine's 8-bit copy of the weights (`quantized_weights`)."""
    pb = _size(c.param_dtype)
    head = c.vocab_size * c.hidden_size
    matmul = active_weights(c) + head  # layers (a token's experts) + LM head
    heads = _split(c.num_heads, tp)
    stored = _weight_bytes(c, stored_weights(c) + head, quantized, head=True)
    terms = {  # every expert read: a batch of rows reaches nearly all of them
        "weights": _split(stored, tp) + rows * c.hidden_size * pb,
        "K/V read": cache_bytes * span / capacity,
        "K/V written": cache_bytes / capacity,
    }
    flops = 2 * _split(matmul, tp) * rows + 4 * rows * heads * c.head_dim * c.num_layers * span
    return HandCount(flops, sum(terms.values()), terms)


def prefill(
    c: ModelConfig,
    *,
    prompts: int,
    prompt_len: int,
    capacity: int,
    cache_bytes: int,
    tp: int,
    quantized: bool = False,
) -> HandCount:
    """The engine's prefill of `prompts` prompts (per device) of `prompt_len` tokens into a cache
    of `capacity` positions, `cache_bytes` per device (every slot's copy written); `quantized`:
    on the engine's 8-bit copy of the weights."""
    pb = _size(c.param_dtype)
    matmul = active_weights(c)
    tokens = prompts * prompt_len
    heads = _split(c.num_heads, tp)
    pairs = prompts * prompt_len * (prompt_len + 1) / 2
    flops = 2 * _split(matmul, tp) * tokens + 4 * heads * c.head_dim * c.num_layers * pairs
    terms = {
        "weights": _split(_weight_bytes(c, stored_weights(c), quantized, head=False), tp)
        + tokens * c.hidden_size * pb,
        "activations": tokens * c.num_layers * _activations(c, tp) * _size(c.dtype) * 2,
        "K/V written": cache_bytes * prompt_len / capacity,
    }
    return HandCount(flops, sum(terms.values()), terms)


def _activations(c: ModelConfig, tp: int) -> float:
    """Elements a token's layer writes (each read once after), averaged over the layers: the
    residual stream and the two norms' (6 E in all), q / k / v and the attention output, the
    MLP's gate, up and product; on a sparse layer the router's probabilities, the token's k rows
    in expert order (in and out, 2 k E) and k experts' gate, up and product."""
    heads = 2 * c.num_heads * c.head_dim + 2 * c.num_kv_heads * c.head_dim
    sparse = len(c.moe_layers) / c.num_layers
    e, k = c.hidden_size, c.num_experts_per_tok
    mlp = 3 * c.intermediate_size
    moe = c.num_experts + 2 * k * e + 3 * k * c.moe_intermediate_size
    return 6 * e + _split(heads, tp) + (1 - sparse) * _split(mlp, tp) + sparse * moe


def train_step(
    c: ModelConfig,
    *,
    rollouts: int,
    prompt_len: int,
    completion_len: int,
    micro_batches: int,
    tp: int,
    state_bytes: int,
) -> HandCount:
    """The RL step over `rollouts` rollouts (per device) of `prompt_len + completion_len`
    tokens in `micro_batches` passes; `state_bytes`: the device's master weights and optimizer
    state (the plan's params + optimizer)."""
    cb, gb = _size(c.dtype), 4
    e, d = c.hidden_size, c.head_dim
    t = prompt_len + completion_len
    tokens = rollouts * t
    remat = c.remat_policy == "full"
    passes = 4 if remat else 3
    layers = active_weights(c)
    head = c.vocab_size * e
    heads = _split(c.num_heads, tp)
    pairs = rollouts * t * (t + 1) / 2
    attention = (8 if remat else 6) * 2 * heads * d * c.num_layers * pairs
    flops = (
        2 * passes * _split(layers, tp) * tokens
        + 6 * _split(head, tp) * rollouts * completion_len
        + attention
    )
    weights = _split(stored_weights(c) + head, tp) * cb
    terms = {
        "weights gathered": micro_batches * (passes - 1) * 2 * weights,
        "weight gradients": micro_batches * (2 * weights + 2 * state_bytes / 3),
        "optimizer": 2 * state_bytes + state_bytes / 3,
        "activations": tokens * c.num_layers * _activations(c, tp) * cb * (8 if remat else 6),
        "logits": 4 * rollouts * completion_len * _split(c.vocab_size, tp) * gb,
    }
    return HandCount(flops, sum(terms.values()), terms)

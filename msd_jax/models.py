"""Multimodal classifiers in Flax NNX: a single-stream transformer and an MLP fusion model.

Both map a `MultimodalBatch` to float32 logits: `model(batch) -> logits_bc` for one view, and
`model.view_logits(batch) -> logits_bvc` for the three views (full, text-only, image-only, see
`msd_jax.views`) in one batched forward pass.

Transformer (ViLT-style single stream). The sequence of length L = T + P + 2 is

    position  0        1 .. T       T+1       T+2 .. T+P+1
    token     [CLS]    text_1..T    [CLS']    patch_1..P

with  x = token / patch embedding + per-modality learned position + modality-type embedding
(type 0 = CLS, 1 = text, 2 = image; the CLS tokens carry no position). Pre-LayerNorm blocks of
bidirectional multi-head attention and a GELU MLP; the classifier reads the final-LayerNorm
hidden state at a CLS position. Masked tokens are removed from attention: key s is visible to
query q iff valid_s and segment_q == segment_s, so their values never reach a valid token (exact
zeros after the softmax, not just zeroed inputs).

- `model(batch)`: one row per sample; valid = [1, text_mask, 0, image_mask], one segment, pooled
  at position 0. The text-only view (image mask all False) is exactly a forward pass on
  [CLS, text], and likewise for the image-only view.
- `model.view_logits(batch)`: two rows per sample. Row 0 is the full view as above; row 1 packs
  both unimodal views: segment 0 = [CLS, text] (pooled at 0: the text-only view), segment 1 =
  [CLS', patches] (pooled at T+1: the image-only view), with a block-diagonal attention mask.
  Text and image use separate position tables and the CLS tokens none, so each segment computes
  exactly what the single-view forward computes on its own, while the student processes 2x the
  tokens of a KD step instead of 3x.

MLP fusion model (for the smallest runs): text block = masked mean of token embeddings [E],
image block = masked patches flattened [P*D], plus one presence indicator per modality
(1 if any of its mask entries is True). A masked modality has its block zeroed and its indicator
0. `concat(blocks, indicators)` -> GELU MLP -> logits. Its three views are one forward pass over
`stack_views(batch)` (B*3 rows).

Sharding: every parameter is an `nnx.Param` with logical axis names (`out_sharding`,
`eager_sharding=False`); `DATA_PARALLEL_RULES` and `FSDP_RULES` map them onto a ("data",) mesh.

Shapes: B batch, T text length, P patches, D patch / feature size, L sequence, E hidden,
H heads, K head dim, F mlp width, C classes, V views.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.infra import sharding as ax
from jaxrl.infra.sharding import logical_param as _param
from msd_jax.views import NUM_VIEWS, MultimodalBatch, stack_views

# Logical axes of the msd parameters beyond the shared ones in jaxrl.infra.sharding.
CLASSES = "classes"
FEATURES = "features"  # patch / feature input size, and the MLP model's fused input
POSITIONS = "positions"
MODALITY_TYPES = "modality_types"

_ACTIVATION_RULES = (
    (ax.ACT_BATCH, "data"),
    (ax.ACT_LENGTH, None),
    (ax.ACT_EMBED, None),
    (ax.ACT_HEADS, None),
    (ax.ACT_HEAD_DIM, None),
    (ax.ACT_MLP, None),
)
_REPLICATED_PARAMS = (
    (ax.VOCAB, None),
    (ax.Q_HEADS, None),
    (ax.HEAD_DIM, None),
    (ax.MLP, None),
    (ax.NORM, None),
    (CLASSES, None),
    (FEATURES, None),
    (POSITIONS, None),
    (MODALITY_TYPES, None),
)
# Pure data parallelism on a ("data",) mesh: every weight replicated, the batch split.
DATA_PARALLEL_RULES: ax.LogicalRules = ((ax.EMBED, None),) + _REPLICATED_PARAMS + _ACTIVATION_RULES
# FSDP on the same mesh: weights (and Adam moments) split along `embed`, gathered in the forward.
FSDP_RULES: ax.LogicalRules = ((ax.EMBED, "data"),) + _REPLICATED_PARAMS + _ACTIVATION_RULES
RULES = {"data_parallel": DATA_PARALLEL_RULES, "fsdp": FSDP_RULES}

CLS_TYPE, TEXT_TYPE, IMAGE_TYPE = 0, 1, 2


_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float64": jnp.float64}


def _check_dtype(name: str, value: str) -> None:
    if value not in _DTYPES:
        raise ValueError(f"{name}={value!r}; expected one of {sorted(_DTYPES)}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransformerConfig:
    """Single-stream multimodal transformer.

    Attributes:
      num_classes, vocab_size: output classes and text vocabulary.
      max_text_len, max_patches, patch_dim: T, P and D of the batches it reads (T <= max_text_len,
        P <= max_patches; D exactly).
      hidden_size, num_layers, num_heads, mlp_size: E, depth, H (E % H == 0), F.
      dtype / param_dtype: compute / storage dtype; logits are float32 (float64 under x64).
      attention_impl: `jax.nn.dot_product_attention` implementation ("xla", "cudnn").
    """

    num_classes: int
    vocab_size: int
    max_text_len: int
    max_patches: int
    patch_dim: int
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    mlp_size: int = 256
    layer_norm_eps: float = 1e-6
    init_std: float = 0.02
    dtype: str = "float32"
    param_dtype: str = "float32"
    attention_impl: str = "xla"

    def __post_init__(self):
        for name in (
            "num_classes",
            "vocab_size",
            "max_text_len",
            "max_patches",
            "patch_dim",
            "hidden_size",
            "num_layers",
            "num_heads",
            "mlp_size",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"TransformerConfig.{name}={getattr(self, name)} must be >= 1")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not a multiple of num_heads={self.num_heads}"
            )
        _check_dtype("dtype", self.dtype)
        _check_dtype("param_dtype", self.param_dtype)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclasses.dataclass(frozen=True, kw_only=True)
class MLPConfig:
    """MLP fusion model: text bag-of-embeddings + flattened patches + presence indicators.

    Attributes:
      num_classes, vocab_size, max_patches, patch_dim: as in TransformerConfig (P exactly here).
      text_embed_size: E of the text token embeddings.
      hidden_sizes: widths of the hidden GELU layers.
    """

    num_classes: int
    vocab_size: int
    max_patches: int
    patch_dim: int
    text_embed_size: int = 32
    hidden_sizes: tuple[int, ...] = (128,)
    init_std: float = 0.02
    dtype: str = "float32"
    param_dtype: str = "float32"

    def __post_init__(self):
        for name in ("num_classes", "vocab_size", "max_patches", "patch_dim", "text_embed_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"MLPConfig.{name}={getattr(self, name)} must be >= 1")
        if not self.hidden_sizes or min(self.hidden_sizes) < 1:
            raise ValueError(f"MLPConfig.hidden_sizes={self.hidden_sizes} must be positive")
        _check_dtype("dtype", self.dtype)
        _check_dtype("param_dtype", self.param_dtype)

    @property
    def fused_size(self) -> int:
        return self.text_embed_size + self.max_patches * self.patch_dim + 2


# Teacher and student sizes of the transformer; the data fields come from the dataset.
TRANSFORMER_SIZES = {
    "teacher": dict(hidden_size=128, num_layers=4, num_heads=4, mlp_size=512),
    "student": dict(hidden_size=64, num_layers=2, num_heads=4, mlp_size=256),
    "tiny": dict(hidden_size=16, num_layers=1, num_heads=2, mlp_size=32),
}


def transformer_config(size: str, **fields) -> TransformerConfig:
    """`TransformerConfig` of a named size ("teacher", "student", "tiny"); `fields` override."""
    if size not in TRANSFORMER_SIZES:
        raise ValueError(f"unknown transformer size {size!r}; known: {sorted(TRANSFORMER_SIZES)}")
    return TransformerConfig(**(TRANSFORMER_SIZES[size] | fields))


class LayerNorm(nnx.Module):
    """`scale * (x - mean) / sqrt(var + eps) + bias`, statistics in float32 (or wider)."""

    def __init__(self, dim: int, eps: float, param_dtype, rngs: nnx.Rngs):
        self.eps = eps
        self.scale = _param(rngs, (dim,), (ax.NORM,), param_dtype, None)
        self.bias = _param(rngs, (dim,), (ax.NORM,), param_dtype, 0.0)

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.promote_types(x.dtype, jnp.float32))
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * self.scale[...] + self.bias[...]).astype(x.dtype)


class Block(nnx.Module):
    """Pre-LN transformer block: x + MHA(LN(x)), then h + MLP(LN(h))."""

    def __init__(self, config: TransformerConfig, rngs: nnx.Rngs):
        c = config
        e, h, k, f = c.hidden_size, c.num_heads, c.head_dim, c.mlp_size
        pd, std = _DTYPES[c.param_dtype], c.init_std
        self.config = c
        self.attention_norm = LayerNorm(e, c.layer_norm_eps, pd, rngs)
        self.qkv_kernel = _param(
            rngs, (3, e, h, k), (None, ax.EMBED, ax.Q_HEADS, ax.HEAD_DIM), pd, std
        )
        # No key bias: it adds q.b_k to every score of query q, which the softmax cancels, so
        # its gradient is exactly zero (Adam would amplify rounding noise in it).
        self.q_bias = _param(rngs, (h, k), (ax.Q_HEADS, ax.HEAD_DIM), pd, 0.0)
        self.v_bias = _param(rngs, (h, k), (ax.Q_HEADS, ax.HEAD_DIM), pd, 0.0)
        self.out_kernel = _param(rngs, (h, k, e), (ax.Q_HEADS, ax.HEAD_DIM, ax.EMBED), pd, std)
        self.out_bias = _param(rngs, (e,), (ax.EMBED,), pd, 0.0)
        self.mlp_norm = LayerNorm(e, c.layer_norm_eps, pd, rngs)
        self.up_kernel = _param(rngs, (e, f), (ax.EMBED, ax.MLP), pd, std)
        self.up_bias = _param(rngs, (f,), (ax.MLP,), pd, 0.0)
        self.down_kernel = _param(rngs, (f, e), (ax.MLP, ax.EMBED), pd, std)
        self.down_bias = _param(rngs, (e,), (ax.EMBED,), pd, 0.0)

    def __call__(self, x_ble: jax.Array, visible_bll: jax.Array) -> jax.Array:
        """`visible_bll[b, q, s]`: query q may attend key s. Every query must see some key."""
        dtype = _DTYPES[self.config.dtype]
        y = self.attention_norm(x_ble)
        q, k, v = jnp.einsum("ble,nehk->nblhk", y, self.qkv_kernel[...].astype(dtype))
        q, v = q + self.q_bias[...].astype(dtype), v + self.v_bias[...].astype(dtype)
        q, k, v = (
            ax.constrain(t, (ax.ACT_BATCH, ax.ACT_LENGTH, ax.ACT_HEADS, None)) for t in (q, k, v)
        )
        out_blhk = jax.nn.dot_product_attention(
            q, k, v, mask=visible_bll[:, None], implementation=self.config.attention_impl
        )
        attn = jnp.einsum("blhk,hke->ble", out_blhk, self.out_kernel[...].astype(dtype))
        h = x_ble + attn + self.out_bias[...].astype(dtype)
        y = self.mlp_norm(h) @ self.up_kernel[...].astype(dtype) + self.up_bias[...].astype(dtype)
        y = ax.constrain(jax.nn.gelu(y), (ax.ACT_BATCH, ax.ACT_LENGTH, ax.ACT_MLP))
        out = h + y @ self.down_kernel[...].astype(dtype) + self.down_bias[...].astype(dtype)
        return ax.constrain(out, (ax.ACT_BATCH, ax.ACT_LENGTH, ax.ACT_EMBED))


class MultimodalTransformer(nnx.Module):
    """Single-stream transformer classifier (module docstring has the layout and the masking)."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        c = config
        e, pd, std = c.hidden_size, _DTYPES[c.param_dtype], c.init_std
        self.config = c
        self.token_embedding = _param(rngs, (c.vocab_size, e), (ax.VOCAB, ax.EMBED), pd, std)
        self.patch_kernel = _param(rngs, (c.patch_dim, e), (FEATURES, ax.EMBED), pd, std)
        self.patch_bias = _param(rngs, (e,), (ax.EMBED,), pd, 0.0)
        self.text_position = _param(rngs, (c.max_text_len, e), (POSITIONS, ax.EMBED), pd, std)
        self.image_position = _param(rngs, (c.max_patches, e), (POSITIONS, ax.EMBED), pd, std)
        self.type_embedding = _param(rngs, (3, e), (MODALITY_TYPES, ax.EMBED), pd, std)
        self.cls_embedding = _param(rngs, (e,), (ax.EMBED,), pd, std)
        self.blocks = nnx.List([Block(c, rngs) for _ in range(c.num_layers)])
        self.final_norm = LayerNorm(e, c.layer_norm_eps, pd, rngs)
        self.head_kernel = _param(rngs, (e, c.num_classes), (ax.EMBED, CLASSES), pd, std)
        self.head_bias = _param(rngs, (c.num_classes,), (CLASSES,), pd, 0.0)

    def embed(self, batch: MultimodalBatch) -> jax.Array:
        """Token embeddings `x_ble` in the layout [CLS, text, CLS', patches], L = T + P + 2."""
        c, dtype = self.config, _DTYPES[self.config.dtype]
        b, t = batch.text_ids_bt.shape
        p, d = batch.image_bpd.shape[1:]
        if t > c.max_text_len or p > c.max_patches or d != c.patch_dim:
            raise ValueError(
                f"batch has T={t}, P={p}, D={d}; the model takes T <= {c.max_text_len}, "
                f"P <= {c.max_patches}, D = {c.patch_dim}"
            )
        types = self.type_embedding[...]
        text = jnp.take(self.token_embedding[...], batch.text_ids_bt, axis=0)
        text = text + self.text_position[...][:t] + types[TEXT_TYPE]
        image = batch.image_bpd.astype(self.patch_kernel[...].dtype) @ self.patch_kernel[...]
        image = image + self.patch_bias[...] + self.image_position[...][:p] + types[IMAGE_TYPE]
        cls = jnp.broadcast_to(self.cls_embedding[...] + types[CLS_TYPE], (b, 1, c.hidden_size))
        x_ble = jnp.concatenate([cls, text, cls, image], axis=1).astype(dtype)
        return ax.constrain(x_ble, (ax.ACT_BATCH, ax.ACT_LENGTH, ax.ACT_EMBED))

    def encode(self, x_ble: jax.Array, valid_bl: jax.Array, segment_bl: jax.Array) -> jax.Array:
        """Final-normed hidden states; key s is visible to query q iff valid and same segment."""
        visible_bll = valid_bl[:, None, :] & (segment_bl[:, :, None] == segment_bl[:, None, :])
        for block in self.blocks:
            x_ble = block(x_ble, visible_bll)
        return self.final_norm(x_ble)

    def classify(self, hidden_be: jax.Array) -> jax.Array:
        """Logits from pooled hidden states, computed in float32 (or wider) whatever the dtype."""
        wide = jnp.promote_types(hidden_be.dtype, jnp.float32)
        head = self.head_kernel[...].astype(wide)
        return hidden_be.astype(wide) @ head + self.head_bias[...].astype(wide)

    def __call__(self, batch: MultimodalBatch) -> jax.Array:
        """Logits `[B, C]` of the view the batch's masks describe."""
        b = batch.batch_size
        cls_b1 = jnp.ones((b, 1), bool)
        valid_bl = jnp.concatenate(
            [cls_b1, batch.text_mask_bt.astype(bool), ~cls_b1, batch.image_mask_bp.astype(bool)],
            axis=1,
        )
        hidden_ble = self.encode(self.embed(batch), valid_bl, jnp.zeros_like(valid_bl, jnp.int32))
        return self.classify(hidden_ble[:, 0])

    def view_logits(self, batch: MultimodalBatch) -> jax.Array:
        """Logits `[B, 3, C]` of the full, text-only and image-only views, one forward pass."""
        b, t = batch.text_ids_bt.shape
        p = batch.image_bpd.shape[1]
        x_ble = self.embed(batch)
        length = x_ble.shape[1]
        text_mask, image_mask = batch.text_mask_bt.astype(bool), batch.image_mask_bp.astype(bool)
        cls_b1 = jnp.ones((b, 1), bool)
        full_valid = jnp.concatenate([cls_b1, text_mask, ~cls_b1, image_mask], axis=1)
        packed_valid = jnp.concatenate([cls_b1, text_mask, cls_b1, image_mask], axis=1)
        full_segment = jnp.zeros((length,), jnp.int32)
        packed_segment = jnp.concatenate(
            [jnp.zeros((t + 1,), jnp.int32), jnp.ones((p + 1,), jnp.int32)]
        )
        # Rows 2b (full) and 2b+1 (packed unimodal views) share their embeddings.
        x_2ble = jnp.repeat(x_ble, 2, axis=0)
        valid_2bl = jnp.stack([full_valid, packed_valid], axis=1).reshape(2 * b, length)
        segment_2l = jnp.stack([full_segment, packed_segment])
        segment_2bl = jnp.tile(segment_2l, (b, 1))
        hidden = self.encode(x_2ble, valid_2bl, segment_2bl).reshape(b, 2, length, -1)
        pooled_bve = jnp.stack([hidden[:, 0, 0], hidden[:, 1, 0], hidden[:, 1, t + 1]], axis=1)
        return self.classify(pooled_bve)


class MLPFusion(nnx.Module):
    """MLP over [text bag-of-embeddings, flattened patches, presence indicators]."""

    def __init__(self, config: MLPConfig, *, rngs: nnx.Rngs):
        c = config
        pd, std = _DTYPES[c.param_dtype], c.init_std
        self.config = c
        self.token_embedding = _param(
            rngs, (c.vocab_size, c.text_embed_size), (ax.VOCAB, ax.EMBED), pd, std
        )
        sizes = (c.fused_size, *c.hidden_sizes)
        self.kernels = nnx.List(
            [
                _param(rngs, (i, o), (FEATURES if n == 0 else ax.MLP, ax.MLP), pd, 1 / math.sqrt(i))
                for n, (i, o) in enumerate(zip(sizes[:-1], sizes[1:], strict=True))
            ]
        )
        self.biases = nnx.List([_param(rngs, (o,), (ax.MLP,), pd, 0.0) for o in sizes[1:]])
        self.head_kernel = _param(rngs, (sizes[-1], c.num_classes), (ax.MLP, CLASSES), pd, std)
        self.head_bias = _param(rngs, (c.num_classes,), (CLASSES,), pd, 0.0)

    def fused_inputs(self, batch: MultimodalBatch) -> jax.Array:
        """`[B, E + P*D + 2]`: text block, image block, has_text, has_image (masked -> zeros)."""
        c, dtype = self.config, _DTYPES[self.config.dtype]
        b, p, d = batch.image_bpd.shape
        if p != c.max_patches or d != c.patch_dim:
            raise ValueError(
                f"batch has P={p}, D={d}; the model takes P={c.max_patches}, D={c.patch_dim}"
            )
        text_mask, image_mask = batch.text_mask_bt.astype(bool), batch.image_mask_bp.astype(bool)
        tokens_bte = jnp.take(self.token_embedding[...], batch.text_ids_bt, axis=0)
        count_b1 = jnp.sum(text_mask, axis=1, keepdims=True)
        text_sum = jnp.sum(jnp.where(text_mask[..., None], tokens_bte, 0.0), axis=1)
        text_be = text_sum / jnp.maximum(count_b1, 1).astype(text_sum.dtype)
        image = jnp.where(image_mask[..., None], batch.image_bpd, 0.0).reshape(b, p * d)
        has_b2 = jnp.stack([jnp.any(text_mask, axis=1), jnp.any(image_mask, axis=1)], axis=1)
        fused = [text_be.astype(dtype), image.astype(dtype), has_b2.astype(dtype)]
        return jnp.concatenate(fused, axis=1)

    def __call__(self, batch: MultimodalBatch) -> jax.Array:
        """Logits `[B, C]` of the view the batch's masks describe."""
        dtype = _DTYPES[self.config.dtype]
        h = self.fused_inputs(batch)
        for kernel, bias in zip(self.kernels, self.biases, strict=True):
            h = jax.nn.gelu(h @ kernel[...].astype(dtype) + bias[...].astype(dtype))
            h = ax.constrain(h, (ax.ACT_BATCH, ax.ACT_MLP))
        wide = jnp.promote_types(dtype, jnp.float32)
        head = self.head_kernel[...].astype(wide)
        return h.astype(wide) @ head + self.head_bias[...].astype(wide)

    def view_logits(self, batch: MultimodalBatch) -> jax.Array:
        """Logits `[B, 3, C]` of the full, text-only and image-only views, one forward pass."""
        logits = self(stack_views(batch))
        return logits.reshape(batch.batch_size, NUM_VIEWS, -1)


MultimodalModel = MultimodalTransformer | MLPFusion
ModelConfig = TransformerConfig | MLPConfig


def build_model(config: ModelConfig, *, rngs: nnx.Rngs) -> MultimodalModel:
    """The model a config describes (a TransformerConfig or an MLPConfig)."""
    if isinstance(config, TransformerConfig):
        return MultimodalTransformer(config, rngs=rngs)
    if isinstance(config, MLPConfig):
        return MLPFusion(config, rngs=rngs)
    raise TypeError(f"expected a TransformerConfig or MLPConfig, got {type(config).__name__}")

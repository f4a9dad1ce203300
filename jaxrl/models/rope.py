"""Rotary position embeddings (RoPE) with the `default`, `linear` and `llama3` frequency scalings.

Frequencies are computed in float32 with the same operation order as `transformers`, so the
inverse frequencies match the reference model's buffer.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.models.config import RopeConfig


def inverse_frequencies(head_dim: int, rope: RopeConfig) -> np.ndarray:
    """Inverse frequencies `[head_dim // 2]` (float32), scaled as `rope.rope_type` says.

    default: `inv_freq_i = 1 / theta^(2i / head_dim)`.
    linear:  `inv_freq / factor`.
    llama3:  wavelengths longer than `original_max_position_embeddings / low_freq_factor` are
             divided by `factor`, shorter than `... / high_freq_factor` are kept, and the band in
             between is interpolated smoothly between the two.
    """
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    # theta ** exponent rounded once from float64: the correctly rounded float32 power. torch's
    # vectorised float32 pow agrees bit for bit on most configs and within 1 ulp on all.
    power = (np.float64(rope.theta) ** exponent.astype(np.float64)).astype(np.float32)
    inv_freq = (np.float32(1.0) / power).astype(np.float32)
    if rope.rope_type == "linear":
        return (inv_freq / np.float32(rope.factor)).astype(np.float32)
    if rope.rope_type != "llama3":
        return inv_freq
    factor = np.float32(rope.factor)
    old_context = np.float32(rope.original_max_position_embeddings)
    low = np.float32(rope.low_freq_factor)
    high = np.float32(rope.high_freq_factor)
    low_freq_wavelen = old_context / low
    high_freq_wavelen = old_context / high
    wavelen = np.float32(2 * math.pi) / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq).astype(np.float32)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (np.float32(1) - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def rope_cos_sin(
    positions_bt: jax.Array, inv_freq_f: np.ndarray, dtype
) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables `[B, T, head_dim]` for integer positions, computed in float32."""
    angles_btf = positions_bt.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq_f)
    angles_btd = jnp.concatenate([angles_btf, angles_btf], axis=-1)
    return jnp.cos(angles_btd).astype(dtype), jnp.sin(angles_btd).astype(dtype)


def apply_rope(x_bthd: jax.Array, cos_btd: jax.Array, sin_btd: jax.Array) -> jax.Array:
    """Rotates `x` by position: `x * cos + rotate_half(x) * sin` (the half-split convention)."""
    half = x_bthd.shape[-1] // 2
    x1, x2 = x_bthd[..., :half], x_bthd[..., half:]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return x_bthd * cos_btd[:, :, None, :] + rotated * sin_btd[:, :, None, :]

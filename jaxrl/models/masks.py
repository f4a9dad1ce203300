"""Attention masks as the model receives them: dense `[B, T, S]` booleans, or `SegmentMask`, the
per-token form a fused attention kernel reads instead of a `[B, T, T]` array.

    segment[b, l]  >= 1 for the k-th sequence of row b, 0 on padding / a packed row's tail
    prefix[b, l]   the segment of the prompt of token l's unit (== segment where None)
    mask[b, q, k]  = k <= q and segment[b, k] > 0 and
                     (segment[b, k] == segment[b, q] or segment[b, k] == prefix[b, q])

covers the library's three training layouts (`jaxrl.rl.packing`): a padded batch (segment =
valid), packed rows (one segment per sequence) and shared prompts (a completion sees its prompt,
`prefix`, and itself, never a sibling). `padded=True` marks the padded batch: its dense form is
`causal & valid key` for every query, as the XLA and CPU paths have always attended (a padding
query then sees the real keys before it; its output is masked out by every caller), and the
kernel gives padding queries no key (output 0). Real queries see the same keys either way.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


def segment_mask(segment_rl: jax.Array, prefix_rl: jax.Array | None = None) -> jax.Array:
    """`mask[r, q, k]`: key k is not after query q, not on the unused tail, and in q's segment
    or (with `prefix_rl`, shared prompts) in the segment of q's prompt, `prefix_rl[r, q]`."""
    length = segment_rl.shape[-1]
    causal = jnp.tril(jnp.ones((length, length), bool))
    visible = segment_rl[:, :, None] == segment_rl[:, None, :]
    if prefix_rl is not None:
        visible = visible | (prefix_rl[:, :, None] == segment_rl[:, None, :])
    return causal[None] & visible & (segment_rl[:, None, :] > 0)


def causal_mask(valid_bt: jax.Array) -> jax.Array:
    """`mask[b, t, s]`: key s is a real token at or before query t (`[B, T, T]`)."""
    t = valid_bt.shape[-1]
    return jnp.tril(jnp.ones((t, t), bool))[None] & valid_bt[:, None, :].astype(bool)


sequence_mask = causal_mask  # the train steps' name for it


@struct.dataclass
class SegmentMask:
    """Causal self-attention over segments (module docstring): `segment_bt` int `[B, T]`,
    `prefix_bt` int `[B, T]` or None (= segment), `padded` a padded batch's mask."""

    segment_bt: jax.Array
    prefix_bt: jax.Array | None = None
    padded: bool = struct.field(pytree_node=False, default=False)

    @classmethod
    def from_valid(cls, valid_bt: jax.Array) -> SegmentMask:
        """A padded batch: real tokens (`valid_bt` True) attend the real tokens before them."""
        return cls(valid_bt.astype(jnp.int32), None, padded=True)

    @property
    def shape(self) -> tuple[int, int, int]:
        b, t = self.segment_bt.shape
        return (b, t, t)

    def dense(self) -> jax.Array:
        """The `[B, T, T]` boolean mask the XLA and CPU attention forms take."""
        if self.padded:
            return causal_mask(self.segment_bt > 0)
        return segment_mask(self.segment_bt, self.prefix_bt)

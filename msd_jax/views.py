"""The multimodal batch and its modality views.

A `MultimodalBatch` holds one batch of (text, image, label) samples:

    text_ids_bt   int32 [B, T]     token ids (padding anywhere, marked by the mask)
    text_mask_bt  bool  [B, T]     True on real text tokens
    image_bpd     float [B, P, D]  image patches (flattened pixels) or region / patch features
    image_mask_bp bool  [B, P]     True on real patches
    label_b       int32 [B]        class index

Views keep the arrays and change only the masks: the text-only view x^text sets every image mask
entry to False, the image-only view x^image every text mask entry. Removing the modality is the
model's job (the transformer drops masked tokens from attention, the MLP zeroes the block and
clears its presence indicator), so the values of a masked modality must not matter; the masking
tests change them to check exactly that. With two modalities "x without text" is the image-only
view and "x without image" the text-only view (the saliency scores use both readings).

Every per-view array in this package is batch-major with the view axis second, `*_bv*`, in the
order `VIEWS`, so that a batch sharded over its leading axis stays sharded the same way when the
views are stacked (`stack_views` gives rows b*V + v).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

MODALITIES = ("text", "image")
VIEWS = ("full",) + MODALITIES  # index v of every *_bv* array
NUM_MODALITIES = len(MODALITIES)
NUM_VIEWS = len(VIEWS)


@struct.dataclass
class MultimodalBatch:
    """One batch of multimodal samples (shapes in the module docstring)."""

    text_ids_bt: jax.Array
    text_mask_bt: jax.Array
    image_bpd: jax.Array
    image_mask_bp: jax.Array
    label_b: jax.Array

    @property
    def batch_size(self) -> int:
        return self.text_ids_bt.shape[0]

    def validate(self) -> None:
        """Checks shapes and dtypes (outside jit); raises ValueError naming the field."""
        b, t = self.text_ids_bt.shape
        expected = {
            "text_mask_bt": (b, t),
            "image_mask_bp": (b, self.image_bpd.shape[1]),
            "label_b": (b,),
        }
        if self.image_bpd.ndim != 3 or self.image_bpd.shape[0] != b:
            raise ValueError(f"image_bpd must be [B={b}, P, D], got {self.image_bpd.shape}")
        for name, shape in expected.items():
            actual = tuple(getattr(self, name).shape)
            if actual != shape:
                raise ValueError(f"MultimodalBatch.{name} has shape {actual}, expected {shape}")
        for name in ("text_ids_bt", "label_b"):
            dtype = getattr(self, name).dtype
            if not jnp.issubdtype(dtype, jnp.integer):
                raise ValueError(f"MultimodalBatch.{name} must be an integer array, got {dtype}")


def keep_only(batch: MultimodalBatch, modality: str) -> MultimodalBatch:
    """The view x^m that keeps only `modality` ("text" or "image"): the other's mask is cleared."""
    if modality == "text":
        return batch.replace(image_mask_bp=jnp.zeros_like(batch.image_mask_bp))
    if modality == "image":
        return batch.replace(text_mask_bt=jnp.zeros_like(batch.text_mask_bt))
    raise ValueError(f"unknown modality {modality!r}; expected one of {MODALITIES}")


def view(batch: MultimodalBatch, name: str) -> MultimodalBatch:
    """The view `name` in `VIEWS`: "full" (unchanged), "text" or "image" (only that modality)."""
    if name == "full":
        return batch
    return keep_only(batch, name)


def stack_views(batch: MultimodalBatch) -> MultimodalBatch:
    """The three views as one batch of B*V rows, row b*V + v holding view VIEWS[v] of sample b.

    Rows of one sample are adjacent, so a batch split over devices along B stays split along
    B*V without moving data; un-stack per-row outputs with `reshape(B, V, ...)`.
    """
    b = batch.batch_size
    full, text, image = (view(batch, name) for name in VIEWS)

    def stack(*arrays):
        stacked = jnp.stack(arrays, axis=1)
        return stacked.reshape((b * NUM_VIEWS,) + stacked.shape[2:])

    return jax.tree.map(stack, full, text, image)


def patchify(images_bhwc: np.ndarray | jax.Array, patch: int) -> jax.Array:
    """Non-overlapping `patch` x `patch` patches, row-major: [B, H, W, C] -> [B, P, patch^2 C].

    P = (H / patch) * (W / patch); H and W must be multiples of `patch`.
    """
    b, h, w, c = images_bhwc.shape
    if h % patch or w % patch:
        raise ValueError(f"image size {h}x{w} is not a multiple of the patch size {patch}")
    x = jnp.asarray(images_bhwc).reshape(b, h // patch, patch, w // patch, patch, c)
    x = x.transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(b, (h // patch) * (w // patch), patch * patch * c)

"""Rematerialisation policies by name: what the backward pass keeps of each decoder layer's
forward pass, and what it recomputes.

| name               | saved per layer                                 | recomputed        |
|--------------------|-------------------------------------------------|-------------------|
| `none`             | every intermediate (no remat)                   | nothing           |
| `full`             | the layer's input only                          | the whole layer   |
| `dots_saveable`    | every matmul output                             | norms, softmax... |
| `dots_no_batch`    | matmul outputs without batch dimensions         | the rest          |
| `save_qkv_proj`    | the q / k / v projections                       | attention, MLP    |
| `save_attn_out`    | q / k / v projections and the attention output  | the MLP           |
| `offload_qkv_proj` | the q / k / v projections, moved to host memory | attention, MLP    |

`full` trades about one extra forward pass of compute for activation memory that no longer
grows with depth x tokens beyond one layer's input; the `save_*` policies keep the tensors the
backward pass is slowest to recompute (MaxText's names are the model for these). Host offload
needs a backend with pinned host memory (GPU, TPU); XLA:CPU has no separate host space.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

# Names the model gives intermediates with `jax.ad_checkpoint.checkpoint_name`.
QUERY_PROJ, KEY_PROJ, VALUE_PROJ, ATTN_OUT = "query_proj", "key_proj", "value_proj", "attn_out"

_cp = jax.checkpoint_policies
REMAT_POLICIES: dict[str, Callable[[], Callable | None] | None] = {
    "none": None,
    "full": lambda: _cp.nothing_saveable,
    "dots_saveable": lambda: _cp.dots_saveable,
    "dots_no_batch": lambda: _cp.dots_with_no_batch_dims_saveable,
    "save_qkv_proj": lambda: _cp.save_only_these_names(QUERY_PROJ, KEY_PROJ, VALUE_PROJ),
    "save_attn_out": lambda: _cp.save_only_these_names(QUERY_PROJ, KEY_PROJ, VALUE_PROJ, ATTN_OUT),
    "offload_qkv_proj": lambda: _cp.save_and_offload_only_these_names(
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=[QUERY_PROJ, KEY_PROJ, VALUE_PROJ],
        offload_src="device",
        offload_dst="pinned_host",
    ),
}


def remat_policy(name: str) -> Callable | None:
    """The `jax.checkpoint` policy of `name`; None for "none" (no rematerialisation)."""
    if name not in REMAT_POLICIES:
        raise ValueError(f"remat_policy={name!r}; choose one of {sorted(REMAT_POLICIES)}")
    make = REMAT_POLICIES[name]
    return None if make is None else make()

"""Converting params between the unrolled layout (`layers/0/...`, `layers/1/...`) and the
scanned one (`layers/...` with a leading layer axis), as pure dicts of arrays.

Both layouts hold the same numbers; which one a model uses is `ModelConfig.scan_layers`, a
runtime choice. HF import / export and checkpoints of the other layout go through these.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec


def stack_layers(params: dict, num_layers: int) -> dict:
    """Unrolled pure dict -> scanned: `layers[i][...]` leaves stacked on a new axis 0."""
    layers = params["layers"]
    per_layer = [layers[i] for i in range(num_layers)]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *per_layer)
    return {**params, "layers": stacked}


def unstack_layers(params: dict, num_layers: int) -> dict:
    """Scanned pure dict -> unrolled: axis 0 of every `layers` leaf split into `layers[i]`."""
    stacked = params["layers"]
    layers = {i: jax.tree.map(lambda x, i=i: x[i], stacked) for i in range(num_layers)}
    return {**params, "layers": layers}


def is_stacked(params: Any) -> bool:
    """Whether a pure dict of params is in the scanned layout."""
    layers = params.get("layers", {}) if isinstance(params, dict) else {}
    return bool(layers) and not any(isinstance(k, int) for k in layers)


def _layer_sharding(sharding, stacked: bool):
    """One layer's sharding from the stacked leaf's (stacked=False), or the reverse."""
    if not isinstance(sharding, NamedSharding):
        return sharding  # single device / replicated: the same either way
    spec = tuple(sharding.spec)
    spec = spec[1:] if not stacked else (None, *spec)
    return NamedSharding(sharding.mesh, PartitionSpec(*spec))


def layer_layout_shardings(shardings: dict, other_abstract: dict, other_stacked: bool) -> dict:
    """Shardings for the params in the other layer layout (`other_abstract`'s structure), derived
    from `shardings` of this layout: the stacked leaf's spec minus its (never sharded) leading
    layer axis for each layer, or a leading None in front of layer 0's."""
    layers = shardings["layers"]
    if other_stacked:  # this layout is unrolled: layer 0 stands for all
        stacked = jax.tree.map(lambda s: _layer_sharding(s, True), layers[0])
        return {**shardings, "layers": stacked}
    per_layer = jax.tree.map(lambda s: _layer_sharding(s, False), layers)
    count = len(other_abstract["layers"])
    return {**shardings, "layers": {i: per_layer for i in range(count)}}


def convert_layer_layout(params: dict, num_layers: int, to_stacked: bool, shardings: dict) -> dict:
    """`params` in the other layer layout, converted on the devices into `shardings`' layout."""
    if to_stacked:
        fn = jax.jit(lambda p: stack_layers(p, num_layers), out_shardings=shardings)
    else:
        fn = jax.jit(lambda p: unstack_layers(p, num_layers), out_shardings=shardings)
    return fn(params)

"""A weight push that moves 8-bit kernels (`GeneratorConfig.weights` with `mismatch='off'`).

An async run's generator with 8-bit weights (`jaxrl.generation.quantize`) otherwise receives
each version in full precision and quantizes it on its own devices. `QuantizingSync` quantizes
on the trainer's devices instead, as the first step of the push (the cast step every push
already runs there: one jitted program, each kernel's shards quantized where they lie, the
per-channel max reduced across the contracted axes' shards by XLA), then moves the 8-bit values
and float32 scales device to device with the same transport (`WeightSync`): about a quarter of
an fp32 push's bytes, half of a bf16 one's. The engine takes the pushed tree as its weights
(`EnginePrograms.engine_params` does not quantize what is already quantized).

Whatever the generator never receives it cannot measure against: the mismatch metric
(`jaxrl.generation.mismatch`) scores the samples with the full-precision weights of their
version, so with `mismatch` on, the push stays full precision and the generator quantizes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.generation import quantize
from jaxrl.generation.engine_layout import pure_params
from jaxrl.sync.in_process import WeightSync


class QuantizingSync:
    """`WeightSync`'s `push` for an 8-bit generator (module docstring). `fmt`: the engine's
    concrete format (`quantize.resolve_format` on the generator's platform); `generator_dtype`:
    the dtype the rest of the params (embeddings, norms, routers) are cast to (None: kept).
    Other keyword arguments go to the `WeightSync` that moves the quantized tree."""

    def __init__(
        self,
        trainer_shardings: dict,
        generator_shardings: dict,
        model_config,
        fmt: str,
        generator_dtype=None,
        **kwargs,
    ):
        stacked = bool(model_config.scan_layers)
        layout = lambda s: quantize.quantized_shardings(s, model_config, fmt, stacked)  # noqa: E731
        trainer_q, generator_q = layout(trainer_shardings), layout(generator_shardings)
        self.inner = WeightSync(trainer_q, generator_q, **kwargs)
        self.fmt = fmt
        dtype = None if generator_dtype is None else jnp.dtype(generator_dtype)

        def make(params):
            params = pure_params(params)
            if dtype is not None:
                params = jax.tree.map(
                    lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                    params,
                )
            return quantize.quantize_params(params, model_config, fmt, stacked)

        self._quantize = jax.jit(make, out_shardings=trainer_q)

    def push(self, trainer_params, version: int, previous=None, *, on_chunk=None):
        """Quantizes `trainer_params` on the trainer's devices, then pushes the 8-bit tree
        (`WeightSync.push`'s contract)."""
        quantized = self._quantize(trainer_params)
        try:
            return self.inner.push(quantized, version, previous, on_chunk=on_chunk)
        finally:
            for leaf in jax.tree.leaves(quantized):
                leaf.delete()

"""8-bit generator weights for a LoRA policy: the frozen base quantized once, the adapters
applied unmerged and unquantized on top of it.

A targeted projection of the engine's copy computes

    y = quantized_matmul(x, Wq) + (alpha / r) * (x @ A) @ B

with `Wq` the base kernel in the engine's 8-bit format (`jaxrl.generation.quantize`: weight-only
int8 or fp8, or "int8_dynamic" with the activations quantized per token too) and A, B the
adapters as pushed (full precision, never quantized), the term computed from the activations
`x` as they enter the projection.

The engine runs the plain `Transformer` on a tree in which each adapted kernel is an
`AdaptedKernel` (the base kernel, its A and B), and the model's `_matmul` multiplies by it
(`AdaptedKernel.quantized_matmul`): the adapter term is spelled out where the kernel is
quantized instead of being attached by qwix. qwix adds it inside the `dot_general` it
intercepts, and a `QuantizedKernel`'s matmul is not the product of the activations with the
kernel: weight-only multiplies by the 8-bit values and scales the product afterwards (an
intercepted term would be scaled by the kernel's per-channel scales too), "int8_dynamic"
multiplies the int8 activations (the term would be computed from them, unscaled, and added to
the int32 accumulator); qwix also finds the kernel by the array's identity or shape, which the
8-bit values do not share reliably.

`QuantizedBase` makes the engine's copy of the base once per base object (the sampler's
`base_params`, set once per run and shared by every pushed version); `attach` puts each call's
adapters on it, a tree operation with no device work. A weight push therefore stays the
adapters', as with full-precision generator weights.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import nnx

from jaxrl.generation import quantize
from jaxrl.infra import sharding as ax
from jaxrl.models.config import ModelConfig
from jaxrl.models.transformer import Transformer
from jaxrl.train import lora as lora_lib


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class AdaptedKernel:
    """A projection kernel with its LoRA adapter, unmerged: `base` (a `QuantizedKernel`, or an
    array the 8-bit format keeps in full precision, e.g. a mixture-of-experts model's dense
    MLPs), `lora_a` `[prod K, r]`, `lora_b` `[r, prod N]` (qwix's layout,
    `jaxrl.train.lora`) and `scale` (alpha / r). Stands in for the kernel array in the model
    as a `QuantizedKernel` does: `kernel[...]` returns it, `.astype` casts a full-precision
    base only, `_matmul` calls `quantized_matmul`."""

    base: Any
    lora_a: jax.Array
    lora_b: jax.Array
    scale: float = 1.0

    def tree_flatten(self):
        return (self.base, self.lora_a, self.lora_b), self.scale

    @classmethod
    def tree_unflatten(cls, scale, children):
        return cls(*children, scale=scale)

    @property
    def shape(self):
        return self.base.shape

    def __getitem__(self, key):
        if key is Ellipsis:
            return self
        raise TypeError("an AdaptedKernel is read whole (kernel[...])")

    def astype(self, dtype):
        if isinstance(self.base, quantize.QuantizedKernel):
            return self  # the 8-bit matmul picks its operand dtype
        return dataclasses.replace(self, base=self.base.astype(dtype))

    def quantized_matmul(self, x_btk, contract: int, **kwargs) -> jax.Array:
        """`[B, T, *K] -> [B, T, *N]`: the base's matmul plus `scale * (x @ A) @ B`, the adapter
        term from the unquantized activations, in the dtype of the adapters and activations
        (qwix's `_compute_lora_delta`), added to the base's output in its dtype."""
        b, t = x_btk.shape[:2]
        if isinstance(self.base, quantize.QuantizedKernel):
            y = self.base.quantized_matmul(x_btk, contract, **kwargs)
        else:  # `transformer._matmul`'s matmul
            rows = x_btk.reshape(b * t, *x_btk.shape[2:])
            dims = ((tuple(range(1, contract + 1)), tuple(range(contract))), ((), ()))
            y = jax.lax.dot_general(rows, self.base, dims, **kwargs)
            y = y.reshape(b, t, *self.base.shape[contract:])
        x = x_btk.reshape(b * t, -1)
        dims = (((1,), (0,)), ((), ()))
        delta = jax.lax.dot_general(jax.lax.dot_general(x, self.lora_a, dims), self.lora_b, dims)
        delta = (delta * self.scale).reshape(y.shape)
        return (y + delta).astype(y.dtype)


def attach(base: dict, adapters: dict, scale: float) -> dict:
    """The plain model's tree the engine runs: `base` (the engine's quantized copy; with
    LoRA-FA holding the frozen A's) with each adapted kernel replaced by an `AdaptedKernel` of
    it and its A, B (the `adapters`' leaves themselves: nothing is copied or cast)."""

    def visit(node: dict) -> dict:  # a fresh nest of dicts: `base`'s own are never changed
        out = {k: visit(v) if isinstance(v, dict) else v for k, v in node.items()}
        for key in [k for k in out if isinstance(k, str) and k.endswith("_lora_a")]:
            kernel = key.removesuffix("_lora_a")
            a, b = out.pop(key), out.pop(f"{kernel}_lora_b")
            out[kernel] = AdaptedKernel(out[kernel], a, b, scale)
        return out

    return visit(lora_lib.combine(base, adapters))


class QuantizedBase:
    """The engine's 8-bit copy of a LoRA policy's frozen base, made once per base object.

    `weights`: `GeneratorConfig.weights`, resolved for `mesh`'s platform (`fmt`), with
    `quantize.engine_format`'s refusals (fp8 on TPU, an "int8_dynamic" contraction that could
    overflow int32) raised here, before any device work. With `mesh` and the logical `rules`
    the 8-bit values are laid out as their kernels and the scales as the kernels' output axes
    (`quantize.quantized_shardings`). `graphdef`: the plain `Transformer`'s, which the engine
    runs. `count`: the copies made so far."""

    def __init__(self, model_config: ModelConfig, mesh, weights: str, rules=None):
        if model_config.scan_layers:
            raise ValueError(
                "LoRA needs unrolled layers (ModelConfig.scan_layers=False): the quantized base "
                "of a LoRA policy is laid out per layer"
            )
        graphdef, abstract = nnx.split(
            nnx.eval_shape(lambda: Transformer(model_config, rngs=nnx.Rngs(0)))
        )
        self.graphdef = graphdef
        self.fmt, _ = quantize.engine_format(graphdef, model_config, mesh, weights)
        if self.fmt == "native":
            raise ValueError("QuantizedBase needs 8-bit weights; 'native' runs the base as given")
        # Where the engine's format quantizes, and how many axes each kernel contracts.
        fmt, is_q = self.fmt, lambda x: isinstance(x, quantize.QuantizedKernel)  # noqa: E731
        shapes = jax.eval_shape(
            lambda p: quantize.quantize_params(p, model_config, fmt, stacked=False),
            nnx.to_pure_dict(abstract),
        )
        targets = [
            (tuple(k.key for k in path), q.values.ndim - q.scales.ndim)
            for path, q in jax.tree_util.tree_leaves_with_path(shapes, is_leaf=is_q)
            if is_q(q)
        ]
        self.paths = [path for path, _ in targets]
        contracts = tuple(contract for _, contract in targets)
        out = None
        if mesh is not None and rules is not None:
            shardings = nnx.to_pure_dict(ax.param_shardings(abstract, mesh, rules))
            laid = quantize.quantized_shardings(shardings, model_config, fmt, stacked=False)
            out = [_get(laid, path) for path in self.paths]
        # Only the kernels go through the program: the rest of the base is shared, not copied.
        self._quantize = jax.jit(
            lambda kernels: [
                quantize.quantize_kernel(w, c, False, fmt)
                for w, c in zip(kernels, contracts, strict=True)
            ],
            out_shardings=out,
        )
        self.count = 0
        self._held: tuple[dict, dict] | None = None  # (base quantized, its copy)

    def __call__(self, base: dict, call_on_mesh=None) -> dict:
        """The copy of `base` (a pure dict: the plain model's params, with LoRA-FA's frozen A's),
        made on the first call with this object and reused after; the previous copy goes when
        a new base comes. `call_on_mesh`: runs the quantizing program under the engine's mesh."""
        if self._held is not None and self._held[0] is base:
            return self._held[1]
        self._held = None
        kernels = [_get(base, path) for path in self.paths]
        run = call_on_mesh or (lambda fn, *args: fn(*args))
        quantized = run(self._quantize, kernels)
        out = jax.tree.map(lambda x: x, base)  # a fresh nest of dicts over the same leaves
        for path, q in zip(self.paths, quantized, strict=True):
            node = out
            for key in path[:-1]:
                node = node[key]
            node[path[-1]] = q
        self.count += 1
        self._held = (base, out)
        return out


def _get(tree: dict, path: tuple):
    for key in path:
        tree = tree[key]
    return tree

"""8-bit generator weights: the engine's own int8 or fp8 copy of the projection kernels.

`GeneratorConfig.weights` (`jaxrl.generation.placement`) picks the generator's weight format:
"native" (the weights as given: today's default), int8 with one float32 scale per output
channel (symmetric, `scale = max|w| / 127` over the contracted axes), or fp8:

* "int8_weights": weight-only; each matmul converts the int8 kernel to the activations' dtype
  inside the matmul and scales its output (`x @ (q * s) == (x @ q) * s`, exact apart from the
  weights' rounding).
* "int8_dynamic": the activations are quantized too, per row (per token) and per matmul, and the
  matmul runs int8 x int8 with int32 accumulation, then scales by both (W8A8).
* "int8": the platform's choice: "int8_dynamic" on CPU (XLA:CPU runs int8 x int8 dots on the
  VNNI / AMX units, ~5x its fp32 rate here; a converted-weight fp32 dot is no faster than fp32,
  docs/quantization.md), "int8_weights" on GPU / TPU (decode is bound by reading the weights;
  the activations keep their precision).
* "fp8": weight-only float8_e4m3fn with one float32 scale per output channel
  (`scale = max|w| / 448`, e4m3's largest finite value), the matmul as "int8_weights" (the fp8
  kernel converted to the activations' dtype, the output scaled). On GPU and CPU. Refused on
  TPU: v5e / v5p have no fp8 matmul units, so fp8 there reads the same one byte a weight as
  int8 weight-only with 3 mantissa bits in place of int8's 7 (`check_platform`).
* "int4_weights", "int5_weights", "int6_weights": weight-only, N-bit levels (-7..7, -15..15,
  -31..31; `scale = max|w| / top`) held one per int8 byte: the mismatch of N-bit rollouts
  without their bytes or speed, for experiments on the correction (on SmolLM2-135M, per-channel
  int4's is about 20 times int8's and ruins the samples; docs/quantization.md), not for speed.

Quantized: the q/k/v/o attention kernels, a dense MLP's gate/up/down kernels and an untied
`lm_head`. Kept: the embedding (so a tied unembedding too), norms, biases, routers and a
mixture-of-experts model's MLP kernels. The quantized leaves are `QuantizedKernel`s (a pytree of
8-bit values and float32 scales) in place of the kernel arrays; the model's `_matmul` multiplies
by them (`QuantizedKernel.quantized_matmul`). They live only in the engine's copy of the weights
(`EnginePrograms.engine_params`, made once per weights object on the engine's devices): the
trainer's params, checkpoints and exports never hold 8-bit weights.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

# Fewer-bit levels in int8 bytes (module docstring): experiments on the correction.
LOW_BIT = {f"int{bits}_weights": 2 ** (bits - 1) - 1 for bits in (4, 5, 6)}
# The largest integer level of each integer format (symmetric: -top..top).
INT_TOP = {"int8_weights": 127, "int8_dynamic": 127, **LOW_BIT}
WEIGHT_FORMATS = ("native", "int8", "int8_weights", "int8_dynamic", "fp8", *LOW_BIT)
# The largest finite float8_e4m3fn: the fp8 scale maps each channel's max |w| onto it.
FP8_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)
# Leaves quantized, with how many leading axes each contracts (`transformer._matmul`).
CONTRACT = {"q_kernel": 1, "k_kernel": 1, "v_kernel": 1, "o_kernel": 2}
MLP_CONTRACT = {"gate_kernel": 1, "up_kernel": 1, "down_kernel": 1}
RANK = {"q_kernel": 3, "k_kernel": 3, "v_kernel": 3, "o_kernel": 3, "lm_head": 2}
# int8 x int8 products summed in int32: |sum| <= K * 127^2 stays below 2^31 for K up to this.
MAX_DYNAMIC_CONTRACTION = (2**31 - 1) // (127 * 127)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class QuantizedKernel:
    """A projection kernel as 8-bit `values` (int8, or float8_e4m3fn for "fp8"; the kernel's
    shape) and float32 `scales` (its output axes' shape: `values.shape[contract:]`, with a
    leading layer axis when stacked); `mode`: "int8_weights", "int8_dynamic" or "fp8" (module
    docstring). Stands in for the kernel array in the
    model: `kernel[...]` and `.astype` return it unchanged, `_matmul` calls `quantized_matmul`."""

    values: jax.Array
    scales: jax.Array
    mode: str = "int8_weights"

    def tree_flatten(self):
        return (self.values, self.scales), self.mode

    @classmethod
    def tree_unflatten(cls, mode, children):
        return cls(*children, mode=mode)

    @property
    def shape(self):
        return self.values.shape

    def __getitem__(self, key):
        if key is Ellipsis:
            return self
        raise TypeError("a QuantizedKernel is read whole (kernel[...])")

    def astype(self, dtype):
        del dtype  # the matmul picks its operand dtype
        return self

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """The kernel the quantized one stands for: `values * scales`, the scales broadcast
        over the contracted axes (after a leading layer axis when stacked)."""
        contract = self.values.ndim - self.scales.ndim
        lead = 0 if self.scales.shape == self.values.shape[contract:] else 1
        scales = jnp.expand_dims(self.scales, tuple(range(lead, lead + contract)))
        return (self.values.astype(jnp.float32) * scales).astype(dtype)

    def quantized_matmul(self, x_btk, contract: int, preferred_element_type=None) -> jax.Array:
        """`transformer._matmul(x, kernel)` on the quantized kernel: `[B, T, *K] -> [B, T, *N]`."""
        b, t = x_btk.shape[:2]
        if self.scales.shape != self.values.shape[contract:]:
            raise ValueError(
                f"QuantizedKernel: scales {self.scales.shape} do not match the output axes of "
                f"values {self.values.shape} contracting {contract} axes"
            )
        x = x_btk.reshape(b * t, *x_btk.shape[2:])
        out_dtype = preferred_element_type or x.dtype
        dims = ((tuple(range(1, contract + 1)), tuple(range(contract))), ((), ()))
        if self.mode == "int8_dynamic":
            # Per-row symmetric scales of the activations over the contracted axes.
            axes = tuple(range(1, contract + 1))
            x32 = x.astype(jnp.float32)
            amax = jnp.max(jnp.abs(x32), axis=axes, keepdims=True)
            row_scale = jnp.where(amax > 0, amax / 127.0, 1.0)
            xq = jnp.clip(jnp.round(x32 / row_scale), -127, 127).astype(jnp.int8)
            acc = jax.lax.dot_general(xq, self.values, dims, preferred_element_type=jnp.int32)
            row_scale = row_scale.reshape(b * t, *(1,) * (acc.ndim - 1))
            y = acc.astype(jnp.float32) * row_scale * self.scales
        else:  # weight-only ("int8_weights", "fp8", "int4_weights" ...)
            y = jax.lax.dot_general(x, self.values.astype(x.dtype), dims)
            y = y.astype(jnp.float32 if preferred_element_type else y.dtype)
            y = y * self.scales.astype(y.dtype)
        return y.astype(out_dtype).reshape(b, t, *self.values.shape[contract:])


def resolve_format(weights: str, platform: str) -> str:
    """The concrete format ("native", "int8_weights", "int8_dynamic", "fp8") of `weights` on
    `platform` ("cpu", "gpu", "tpu"); refuses fp8 on TPU (`check_platform`)."""
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"generator weights {weights!r}; expected one of {WEIGHT_FORMATS}")
    check_platform(weights, platform)
    if weights == "int8":
        return "int8_dynamic" if platform == "cpu" else "int8_weights"
    return weights


def check_platform(weights: str, platform: str) -> None:
    """Refuses "fp8" on TPU: v5e / v5p have no fp8 matmul units, so an fp8 kernel would be
    converted before each matmul exactly as int8 weight-only is, reading the same one byte a
    weight with less precision (3 mantissa bits against int8's 7 over each channel's range)."""
    if weights == "fp8" and platform == "tpu":
        raise ValueError(
            "GeneratorConfig.weights='fp8' on TPU: v5e / v5p have no fp8 matmul units, and "
            "weight-only fp8 reads the same bytes as int8 with less precision; use "
            "weights='int8' (weight-only int8 on TPU)"
        )


def _targets(params: dict, model_config, stacked: bool):
    """(path, leaf, contract) of every kernel to quantize in the pure dict `params`."""
    out = []
    layers = params.get("layers", {})
    groups = [("layers",)] if stacked else [("layers", i) for i in layers]
    for group in groups:
        layer = layers if stacked else layers[group[1]]
        for name, contract in CONTRACT.items():
            if name in layer.get("attention", {}):
                out.append(((*group, "attention", name), layer["attention"][name], contract))
        if not model_config.moe_layers:  # experts (and a mixed model's dense MLPs) stay
            for name, contract in MLP_CONTRACT.items():
                if name in layer.get("mlp", {}):
                    out.append(((*group, "mlp", name), layer["mlp"][name], contract))
    if "lm_head" in params:
        out.append((("lm_head",), params["lm_head"], 1))
    return out


def check_shapes(params: dict, model_config, stacked: bool) -> None:
    """Refuses, from shapes alone, a kernel the per-output-channel scale layout cannot take: one
    of another rank than the model's projections (a tree not of this model), or under
    "int8_dynamic" a contraction long enough to overflow int32 accumulation."""
    for path, leaf, _ in _targets(params, model_config, stacked):
        name = path[-1]
        rank = RANK.get(name, 2) + (1 if stacked and path[0] == "layers" else 0)
        shape = tuple(np.shape(leaf))
        if len(shape) != rank:
            raise ValueError(
                f"8-bit generator weights: {'/'.join(map(str, path))} has shape {shape}; the "
                f"per-output-channel scales take a rank-{rank} kernel of this model's layout. "
                "Quantize only the Transformer's own params, or set GeneratorConfig.weights="
                "'native'"
            )


def check_contraction(model_config, fmt: str) -> None:
    """Refuses "int8_dynamic" for a model whose widest contraction (hidden size, MLP width,
    heads x head dim) could overflow the int32 accumulator, before any device work."""
    if fmt != "int8_dynamic":
        return
    c = model_config
    widest = max(c.hidden_size, c.intermediate_size, c.num_heads * c.head_dim)
    if widest > MAX_DYNAMIC_CONTRACTION:
        raise ValueError(
            f"GeneratorConfig.weights='int8_dynamic': a contraction of {widest} int8 x int8 "
            f"products can overflow int32 (at most {MAX_DYNAMIC_CONTRACTION}); use "
            "weights='int8_weights' (weight-only) for this model"
        )


def quantize_kernel(w: jax.Array, contract: int, stacked: bool, mode: str) -> QuantizedKernel:
    """Symmetric per-output-channel int8 (`mode` "int4_weights": levels -7..7, and so on; "fp8":
    float8_e4m3fn, rounded to nearest even, each channel's max |w| at 448) of one kernel (module
    docstring)."""
    lead = 1 if stacked else 0
    axes = tuple(range(lead, lead + contract))
    w32 = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(w32), axis=axes, keepdims=True)
    top = FP8_MAX if mode == "fp8" else float(INT_TOP[mode])
    scale = jnp.where(amax > 0, amax / top, 1.0)
    if mode == "fp8":  # clipped first: a value past 448 would convert to NaN (e4m3 has no inf)
        values = jnp.clip(w32 / scale, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    else:
        values = jnp.clip(jnp.round(w32 / scale), -top, top).astype(jnp.int8)
    return QuantizedKernel(values, jnp.squeeze(scale, axis=axes), mode)


def quantize_params(params: dict, model_config, fmt: str, stacked: bool) -> dict:
    """`params` (a pure dict of the model's weights) with its projection kernels replaced by
    `QuantizedKernel`s of format `fmt` ("int8_weights" / "int8_dynamic" / "fp8"); run it under
    `jit`."""
    check_shapes(params, model_config, stacked)
    out = jax.tree.map(lambda x: x, params)  # a fresh nest of dicts over the same leaves
    for path, leaf, contract in _targets(params, model_config, stacked):
        node = out
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = quantize_kernel(leaf, contract, stacked and path[0] == "layers", fmt)
    return out


def quantized_shardings(shardings: dict, model_config, fmt: str, stacked: bool) -> dict:
    """The NamedShardings of `quantize_params`' output from `shardings`, the params' own (a pure
    dict): a `QuantizedKernel`'s values laid out as its kernel, its scales as the kernel's
    output axes (and layer axis, stacked)."""
    out = jax.tree.map(lambda x: x, shardings)
    for path, leaf, contract in _targets(shardings, model_config, stacked):
        lead = 1 if stacked and path[0] == "layers" else 0
        rank = RANK.get(path[-1], 2) + lead
        spec = (*leaf.spec, *(None,) * (rank - len(leaf.spec)))
        scales = jax.sharding.NamedSharding(
            leaf.mesh, jax.sharding.PartitionSpec(*spec[:lead], *spec[lead + contract :])
        )
        node = out
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = QuantizedKernel(leaf, scales, fmt)
    return out


def pushed_quantized(params, fmt: str) -> bool:
    """Whether `params` already holds `QuantizedKernel`s (a push that quantized on the trainer,
    `jaxrl.sync.quantized`); of another format than the engine's `fmt`: refused."""
    is_q = lambda x: isinstance(x, QuantizedKernel)  # noqa: E731
    modes = {x.mode for x in jax.tree.leaves(params, is_leaf=is_q) if is_q(x)}
    if modes and modes != {fmt}:
        raise ValueError(
            f"the generator's engine runs {fmt!r} weights and was handed kernels quantized as "
            f"{sorted(modes)}: push with the engine's format (quantize.resolve_format on the "
            "generator's platform)"
        )
    return bool(modes)


def weight_bytes(params) -> int:
    """Bytes of a params tree (int8 and fp8 values count one byte each)."""
    leaves = jax.tree.leaves(params)
    return sum(int(np.prod(np.shape(x))) * jnp.dtype(x.dtype).itemsize for x in leaves)


def engine_format(graphdef, model_config, mesh, weights: str, rules=None):
    """`(format, quantize)` for an engine running `graphdef` on `mesh` (None: the default
    backend): the concrete format and the jitted function making the engine's quantized copy
    (None for "native"), laid out by the logical `rules` on `mesh` when both are given (the
    copy's layout is then fixed, and programs lowered for abstract params see it). Refuses
    before any device work: an unknown format, fp8 on TPU, a wrapped (LoRA) model (its base is
    quantized by `quantized_lora`), a contraction "int8_dynamic" cannot accumulate, a kernel
    the scale layout cannot take."""
    from flax import nnx

    from jaxrl.models.transformer import Transformer

    platform = mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()
    fmt = resolve_format(weights, platform)
    if fmt == "native":
        return fmt, None
    graph, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(model_config, rngs=nnx.Rngs(0))))
    if graphdef != graph:
        raise ValueError(
            f"generator weights {weights!r} are for a plain Transformer; this engine's model is "
            "wrapped (LoRA adapters?), whose adapter term qwix would add inside the 8-bit "
            "matmul. A LoRA policy's engine quantizes its base once and applies the adapters "
            "unquantized: build it with jaxrl.generation.placement.mesh_sampler (or "
            "AdapterEngineSampler(..., weights=..., lora=...)), or set weights='native'"
        )
    check_contraction(model_config, fmt)
    stacked = bool(model_config.scan_layers)
    check_shapes(nnx.to_pure_dict(abstract), model_config, stacked)
    out = None
    if mesh is not None and rules is not None:
        from jaxrl.infra import sharding as ax

        shardings = nnx.to_pure_dict(ax.param_shardings(abstract, mesh, rules))
        out = quantized_shardings(shardings, model_config, fmt, stacked)
    quantize = lambda params: quantize_params(params, model_config, fmt, stacked)  # noqa: E731
    return fmt, jax.jit(quantize, out_shardings=out)

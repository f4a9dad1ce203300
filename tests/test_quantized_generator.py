"""8-bit generator weights (`jaxrl.generation.quantize`, `GeneratorConfig.weights`): the
per-channel quantization's error bounds (int8 and fp8), the int8 engine's greedy tokens
against fp32, the behaviour log-probs being the quantized policy's own, the refusals before any
device work, and the caller's (trainer's) params never touched."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.generation import quantize
from jaxrl.generation.engine import Engine, Request
from jaxrl.generation.placement import GeneratorConfig
from jaxrl.generation.sampling import SamplingConfig, processed_logprobs
from jaxrl.models.config import ModelConfig
from jaxrl.models.transformer import Transformer
from jaxrl.train import lora as lora_lib

PROMPTS = [[1, 5, 6, 7, 8, 9, 10, 11], [1, 20, 21], [1, 30, 31, 32, 33, 34], [1, 40]]
CONFIG = ModelConfig("llama", 64, 32, 64, 2, 4, 4, 8, max_position_embeddings=128)


@pytest.fixture(scope="module")
def models():
    """A tied model with unrolled layers and an untied one (lm_head quantized too) with scanned
    layers."""
    tied = Transformer(CONFIG, rngs=nnx.Rngs(0), init_std=0.3)
    config = CONFIG.replace(tie_word_embeddings=False, scan_layers=True)
    untied = Transformer(config, rngs=nnx.Rngs(1), init_std=0.3)
    return {"tied": tied, "untied": untied}


def _run(model, weights, sampling, key=0):
    engine, params = Engine.for_model(model, num_slots=4, steps_per_call=4, weights=weights)
    requests = [Request(i, p, 2, sampling, max_new_tokens=8) for i, p in enumerate(PROMPTS)]
    return engine, params, sorted(engine.generate(params, requests, jax.random.key(key)),
                                  key=lambda g: g.request_id)  # fmt: skip


@pytest.mark.parametrize(("mode", "top"), [("int8_weights", 127), ("int4_weights", 7)])
def test_per_channel_error_is_at_most_half_a_step(mode, top):
    rng = np.random.default_rng(0)
    run = jax.jit(quantize.quantize_kernel, static_argnums=(1, 2, 3))
    for lead in ((), (3,)):
        for shape, contract in (((16, 4, 8), 1), ((4, 8, 16), 2), ((16, 24), 1)):
            w = rng.normal(size=lead + shape) * np.linspace(0.01, 3.0, shape[-1])
            q = run(w.astype(np.float32), contract, bool(lead), mode)
            values, scales = np.asarray(q.values), np.asarray(q.scales)
            assert values.dtype == np.int8 and scales.shape == lead + shape[contract:]
            axes = tuple(range(len(lead), len(lead) + contract))
            np.testing.assert_allclose(scales, np.abs(w).max(axis=axes) / top, rtol=1e-6)
            assert np.abs(values.astype(np.int32)).max() == top  # each channel's max level
            assert len(np.unique(values)) <= 2 * top + 1
            error = np.abs(values * np.expand_dims(scales, axes) - w)
            assert (error <= np.expand_dims(scales, axes) / 2 + 1e-6).all()
            np.testing.assert_allclose(q.dequantize(), values * np.expand_dims(scales, axes))


def test_fp8_per_channel_error_is_at_most_half_an_e4m3_step():
    """e4m3 has 3 mantissa bits and its least normal exponent is -6: a scaled value v = w / s in
    a binade [2^e, 2^(e+1)), e >= -6, rounds to a step of 2^(e-3), so by at most
    2^(e-4) <= |v| 2^-4; below 2^-6 the subnormals' step is 2^-9, half of it 2^-10. In weights:
    |error| <= |w| 2^-4 + s 2^-10 (the scale `s = max|w| / 448` per output channel)."""
    rng = np.random.default_rng(0)
    run = jax.jit(quantize.quantize_kernel, static_argnums=(1, 2, 3))
    for lead in ((), (3,)):
        for shape, contract in (((16, 4, 8), 1), ((4, 8, 16), 2), ((64, 24), 1)):
            # Channels from 0.01 to 3, and per-weight magnitudes over 7 decades: subnormals too.
            w = rng.normal(size=lead + shape) * np.linspace(0.01, 3.0, shape[-1])
            w *= 10.0 ** rng.uniform(-7, 0, size=w.shape)
            q = run(w.astype(np.float32), contract, bool(lead), "fp8")
            values, scales = np.asarray(q.values), np.asarray(q.scales)
            assert values.dtype == jnp.float8_e4m3fn and scales.shape == lead + shape[contract:]
            axes = tuple(range(len(lead), len(lead) + contract))
            np.testing.assert_allclose(scales, np.abs(w).max(axis=axes) / 448, rtol=1e-6)
            v = values.astype(np.float32)
            np.testing.assert_array_equal(np.abs(v).max(axis=axes), 448)  # each channel's max
            s = np.expand_dims(scales, axes)
            error = np.abs(v * s - w)
            assert (error <= np.abs(w) * 2.0**-4 + s * 2.0**-10 + 1e-6 * np.abs(w)).all()
            assert ((np.abs(v) < 2.0**-6) & (v != 0)).any()  # subnormals among them
            np.testing.assert_allclose(q.dequantize(), v * s, rtol=1e-6)


@pytest.mark.parametrize(("name", "weights"), [("untied", "int8_dynamic")])
def test_int8_greedy_tokens_mostly_equal_fp32(models, name, weights):
    greedy = SamplingConfig(8, greedy=True)
    _, _, full = _run(models[name], "native", greedy)
    engine, _, low = _run(models[name], weights, greedy)
    same, total, worst = 0, 0, 0.0
    for f, q in zip(full, low, strict=True):
        agree = np.cumprod(f.tokens_gn[0] == q.tokens_gn[0]).astype(bool)
        same, total = same + int(agree.sum()), total + len(agree)
        worst = max(worst, float(np.abs(f.logprobs_gn[0] - q.logprobs_gn[0])[agree].max()))
    print(f"[int8] {name} {weights}: {same}/{total} greedy tokens before the first difference, "
          f"max |log-prob difference| there {worst:.4f}")  # fmt: skip
    # A random tiny model has near-ties (large logits from init_std 0.3): greedy paths part.
    assert same >= 0.5 * total and worst < 0.25, (same, total, worst)
    assert engine.programs.weights == weights


@functools.cache
def _forward(graphdef, sampling):
    """The teacher-forced forward, one jitted function per (graph, sampling): the fp8 case's
    dequantized fp32 model is the int8-weights case's graph, so it reuses that compiled program
    instead of compiling it again."""
    return jax.jit(lambda p, tokens: processed_logprobs(nnx.merge(graphdef, p)(tokens), sampling))


@pytest.mark.parametrize(
    ("name", "weights"),
    [("untied", "int8_weights"), ("tied", "int8"), ("untied", "fp8"), ("untied", "int4_weights")],
)
def test_engine_logprobs_are_the_quantized_policys(models, name, weights):
    model = models[name]
    before = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model)))
    sampling = SamplingConfig(8, temperature=1.0)
    engine, params, groups = _run(model, weights, sampling, key=3)
    # The caller's (the trainer's: checkpoints, exports) params are untouched, full precision.
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))
    jax.tree.map(np.testing.assert_array_equal, before, nnx.to_pure_dict(params))
    quantized = engine.programs.engine_params(params)
    assert quantized is engine.programs.engine_params(params)  # made once per weights object
    pushed = jax.tree.map(jnp.copy, params)  # a new version: quantized on device, no host copy
    with jax.transfer_guard("disallow"):
        engine.programs.engine_params(pushed)
    quantized = engine.programs.engine_params(params)
    assert quantize.weight_bytes(quantized) < 0.6 * quantize.weight_bytes(params)
    if weights in ("int8_weights", "fp8", "int4_weights"):  # weight-only: dequantized, fp32
        dequant = jax.tree.map(
            lambda x: x.dequantize() if isinstance(x, quantize.QuantizedKernel) else x,
            quantized, is_leaf=lambda x: isinstance(x, quantize.QuantizedKernel),
        )  # fmt: skip
        policy = dequant
    else:  # "int8" on CPU: activations quantized per token, as in a whole-sequence forward
        assert engine.programs.weights == "int8_dynamic"
        policy = quantized
    forward = _forward(engine.programs.graphdef, sampling)
    worst = 0.0
    with jax.default_matmul_precision("highest"):
        for g in groups:
            for s in range(2):
                p, t = list(g.prompt), g.tokens_gn[s]
                ref = np.asarray(forward(policy, jnp.asarray([p + list(t)])))[0]
                ref = ref[np.arange(len(p) - 1, len(p) - 1 + len(t)), t]
                worst = max(
                    worst, float(np.abs(np.where(g.mask_gn[s], ref - g.logprobs_gn[s], 0)).max())
                )
    assert worst <= 1e-4, worst


def test_refusals_come_before_device_work(models):
    graphdef = nnx.graphdef(models["tied"])
    with jax.transfer_guard("disallow"):
        with pytest.raises(ValueError, match="expected one of"):
            GeneratorConfig(weights="int4").validate()
        with pytest.raises(ValueError, match="needs kind='engine'"):
            GeneratorConfig(kind="static", weights="int8").validate()
        with pytest.raises(ValueError, match="expected one of"):
            quantize.engine_format(graphdef, CONFIG, None, "fp4")
        lora = lora_lib.LoraConfig(rank=2, alpha=4.0)
        wrapped, _ = lora_lib.abstract_lora(CONFIG, lora)
        with pytest.raises(ValueError, match="LoRA"):
            quantize.engine_format(wrapped, CONFIG, None, "int8")
        wide = CONFIG.replace(intermediate_size=quantize.MAX_DYNAMIC_CONTRACTION + 1)
        wide_graph = nnx.graphdef(nnx.eval_shape(lambda: Transformer(wide, rngs=nnx.Rngs(0))))
        with pytest.raises(ValueError, match="overflow int32"):
            quantize.engine_format(wide_graph, wide, None, "int8_dynamic")
        assert quantize.engine_format(wide_graph, wide, None, "int8_weights")[0] == "int8_weights"
        GeneratorConfig(weights="fp8").validate()
        tpu = SimpleNamespace(devices=np.array([SimpleNamespace(platform="tpu")]))
        with pytest.raises(ValueError, match="no fp8 matmul units.*use weights='int8'"):
            quantize.engine_format(graphdef, CONFIG, tpu, "fp8")
        assert quantize.resolve_format("fp8", "gpu") == quantize.resolve_format("fp8", "cpu")
        abstract = nnx.to_pure_dict(
            nnx.state(nnx.eval_shape(lambda: Transformer(CONFIG, rngs=nnx.Rngs(0))))
        )
        abstract["layers"][0]["attention"]["q_kernel"] = jax.ShapeDtypeStruct((64, 32), jnp.float32)
        with pytest.raises(ValueError, match="per-output-channel scales take a rank-3"):
            quantize.check_shapes(abstract, CONFIG, stacked=False)


def test_the_rl_sampler_carries_the_format(models):
    """`mesh_sampler` (rl_main's colocated and generator samplers) builds the engine with the
    format; a LoRA policy's too (its base quantized once: tests/test_quantized_lora.py)."""
    from jaxrl.generation.placement import mesh_sampler

    trainer = SimpleNamespace(
        lora=None, graphdef=nnx.graphdef(models["tied"]), model_config=CONFIG, base_params=None
    )
    tokenizer = SimpleNamespace(pad_token_id=0)
    sampler = mesh_sampler(trainer, tokenizer, None, None, num_slots=4, weights="int8")
    assert sampler.engine.programs.weights == "int8_dynamic"
    native = mesh_sampler(trainer, tokenizer, None, None, num_slots=4)
    assert native.engine.programs.weights == "native"
    config = lora_lib.LoraConfig(rank=2, alpha=4.0)
    graphdef, _ = lora_lib.abstract_lora(CONFIG, config)
    lora = SimpleNamespace(**{**vars(trainer), "lora": config, "graphdef": graphdef})
    lora.base_params = nnx.to_pure_dict(nnx.state(models["tied"]))
    lora.mesh = lora.rules = None
    adapted = mesh_sampler(lora, tokenizer, None, None, num_slots=4, weights="int8")
    assert adapted.engine.programs.weights == "int8_dynamic" and adapted.graphdef == graphdef


def test_the_hlo_cost_model_counts_8_bit_arrays_a_byte_an_element():
    """`jaxrl.infra.hlo_cost` (the plans' whole-step bytes) reads fp8 element types."""
    from jaxrl.infra import hlo_cost

    assert hlo_cost.shape_bytes("(f8e4m3fn[4096,14336], s8[8], f8e5m2[2], bf16[3])") == (
        4096 * 14336 + 8 + 2 + 6
    )


# The TPU compiler's int8 matmul of one layer of stacked weights (Llama 3 8B's decode on v5e,
# trimmed): the stack retiled by a copy fusion, a layer sliced out of it, nested in the matmul's.
RETILED_SLICE = """
%retile (input: s8[80,64,64]) -> s8[80,64,64] {
  %input = s8[80,64,64]{2,1,0:T(32,128)(4,1)} parameter(0)
  ROOT %copy = s8[80,64,64]{2,1,0:T(8,128)(4,1)} copy(%input)
}

%slice_layer (w: s8[80,64,64], i: s32[]) -> s8[64,64] {
  %w = s8[80,64,64] parameter(0)
  %retiled = s8[80,64,64] fusion(%w), kind=kLoop, calls=%retile
  %i = s32[] parameter(1)
  %zero = s32[] constant(0)
  %ds = s8[1,64,64] dynamic-slice(%retiled, %i, %zero, %zero), dynamic_slice_sizes={1,64,64}
  ROOT %layer = s8[64,64] bitcast(%ds)
}

%matmul (x: bf16[8,64], w: s8[80,64,64], i: s32[]) -> bf16[8,64] {
  %x = bf16[8,64] parameter(0)
  %w = s8[80,64,64] parameter(1)
  %i = s32[] parameter(2)
  %layer = s8[64,64] fusion(%w, %i), kind=kLoop, calls=%slice_layer
  ROOT %dot = bf16[8,64] convolution(%x, %layer), dim_labels=bf_io->bf
}

ENTRY %main (x: bf16[8,64], w: s8[80,64,64], i: s32[]) -> bf16[8,64] {
  %x = bf16[8,64] parameter(0)
  %w = s8[80,64,64] parameter(1)
  %i = s32[] parameter(2)
  ROOT %y = bf16[8,64] fusion(%x, %w, %i), kind=kOutput, calls=%matmul
}
"""


def test_a_layer_sliced_out_of_retiled_int8_weights_counts_one_layer():
    """The fused relayout of the whole stack runs only for the elements the slice takes: the
    matmul reads one int8 layer, not the [80, 64, 64] stack (it did: 32x a layer on 8B)."""
    from jaxrl.infra import hlo_cost

    (kernel,) = hlo_cost.kernels(RETILED_SLICE)
    one_layer, x_and_out, index = 64 * 64, 2 * 8 * 64 * 2, 4
    assert kernel.bytes == one_layer + x_and_out + index

"""8-bit generator weights with a LoRA policy (`jaxrl.generation.quantized_lora`): the adapter
term on a quantized kernel in each format, the LoRA engine's behaviour log-probs being the
policy's with the dequantized base (weight-only) or the quantized forward (dynamic), the base
quantized once across calls and pushes with the adapters left unquantized, the per-call params
being the adapters only, and the refusals that remain before any device work."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.generation import quantize
from jaxrl.generation.placement import mesh_sampler
from jaxrl.generation.quantized_lora import AdaptedKernel, QuantizedBase
from jaxrl.generation.sampling import SamplingConfig, processed_logprobs
from jaxrl.infra.mesh import MeshConfig, make_mesh
from jaxrl.infra.sharding import GENERATOR_RULES
from jaxrl.models.config import ModelConfig
from jaxrl.models.transformer import Transformer
from jaxrl.train import lora as lora_lib

PROMPTS = [[1, 5, 6, 7, 8, 9, 10, 11], [1, 20, 21], [1, 30, 31, 32, 33, 34]]
CONFIG = ModelConfig(
    "llama", 64, 32, 64, 1, 4, 4, 8, max_position_embeddings=128, tie_word_embeddings=False
)
LORA = lora_lib.LoraConfig(rank=2, alpha=4.0)
SAMPLING = SamplingConfig(6, temperature=1.0)


@functools.cache
def _lora_model(lora):
    """The LoRA model's graphdef and its abstract adapters (pure dict)."""
    graphdef, abstract = lora_lib.abstract_lora(CONFIG, lora)
    return graphdef, nnx.to_pure_dict(abstract)


@functools.cache
def _forward(graphdef):
    """The processed log-probs of a whole-sequence forward of `graphdef`."""
    return jax.jit(lambda p, t: processed_logprobs(nnx.merge(graphdef, p)(t), SAMPLING))


def _adapters(lora, seed, part=lora_lib.trained_part):
    """Adapters (`part` of them: by default what a push moves) with A and B both nonzero (a
    fresh B is zero), large enough to move logits."""
    rng = np.random.default_rng(seed)
    normal = lambda x: jnp.asarray(0.3 * rng.normal(size=x.shape), x.dtype)  # noqa: E731
    return jax.tree.map(normal, part(_lora_model(lora)[1], lora))


@pytest.fixture(scope="module")
def base():
    model = lambda: Transformer(CONFIG, rngs=nnx.Rngs(0), init_std=0.3)  # noqa: E731
    return jax.jit(lambda: nnx.to_pure_dict(nnx.state(model())))()


@pytest.fixture(scope="module")
def weight_only(base):
    """One int8 weight-only LoRA sampler, shared (its compiled programs too)."""
    return _sampler(base, "int8_weights")


def _sampler(base, weights, lora=LORA, mesh=None):
    """rl_main's sampler for a LoRA trainer (`mesh_sampler`): on the default device, or on a
    generator `mesh` (the base placed there with the generator's rules)."""
    graphdef = _lora_model(lora)[0]
    held = base
    if lora.freeze_a:  # the frozen A's sit beside the base
        held = lora_lib.combine(base, _adapters(lora, 0, lora_lib.frozen_part))
    trainer = SimpleNamespace(
        lora=lora, graphdef=graphdef, model_config=CONFIG, base_params=held, mesh=None, rules=None
    )
    tokenizer = SimpleNamespace(pad_token_id=0)
    rules = None if mesh is None else GENERATOR_RULES
    return mesh_sampler(
        trainer, tokenizer, mesh, rules, num_slots=6, steps_per_call=4, weights=weights
    )


def _spy(sampler):
    """Records the params each engine call gets."""
    seen, run = [], sampler.engine.generate

    def generate(params, *args, **kwargs):
        seen.append(params)
        return run(params, *args, **kwargs)

    sampler.engine.generate = generate
    return seen


def _is_q(x):
    return isinstance(x, quantize.QuantizedKernel | AdaptedKernel)


@pytest.mark.parametrize("mode", ["int8_weights", "int8_dynamic", "fp8"])
def test_the_adapter_term_is_added_unquantized_on_each_format(mode):
    """One projection per shape (q-like `[E, H, D]`, o-like contracting two axes, an MLP's):
    the adapted kernel's output minus the base kernel's is `scale (x @ A) @ B` from the
    unquantized activations, for each 8-bit format and for a full-precision base."""
    rng = np.random.default_rng(0)
    cases = (((32, 4, 8), 1), ((4, 8, 32), 2), ((32, 48), 1))
    args, want = [], []
    for shape, contract in cases:
        k, n = int(np.prod(shape[:contract])), int(np.prod(shape[contract:]))
        w, a = rng.normal(size=shape), rng.normal(size=(k, 2))
        b, x = rng.normal(size=(2, n)), rng.normal(size=(2, 3, *shape[:contract]))
        args.append([np.asarray(v, np.float32) for v in (w, a, b, x)])
        want.append(2.0 * (x.reshape(6, k) @ a @ b).reshape(2, 3, *shape[contract:]))

    def terms(args):  # the adapted kernel's output less the base kernel's, 8-bit and fp32
        out = []
        for (w, a, b, x), (_, contract) in zip(args, cases, strict=True):
            for kernel in (quantize.quantize_kernel(w, contract, False, mode), w):
                adapted = AdaptedKernel(kernel, a, b, 2.0)[...].astype(jnp.float32)
                y = adapted.quantized_matmul(x, contract)
                out.append(y - AdaptedKernel(kernel, a * 0, b, 2.0).quantized_matmul(x, contract))
        return out

    with jax.default_matmul_precision("highest"):
        got = jax.jit(terms)(args)
    for i, term in enumerate(got):
        np.testing.assert_allclose(term, want[i // 2], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("weights", "lora"), [
    ("int8_weights", LORA), ("int8", lora_lib.LoraConfig(rank=2, alpha=4.0, freeze_a=True)),
])  # fmt: skip
def test_behaviour_logprobs_are_the_lora_policy_on_the_quantized_base(
    base, weight_only, weights, lora
):
    """Weight-only: a whole-sequence forward of the qwix LoRA model on the dequantized base
    kernels (an independent spelling of the adapter term) gives the engine's log-probs.
    "int8" on CPU (dynamic, activations quantized per token) with LoRA-FA (the frozen A's
    held beside the base, the B's pushed), on a 2 x 2 generator mesh: the quantized plain
    model's forward, the 8-bit values laid out as their kernels."""
    if weights == "int8_weights":
        sampler = weight_only
    else:  # on a generator mesh (data x tensor parallel), the base placed there
        mesh = make_mesh(MeshConfig(("dp", "tp"), (2, 2), num_devices=4))
        sampler = _sampler(base, weights, lora, mesh)
    seen = _spy(sampler)
    adapters = _adapters(lora, seed=1)
    out = sampler.generate(adapters, PROMPTS, SAMPLING, jax.random.key(3), num_samples=2)
    dynamic = sampler.engine.programs.weights == "int8_dynamic"
    if dynamic:  # the engine's own tree in a whole-sequence forward
        graphdef, policy = sampler.quantized_base.graphdef, sampler.sampled_params
        assert sampler.sampled_params(adapters).keys() == seen[-1].keys()
    else:  # the qwix LoRA model on the dequantized base
        graphdef = sampler.graphdef
        dequant = jax.tree.map(
            lambda x: x.dequantize() if isinstance(x, quantize.QuantizedKernel) else x,
            sampler.quantized_base(sampler.base_params), is_leaf=_is_q,
        )  # fmt: skip
        policy = functools.partial(lora_lib.combine, dequant)
    if sampler.mesh is not None:  # the 8-bit values laid out as their kernels on the mesh
        held = sampler.base_params
        for path in sampler.quantized_base.paths:
            kernel, q = held, sampler.quantized_base(held)
            for key in path:
                kernel, q = kernel[key], q[key]
            assert q.values.sharding.is_equivalent_to(kernel.sharding, kernel.ndim), path
    # Every row in one forward, right-padded (causal: the padding does not reach the scores).
    rows = [PROMPTS[r // 2] + list(out.tokens_bn[r][out.mask_bn[r]]) for r in range(6)]
    tokens = np.zeros((6, max(map(len, rows))), np.int32)
    for r, row in enumerate(rows):
        tokens[r, : len(row)] = row

    def scores(graphdef, params):
        with jax.default_matmul_precision("highest"):
            logprobs = np.asarray(_forward(graphdef)(params, tokens))
        picked = []
        for r in range(6):
            n = int(out.mask_bn[r].sum())
            at = np.arange(len(PROMPTS[r // 2]) - 1, len(PROMPTS[r // 2]) - 1 + n)
            picked.append(logprobs[r, at, tokens[r, at + 1]])
        return np.concatenate(picked)

    sampled = np.concatenate([out.logprobs_bn[r][out.mask_bn[r]] for r in range(6)])
    ref = scores(graphdef, policy(adapters))
    worst = float(np.abs(ref - sampled).max())
    # The adapters matter; weight-only: the base is quantized (the full-precision policy differs).
    off_base = float(np.abs(scores(graphdef, policy(lora_lib.zero_adapters(adapters))) - ref).max())
    off_fp, note = 1.0, ""
    if not dynamic:
        off_fp = float(np.abs(scores(graphdef, sampler.full_params(adapters)) - ref).max())
        note = f", against the full-precision LoRA policy {off_fp:.3f}"
    print(f"[quantized lora] {weights}: |engine - forward| <= {worst:.2e}; the forward against "
          f"zero B's {off_base:.3f}{note}")  # fmt: skip
    assert worst <= 1e-4, worst
    assert off_base > 0.1 and off_fp > 1e-3, (off_base, off_fp)


def test_the_base_is_quantized_once_and_the_adapters_never(base, weight_only):
    """Three calls, each with new adapters (pushed versions): one quantization of the base,
    the same 8-bit arrays in every call, the adapters' own float32 arrays in what the engine
    runs, and per call nothing but the adapters new (their bytes: what a push moves). A new
    base object is quantized once more."""
    sampler = weight_only
    seen = _spy(sampler)
    pushes = [_adapters(LORA, seed) for seed in (1, 2, 3)]
    for i, adapters in enumerate(pushes):
        sampler.generate(adapters, PROMPTS[:1], SAMPLING, jax.random.key(i), num_samples=2)
    assert sampler.quantized_base.count == 1
    held = jax.tree.leaves(sampler.quantized_base(sampler.base_params), is_leaf=_is_q)
    assert not any(isinstance(x, AdaptedKernel) for x in held)  # the calls left it as it was
    programs = sampler.engine.programs  # which runs the tree as it is given (no quantizing)
    assert programs.weights == "int8_weights" and programs.engine_params(seen[-1]) is seen[-1]
    runs = [jax.tree.leaves(params, is_leaf=_is_q) for params in seen]
    kernels = [[x.base if isinstance(x, AdaptedKernel) else x for x in leaves] for leaves in runs]
    for leaves in kernels[1:]:  # the same quantized arrays every call
        assert all(x is y for x, y in zip(kernels[0], leaves, strict=True))
    for adapters, params in zip(pushes, seen, strict=True):
        adapted = [
            x for x in jax.tree.leaves(params, is_leaf=_is_q) if isinstance(x, AdaptedKernel)
        ]
        pairs = [(x.lora_a, x.lora_b) for x in adapted]
        names = lora_lib.adapter_names(adapters)
        assert len(adapted) == len(names) == CONFIG.num_layers * 7
        assert all(isinstance(x.base, quantize.QuantizedKernel) for x in adapted)
        assert all(a.dtype == b.dtype == jnp.float32 for a, b in pairs)
        pushed = {id(x) for x in jax.tree.leaves(adapters)}
        assert {id(x) for pair in pairs for x in pair} == pushed  # the pushed arrays themselves
    # Between two calls only the adapters change: a push's bytes are the adapters'.
    first = {id(x): x for x in jax.tree.leaves(seen[0])}
    new = [x for x in jax.tree.leaves(seen[1]) if id(x) not in first]
    moved = lora_lib.tree_bytes(new)
    assert moved == lora_lib.tree_bytes(pushes[1]) < 0.3 * lora_lib.tree_bytes(base)
    print(f"[quantized lora] a call's new bytes {moved} = the adapters' "
          f"{lora_lib.tree_bytes(pushes[1])}; base {lora_lib.tree_bytes(base)}")  # fmt: skip
    held = sampler.base_params
    sampler.base_params = jax.tree.map(jnp.copy, held)
    sampler.generate(pushes[0], PROMPTS[:1], SAMPLING, jax.random.key(0), num_samples=2)
    assert sampler.quantized_base.count == 2
    sampler.base_params = held


def test_refusals_come_before_device_work(base):
    """What stays refused, before anything is built or placed: an int8_dynamic contraction
    that could overflow int32, fp8 on TPU, 8-bit weights on the static sampler, a quantized
    LoRA engine without its LoraConfig, scanned layers, LoRA on a mixture-of-experts model's
    experts (qwix cannot adapt them)."""
    from jaxrl.generation.placement import AdapterEngineSampler

    wide = CONFIG.replace(intermediate_size=quantize.MAX_DYNAMIC_CONTRACTION + 1)
    tpu = SimpleNamespace(devices=np.array([SimpleNamespace(platform="tpu")]))
    graphdef = _lora_model(LORA)[0]
    trainer = SimpleNamespace(
        lora=LORA, graphdef=graphdef, model_config=CONFIG, base_params=None, mesh=None, rules=None
    )
    tokenizer = SimpleNamespace(pad_token_id=0)
    with jax.transfer_guard("disallow"):
        with pytest.raises(ValueError, match="overflow int32"):  # before the engine is built
            wide_trainer = SimpleNamespace(**{**vars(trainer), "model_config": wide})
            mesh_sampler(wide_trainer, tokenizer, None, None, weights="int8_dynamic")
        with pytest.raises(ValueError, match="no fp8 matmul units"):
            QuantizedBase(CONFIG, tpu, "fp8")
        with pytest.raises(ValueError, match="scan_layers=False"):
            QuantizedBase(CONFIG.replace(scan_layers=True), None, "int8")
        with pytest.raises(ValueError, match="the static sampler runs the weights as given"):
            mesh_sampler(trainer, tokenizer, None, None, generator="static", weights="int8")
        with pytest.raises(ValueError, match="needs the policy's LoraConfig"):
            AdapterEngineSampler(graphdef, CONFIG, pad_id=0, weights="int8")
        moe = ModelConfig("qwen3_moe", 64, 32, 64, 2, 4, 4, 8, num_experts=4,
                          num_experts_per_tok=2, moe_intermediate_size=16)  # fmt: skip
        with pytest.raises(ValueError, match="mixture-of-experts"):
            lora_lib.abstract_lora(moe, LORA)


def test_the_mismatch_is_measured_against_the_full_precision_lora_policy(weight_only):
    """rl_main's generator executor on a LoRA 8-bit sampler: the scorer gets base + adapters in
    full precision (`full_params`; the adapters alone are not a model's params), and the
    "uncorrected" control hands the trainer exactly those log-probs."""
    from jaxrl.generation.executor import GeneratorExecutor
    from jaxrl.tasks.source import PromptItem

    adapters = _adapters(LORA, 5)
    items = [PromptItem(text="p", reference=None)]
    out = {}
    for mode in ("measure", "uncorrected"):
        executor = GeneratorExecutor(weight_only, SAMPLING, 2, seed=0, mismatch=mode)
        out[mode] = executor.generate(adapters, items, PROMPTS[:1], 1, 0)
    measured = out["measure"].metrics
    assert measured["gen/mismatch_kl"] > 0 and measured["gen/mismatch_abs_log_ratio_max"] > 0
    full = executor.scorer.logprobs(
        weight_only.full_params(adapters), out["measure"].prompt_ids, out["measure"].completion_ids
    )
    for got, want in zip(out["uncorrected"].behaviour_logprobs, full, strict=True):
        np.testing.assert_array_equal(got, want)

"""LoRA through qwix (`jaxrl.train.lora`): adapters attach to every targeted projection, a fresh
adapter is the base bit for bit, merged / PEFT exports match the unmerged model (against
`transformers` + `peft`), the trainer moves adapters only, and weight pushes are <= 2% of the
model."""

from __future__ import annotations

import dataclasses
import functools
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from flax import nnx
from hf_fixtures import save_tiny_checkpoint

from jaxrl.infra.mesh import MeshConfig, make_mesh
from jaxrl.infra.sharding import TRAINER_RULES
from jaxrl.models import hf
from jaxrl.models.config import ModelConfig
from jaxrl.models.transformer import Transformer
from jaxrl.train import lora as lora_lib
from jaxrl.train.trainer import Trainer

ALL = lora_lib.LoraConfig(rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny random HF Llama 3 (2 layers, E 64, F 96, 4 / 2 heads), loaded into our model."""
    path = tmp_path_factory.mktemp("base") / "hf"
    save_tiny_checkpoint(path, "llama3")
    config = hf.load_config(str(path))
    return str(path), config, nnx.to_pure_dict(hf.load_params(str(path), config))


@functools.cache
def _forward(config, lora=None):
    """The jitted forward of the plain model (`lora` None) or the LoRA model, one per (config,
    LoRA config) for the module: the same programs serve every call of `_logits` instead of
    being compiled again by each."""
    if lora is None:
        graphdef = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))[0]
    else:
        graphdef, _ = lora_lib.abstract_lora(config, lora)
    return jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))


def _logits(config, params, adapters=None, lora=ALL):
    """float32 logits of the plain model (`adapters` None) or the LoRA model, and the tokens."""
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, 97, (2, 9)), jnp.int32)
    if adapters is None:
        forward = _forward(config)
    else:
        forward = _forward(config, lora)
        params = lora_lib.combine(params, adapters)
    return np.asarray(forward(params, tokens)), np.array(tokens)  # writable: torch takes it


def _random_adapters(config, lora, seed=1):
    """Adapters with A and B both nonzero (a fresh B is zero), large enough to move logits."""
    leaves, treedef = jax.tree.flatten(nnx.to_pure_dict(lora_lib.abstract_lora(config, lora)[1]))
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(
        treedef,
        [0.3 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves, strict=True)],
    )


def test_adapters_attach_to_every_targeted_projection(base):
    _, config, _ = base
    cases = {
        r"layers/\d+/(attention|mlp)": {"q", "k", "v", "o", "gate", "up", "down"},
        r"layers/\d+/attention": {"q", "k", "v", "o"},
        r"layers/1/mlp": {"gate", "up", "down"},
    }
    for pattern, kernels in cases.items():
        lora = lora_lib.LoraConfig(rank=2, alpha=2.0, target_modules=pattern)
        _, abstract = lora_lib.abstract_lora(config, lora)
        names = lora_lib.adapter_names(nnx.to_pure_dict(abstract))
        layers = 1 if "layers/1" in pattern else config.num_layers
        assert len(names) == layers * len(kernels), names
        assert {n.split("/")[-1].removesuffix("_kernel") for n in names} == kernels
    # target_kernels narrows a module's projections to the named ones (the LoRA paper's q, v).
    qv = lora_lib.LoraConfig(rank=2, alpha=2.0, target_modules=r"layers/\d+/attention",
                             target_kernels="q|v")  # fmt: skip
    _, abstract = lora_lib.abstract_lora(config, qv)
    names = lora_lib.adapter_names(nnx.to_pure_dict(abstract))
    assert len(names) == 2 * config.num_layers, names
    assert {n.split("/")[-1].removesuffix("_kernel") for n in names} == {"q", "v"}
    with pytest.raises(ValueError, match="matched no projection"):
        lora_lib.abstract_lora(config, dataclasses.replace(qv, target_kernels="gate"))
    with pytest.raises(ValueError, match="target_kernels"):
        lora_lib.LoraConfig(target_kernels="q|(v")
    with pytest.raises(ValueError, match="matched no projection"):
        lora_lib.abstract_lora(config, lora_lib.LoraConfig(target_modules="nothing"))
    with pytest.raises(ValueError, match="scan_layers=False"):
        lora_lib.abstract_lora(config.replace(scan_layers=True), ALL)


def test_fresh_adapters_are_the_base_and_merge_matches_unmerged(base):
    _, config, params = base
    fresh = lora_lib.init_adapters(config, ALL)
    assert all(not np.any(b) for n, b in _flat(fresh).items() if n.endswith("_lora_b']"))
    plain, _ = _logits(config, params)
    zero_b, _ = _logits(config, params, fresh)
    assert np.array_equal(plain, zero_b)  # B = 0: bit-identical
    adapters = _random_adapters(config, ALL)
    unmerged, _ = _logits(config, params, adapters)
    merged, _ = _logits(config, lora_lib.merge(params, adapters, ALL))
    assert np.abs(unmerged - plain).max() > 1.0  # the adapters matter (negative control)
    np.testing.assert_allclose(merged, unmerged, rtol=1e-5, atol=2e-5)


def test_peft_export_loads_in_transformers_and_matches(base, tmp_path):
    import peft
    import transformers

    path, config, params = base
    adapters = _random_adapters(config, ALL)
    ours, tokens = _logits(config, params, adapters)
    lora_lib.save_peft(adapters, ALL, str(tmp_path / "peft"), base_model=path)
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        plain = hf_base(torch.from_numpy(tokens)).logits.numpy()
    model = peft.PeftModel.from_pretrained(hf_base, str(tmp_path / "peft")).eval()
    with torch.no_grad():
        theirs = model(torch.from_numpy(tokens)).logits.numpy()
    assert np.abs(theirs - plain).max() > 1.0  # peft applied the adapters
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4)
    # The merged export is a plain HF checkpoint with the same logits.
    graphdef = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))[0]
    hf.save_hf(nnx.merge(graphdef, lora_lib.merge(params, adapters, ALL)), str(tmp_path / "m"))
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    with torch.no_grad():
        np.testing.assert_allclose(
            merged(torch.from_numpy(tokens)).logits.numpy(), ours, rtol=1e-4, atol=1e-4
        )


def _flat(tree):
    return {
        jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(tree)
    }


def _three_sft_steps(trainer, state):
    """Three SFT steps on one random batch; the loss must fall."""
    rng = np.random.default_rng(0)
    batch = {
        "tokens_bs": rng.integers(3, 97, (4, 10)).astype(np.int32),
        "loss_mask_bs": np.tile(np.arange(10) >= 5, (4, 1)),
    }
    first = None
    for _ in range(3):
        state, metrics = trainer.sft_step(state, batch)
        first = first if first is not None else float(metrics["loss"])
    assert float(metrics["loss"]) < first
    return state


def test_trainer_moves_adapters_only(base):
    _, config, params = base
    mesh = make_mesh(MeshConfig(("fsdp", "tp"), (4, 1), num_devices=4))
    trainer = Trainer(config, mesh, TRAINER_RULES, optax.adam(1e-2), lora=ALL)
    state = trainer.init(params)
    base_before = _flat(params)
    state = _three_sft_steps(trainer, state)
    # The base is bitwise unchanged; every adapter B moved off zero.
    after = _flat(trainer.base_params)
    assert after.keys() == base_before.keys()
    assert all(after[k].tobytes() == base_before[k].tobytes() for k in after)
    assert all(np.any(v) for k, v in _flat(state.params).items() if k.endswith("_lora_b']"))
    # Params and optimizer state are the adapters' size (Adam: mu and nu, plus a counter).
    n_adapters = lora_lib.count_params(state.params)
    assert n_adapters == lora_lib.count_params(lora_lib.init_adapters(config, ALL))
    opt_arrays = [x for x in jax.tree.leaves(state.opt_state) if x.ndim]
    assert sum(x.size for x in opt_arrays) == 2 * n_adapters
    # The KL reference (trained adapters switched off) is the base, bit for bit.
    plain, _ = _logits(config, params)
    off, _ = _logits(config, params, lora_lib.zero_adapters(jax.device_get(state.params)))
    assert np.array_equal(off, plain)
    # Merged (plain model) logits match the trained LoRA model within fp32 rounding.
    merged, _ = _logits(config, lora_lib.merge(params, jax.device_get(state.params), ALL))
    unmerged, _ = _logits(config, params, jax.device_get(state.params))
    np.testing.assert_allclose(merged, unmerged, rtol=1e-5, atol=2e-5)


def test_lora_fa_trains_and_pushes_b_only(base):
    """LoRA-FA (`freeze_a`): the state (so the optimizer, checkpoints and pushes) holds the B's
    alone; the A's sit in the base, bitwise their seeded init after training; the generator's
    layouts split the same way; merged logits match the unmerged model."""
    from jaxrl.generation.placement import generator_param_shardings
    from jaxrl.infra.sharding import GENERATOR_RULES

    _, config, params = base
    fa = lora_lib.LoraConfig(rank=4, alpha=8.0, freeze_a=True)
    mesh = make_mesh(MeshConfig(("fsdp", "tp"), (4, 1), num_devices=4))
    trainer = Trainer(config, mesh, TRAINER_RULES, optax.adam(1e-2), lora=fa)
    state = trainer.init(params)
    fresh = _flat(lora_lib.init_adapters(config, fa))
    trained = _flat(state.params)
    assert trained and all(k.endswith("_lora_b']") for k in trained)
    assert trained.keys() == {k for k in fresh if k.endswith("_lora_b']")}
    e, q = config.hidden_size, config.num_heads * config.head_dim
    kv, f = config.num_kv_heads * config.head_dim, config.intermediate_size
    b_per_layer = fa.rank * (q + 2 * kv + e + 2 * f + e)  # r x out over q, k, v, o, gate, up, down
    assert lora_lib.count_params(state.params) == config.num_layers * b_per_layer
    state = _three_sft_steps(trainer, state)
    base_after = _flat(trainer.base_params)
    a_keys = [k for k in fresh if k.endswith("_lora_a']")]
    assert a_keys and all(base_after[k].tobytes() == fresh[k].tobytes() for k in a_keys)
    assert all(base_after[k].tobytes() == v.tobytes() for k, v in _flat(params).items())
    assert all(np.any(v) for v in _flat(state.params).values())
    opt_arrays = [x for x in jax.tree.leaves(state.opt_state) if x.ndim]
    assert sum(x.size for x in opt_arrays) == 2 * lora_lib.count_params(state.params)
    gen_mesh = make_mesh(MeshConfig(("dp", "tp"), (4, 1), first_device=4, num_devices=4))
    pushed = generator_param_shardings(trainer, gen_mesh, GENERATOR_RULES)
    held = generator_param_shardings(trainer, gen_mesh, GENERATOR_RULES, base=True)
    assert _flat(pushed).keys() == trained.keys()
    assert _flat(held).keys() == _flat(params).keys() | set(a_keys)
    # The whole adapters (frozen A's + trained B's) merge to the unmerged model's logits.
    adapters = lora_lib.whole_adapters(config, fa, jax.device_get(state.params))
    merged, _ = _logits(config, lora_lib.merge(params, adapters, fa), lora=fa)
    unmerged, _ = _logits(config, params, adapters, lora=fa)
    np.testing.assert_allclose(merged, unmerged, rtol=1e-5, atol=2e-5)
    assert not np.allclose(unmerged, _logits(config, params)[0], atol=1e-3)  # the B's moved it


def test_lora_plus_scales_the_b_updates_only(base):
    """LoRA+ (`b_lr_ratio`): with SGD, one step moves every B by ratio x plain LoRA's step and
    leaves A where plain LoRA leaves it (unmoved: a fresh B = 0 gives A no gradient)."""
    _, config, params = base
    mesh = make_mesh(MeshConfig(("fsdp", "tp"), (4, 1), num_devices=4))
    rng = np.random.default_rng(0)
    batch = {
        "tokens_bs": rng.integers(3, 97, (4, 10)).astype(np.int32),
        "loss_mask_bs": np.tile(np.arange(10) >= 5, (4, 1)),
    }
    moved = {}
    for ratio in (1.0, 4.0):
        lora = lora_lib.LoraConfig(rank=4, alpha=8.0, b_lr_ratio=ratio)
        trainer = Trainer(config, mesh, TRAINER_RULES, optax.sgd(1e-2), lora=lora)
        state = trainer.init(params)
        start = _flat(jax.device_get(state.params))
        state, _ = trainer.sft_step(state, batch)
        moved[ratio] = {k: v - start[k] for k, v in _flat(jax.device_get(state.params)).items()}
    b_keys = [k for k in moved[1.0] if k.endswith("_lora_b']")]
    assert b_keys and all(np.any(moved[1.0][k]) for k in b_keys)
    for key, delta in moved[1.0].items():
        expected = 4.0 * delta if key in b_keys else delta
        np.testing.assert_allclose(moved[4.0][key], expected, rtol=1e-5, atol=1e-9)
    with pytest.raises(ValueError, match="b_lr_ratio"):
        lora_lib.LoraConfig(b_lr_ratio=0.0)


def _llama3_8b() -> ModelConfig:
    return ModelConfig(
        model_type="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
    )


def test_adapter_bytes_within_two_percent_of_the_model():
    """Bytes per push (the trained adapters) vs the full model: the arithmetic config's LoRA-FA
    rank 10 on attention (its B's: 1.87%), plain rank 4 on attention and rank 1 on all
    projections, and a Llama 3 8B shape (the config's LoRA-FA: 0.041%; rank 4 on attention:
    0.042%; rank 16, all projections: 0.52%).
    Adapters are counted on the abstract LoRA model (the 8B one with 2 of its 32 identical
    layers, to keep qwix's tracing short) and checked against r * (in + out) summed over the
    projections."""
    from jaxrl.job.specs import PolicySpec, TaskSpec, build_model_config, build_tokenizer

    arith = build_model_config(PolicySpec(), build_tokenizer(PolicySpec(), TaskSpec()))
    attention_only = lora_lib.LoraConfig(rank=4, alpha=8.0, target_modules=r"layers/\d+/attention")
    fa_attention = lora_lib.LoraConfig(
        rank=10, alpha=20.0, target_modules=r"layers/\d+/attention", freeze_a=True
    )
    for config, lora, mlp in (
        (arith, attention_only, False),  # plain LoRA, rank 4 on attention
        (arith, lora_lib.LoraConfig(rank=1, alpha=2.0), True),
        (arith, fa_attention, False),  # configs/rl/arith_tiny_lora.gin: LoRA-FA, the B's alone
        (_llama3_8b(), fa_attention, False),
        (_llama3_8b(), attention_only, False),
        (_llama3_8b(), lora_lib.LoraConfig(rank=16, alpha=32.0), True),
    ):
        e, f = config.hidden_size, config.intermediate_size
        q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        a_in = 0 if lora.freeze_a else 1  # LoRA-FA pushes B [r, out] only
        per_layer = lora.rank * (
            (a_in * e + q) + 2 * (a_in * e + kv) + (a_in * q + e)
            + mlp * (2 * (a_in * e + f) + (a_in * f + e))
        )  # fmt: skip
        counted = config.replace(num_layers=min(config.num_layers, 2))
        _, abstract = lora_lib.abstract_lora(counted, lora)
        pushed = lora_lib.trained_part(nnx.to_pure_dict(abstract), lora)
        assert lora_lib.count_params(pushed) == counted.num_layers * per_layer
        full = nnx.state(nnx.eval_shape(lambda c=config: Transformer(c, rngs=nnx.Rngs(0))))
        fraction = config.num_layers * per_layer / lora_lib.count_params(full)
        assert fraction <= 0.02, (config.num_layers, fraction)


def test_a_call_from_another_thread_survives_qwix_removing_its_patch():
    """The async loops trace the LoRA model in one thread while another calls JAX: qwix patches
    `jnp.asarray` process-wide during the forward pass and removes the patch when it ends. A call
    that entered the patched function just before the removal must still reach the original."""
    from qwix._src import interception

    config = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=48,
                         num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                         scan_layers=False)  # fmt: skip
    lora = lora_lib.LoraConfig(rank=2, alpha=4.0)
    graphdef, _ = lora_lib.abstract_lora(config, lora)
    params = nnx.to_pure_dict(nnx.state(lora_lib.lora_model(config, lora)))
    tokens = jnp.ones((1, 4), jnp.int32)
    trace = lambda: jax.make_jaxpr(lambda p: nnx.merge(graphdef, p)(tokens))(params)

    # The window itself: the forward pass is over, so the patch and its table entry are gone,
    # and a call that had entered the patch looks the original up (qwix 0.1.8 raised KeyError).
    trace()
    name = "jax.numpy.asarray.__code__"
    manager = interception.interception_manager
    assert name not in manager._original_fns
    out = manager._on_intercepted_called(name, (np.arange(3, dtype=np.int32),), {})
    np.testing.assert_array_equal(np.asarray(out), [0, 1, 2])

    # And the race as it happens: one thread tracing, one calling, for a few seconds (without
    # the guard this raised within 1-11 s).
    stop, errors, calls = threading.Event(), [], [0]

    def tracing():
        try:
            while not stop.is_set():
                trace()
                # Hands the GIL over between traces: without it the calling thread was starved
                # on a fast Xeon (2 calls in 3 s against 426 traces).
                time.sleep(0)
        except Exception as e:  # noqa: BLE001 - the failure is what is recorded
            errors.append(e)

    def calling():
        try:
            while not stop.is_set():
                assert int(jnp.asarray(np.int32(calls[0]))) == calls[0]
                calls[0] += 1
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=tracing), threading.Thread(target=calling)]
    for t in threads:
        t.start()
    stop.wait(3.0)
    stop.set()
    for t in threads:
        t.join()
    assert not errors, errors
    assert calls[0] > 10

"""Scanned layers (`ModelConfig.scan_layers`) and remat policies: the same numbers as the
unrolled model, HF import / export of the stacked layout, sharded loading, the sampler, and a
traced program whose size does not grow with depth."""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_fixtures import left_padded_batch, reference_logits, save_tiny_checkpoint

from jaxrl.generation.sampler import Sampler
from jaxrl.generation.sampling import SamplingConfig
from jaxrl.infra.mesh import MeshConfig, make_mesh
from jaxrl.infra.sharding import TRAINER_RULES, param_shardings
from jaxrl.models import hf
from jaxrl.models.config import ModelConfig
from jaxrl.models.remat import REMAT_POLICIES
from jaxrl.models.scan import is_stacked, stack_layers, unstack_layers
from jaxrl.models.transformer import Transformer


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3")  # q/k norms and biases: every kind of layer param
    torch_model = save_tiny_checkpoint(path, "qwen3", attention_bias=True)
    tokens, mask = left_padded_batch(torch_model.config.vocab_size)
    return str(path), tokens, mask, reference_logits(torch_model, tokens, mask)


def _logits(model, tokens, mask):
    # Jitted: run eagerly, each op of the forward compiles a program of its own.
    with jax.default_matmul_precision("highest"):
        logits = nnx.jit(lambda m, t, v: m(t, v))(
            model, jnp.asarray(tokens), jnp.asarray(mask, bool)
        )
    return np.asarray(logits)


def test_scanned_load_matches_unrolled_and_transformers(checkpoint):
    path, tokens, mask, ref = checkpoint
    unrolled = hf.load_model(path)
    scanned = hf.load_model(path, scan_layers=True)
    pure = nnx.to_pure_dict(nnx.state(scanned, nnx.Param))
    assert is_stacked(pure) and not is_stacked(nnx.to_pure_dict(nnx.state(unrolled, nnx.Param)))
    layers = scanned.config.num_layers
    assert pure["layers"]["attention"]["q_kernel"].shape[0] == layers
    a, b = _logits(unrolled, tokens, mask), _logits(scanned, tokens, mask)
    scale = float(np.abs(a).max())
    print(f"scanned vs unrolled: {np.abs(a - b).max() / scale:.3g} of max|logit|")
    assert np.abs(a - b).max() <= 1e-6 * scale, np.abs(a - b).max()
    valid = mask == 1
    tolerance = 2e-5 * max(1.0, float(np.abs(ref).max()))  # the HF parity tolerance
    assert np.abs(b - ref)[valid].max() <= tolerance


GRAD_CONFIG = ModelConfig("llama", 64, 32, 64, 3, 4, 2, 8)
GRAD_TOKENS = np.random.default_rng(0).integers(0, 64, (2, 9))
GRAD_VALID = np.arange(9)[None] >= np.array([[3], [0]])


def _grad_loss(model):
    tokens, valid = jnp.asarray(GRAD_TOKENS), jnp.asarray(GRAD_VALID)
    return jnp.sum(jax.nn.log_softmax(model(tokens, valid))[..., 5] * valid)


@pytest.fixture(scope="module")
def unrolled_grads():
    """The unrolled model's parameters and gradients (stacked), computed once for the module:
    the remat policy under test applies to the scanned model only, so every case compares
    against the same unrolled gradients."""
    unrolled = Transformer(GRAD_CONFIG, rngs=nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.state(unrolled, nnx.Param))
    with jax.default_matmul_precision("highest"):
        want = nnx.to_pure_dict(nnx.jit(nnx.grad(_grad_loss))(unrolled))
    return params, stack_layers(want, GRAD_CONFIG.num_layers)


@pytest.mark.parametrize("policy", ["none", "full", "save_qkv_proj"])
def test_scanned_gradients_equal_unrolled(policy, unrolled_grads):
    """Scanned (under a remat policy: none, everything recomputed, q/k/v kept) and unrolled
    models give the same gradients. (`offload_qkv_proj` needs pinned host memory, which XLA:CPU
    does not have.)"""
    assert policy in REMAT_POLICIES
    config = GRAD_CONFIG
    params, want = unrolled_grads
    scanned_config = config.replace(scan_layers=True, remat_policy=policy)
    graphdef, state = nnx.split(
        nnx.eval_shape(lambda: Transformer(scanned_config, rngs=nnx.Rngs(0)))
    )
    nnx.replace_by_pure_dict(state, stack_layers(params, config.num_layers))
    scanned = nnx.merge(graphdef, state)
    with jax.default_matmul_precision("highest"):
        got = nnx.to_pure_dict(nnx.jit(nnx.grad(_grad_loss))(scanned))
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        # fp32 sums in another order: equal to 1e-5 of each gradient's largest entry
        scale = float(np.abs(np.asarray(w)).max())
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0, atol=1e-5 * scale)


def test_export_of_a_scanned_model_is_the_unrolled_checkpoint(checkpoint, tmp_path):
    path, *_ = checkpoint
    scanned = hf.load_model(path, scan_layers=True)
    hf.save_hf(scanned, str(tmp_path / "out"))
    from jaxrl.models.safetensors_io import SafetensorsReader

    before, after = SafetensorsReader(path), SafetensorsReader(str(tmp_path / "out"))
    assert sorted(before) == sorted(after)
    for name in before:
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)


def test_sharded_scanned_load_equals_unsharded(checkpoint):
    path, tokens, mask, _ = checkpoint
    config = hf.load_config(path, scan_layers=True)
    mesh = make_mesh(MeshConfig(("fsdp", "tp"), (4, 1), num_devices=4))
    abstract = nnx.state(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
    shardings = param_shardings(abstract, mesh, TRAINER_RULES)
    sharded = nnx.to_pure_dict(hf.load_params(path, config, shardings))
    plain = nnx.to_pure_dict(hf.load_params(path, config))
    q = sharded["layers"]["attention"]["q_kernel"]
    assert q.sharding.spec[0] is None and len(q.sharding.device_set) == 4  # layers never split
    for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(plain), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert jax.tree.structure(unstack_layers(plain, config.num_layers)) == jax.tree.structure(
        nnx.to_pure_dict(hf.load_params(path, hf.load_config(path)))
    )


def test_sampler_on_a_scanned_model_gives_the_unrolled_tokens_and_logprobs(checkpoint):
    path, *_ = checkpoint
    outs = []
    for scan in (False, True):
        model = hf.load_model(path, scan_layers=scan)
        sampler, params = Sampler.for_model(model)
        prompts = [[1, 5, 6, 7], [1, 9], [3, 4, 2]]
        outs.append(sampler.generate(params, prompts, SamplingConfig(6), jax.random.key(3)))
    np.testing.assert_array_equal(outs[0].tokens_bn, outs[1].tokens_bn)
    np.testing.assert_allclose(outs[0].logprobs_bn, outs[1].logprobs_bn, atol=2e-6)


def _train_step_size(num_layers: int, scan: bool) -> int:
    """Equations in the jaxpr of a forward + backward pass (nested jaxprs counted too)."""
    config = ModelConfig("llama", 64, 32, 64, num_layers, 4, 2, 8, scan_layers=scan)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
    tokens = jax.ShapeDtypeStruct((2, 8), jnp.int32)

    def loss(state, tokens):
        return jnp.mean(nnx.merge(graphdef, state)(tokens))

    jaxpr = jax.make_jaxpr(jax.grad(loss))(state, tokens)

    def count(j) -> int:
        return sum(
            1
            + sum(
                count(sub.jaxpr if hasattr(sub, "jaxpr") else sub)
                for sub in jax.extend.core.jaxprs_in_params(e.params)
            )
            for e in j.eqns
        )

    return count(jaxpr.jaxpr)


def test_scanned_program_size_is_flat_in_depth():
    """Compile time follows program size: scanned, 32 layers trace to the same program as 4;
    unrolled, the program grows ~8x."""
    scanned = _train_step_size(4, True), _train_step_size(32, True)
    unrolled = _train_step_size(4, False), _train_step_size(32, False)
    assert scanned[1] == scanned[0], scanned
    assert unrolled[1] > 6 * unrolled[0], unrolled


def test_trainer_steps_and_checkpoints_cross_layouts(tmp_path):
    """A scanned Trainer on a 2x2 FSDP x TP mesh (remat `full`) takes the same SFT step as the
    unrolled one; a checkpoint of either layout restores into the other (`restore_params`
    converts on the devices, into the requested shardings)."""
    import optax

    from jaxrl.infra.checkpoint import CheckpointConfig, Checkpointer
    from jaxrl.job import workdir as run_dir
    from jaxrl.train.trainer import Trainer

    config = ModelConfig("llama", 64, 32, 64, 3, 4, 2, 8)
    mesh = make_mesh(MeshConfig(("fsdp", "tp"), (2, 2), num_devices=4))
    rng = np.random.default_rng(0)
    batch = {
        "tokens_bs": rng.integers(0, 64, (4, 10)).astype(np.int32),
        "loss_mask_bs": np.arange(10)[None].repeat(4, 0) >= 4,
    }
    # Adam's eps at 1e-3: at the default 1e-8 a gradient entry near zero turns a 1e-7 difference
    # in summation order between the layouts into a visible difference in its first update.
    adam = optax.adam(1e-2, eps=1e-3)
    unrolled = Trainer(config, mesh, TRAINER_RULES, adam)
    scanned_config = config.replace(scan_layers=True, remat_policy="full")
    scanned = Trainer(scanned_config, mesh, TRAINER_RULES, adam)
    params = unrolled.init_params(0)
    stacked = stack_layers(jax.device_get(params), config.num_layers)
    with jax.default_matmul_precision("highest"):
        after_u, metrics_u = unrolled.sft_step(unrolled.init(params), batch)
        after_s, metrics_s = scanned.sft_step(scanned.init(stacked), batch)
    np.testing.assert_allclose(float(metrics_s["loss"]), float(metrics_u["loss"]), rtol=1e-6)
    want = stack_layers(jax.device_get(after_u.params), config.num_layers)
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(after_s.params), strict=True):
        np.testing.assert_allclose(np.asarray(g), w, rtol=0, atol=1e-5 * np.abs(w).max())

    for layout, trained in (("unrolled", after_u.params), ("scanned", after_s.params)):
        workdir = tmp_path / layout
        with Checkpointer(run_dir.checkpoint_dir(str(workdir)), CheckpointConfig()) as ckpt:
            ckpt.save(1, {run_dir.PARAMS_KEY: trained}, extra={}, force=True)
        host = jax.device_get(trained)
        for target in (config, scanned_config):
            shardings = scanned.param_shardings if target.scan_layers else unrolled.param_shardings
            _, state = run_dir.restore_params(str(workdir), target, shardings=shardings)
            got = nnx.to_pure_dict(state)
            expect = host
            if target.scan_layers != (layout == "scanned"):
                convert = stack_layers if target.scan_layers else unstack_layers
                expect = convert(host, config.num_layers)
            for g, w, s in zip(
                jax.tree.leaves(got), jax.tree.leaves(expect), jax.tree.leaves(shardings),
                strict=True,
            ):  # fmt: skip
                assert g.sharding.is_equivalent_to(s, g.ndim)
                np.testing.assert_array_equal(np.asarray(g), w)


def test_scan_layers_default_follows_depth_and_lora(tmp_path):
    """`PolicySpec.scan_layers = None`: deep models scan, shallow ones and LoRA runs unroll."""
    import transformers

    from jaxrl.job.specs import SCAN_LAYERS_ABOVE, PolicySpec, build_model_config, build_tokenizer

    tokenizer = build_tokenizer(PolicySpec(), None)
    shallow = build_model_config(PolicySpec(), tokenizer)  # the arithmetic preset
    assert shallow.num_layers <= SCAN_LAYERS_ABOVE and not shallow.scan_layers
    deep_dir = tmp_path / "deep"
    transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=12,
        num_attention_heads=4, num_key_value_heads=2,
    ).save_pretrained(deep_dir)  # fmt: skip
    deep = PolicySpec(init_from=str(deep_dir))
    assert build_model_config(deep, tokenizer).scan_layers
    assert not build_model_config(deep, tokenizer, lora=True).scan_layers
    explicit = PolicySpec(init_from=str(deep_dir), scan_layers=False)
    assert not build_model_config(explicit, tokenizer).scan_layers
    assert build_model_config(PolicySpec(scan_layers=True), tokenizer).scan_layers

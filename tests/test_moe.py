"""Mixture-of-experts (Qwen3-MoE) against `transformers`: logits, the load-balancing loss, greedy
generation, export, scanned layers, expert sharding, routing that sends every token to the same
experts, and refusals of bad checkpoints and configs."""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from hf_fixtures import left_padded_batch, reference_logits

from jaxrl.generation.engine import Engine, Request
from jaxrl.generation.sampling import SamplingConfig
from jaxrl.infra import sharding as ax
from jaxrl.infra.mesh import MeshConfig, make_mesh
from jaxrl.models import hf
from jaxrl.models.config import ModelConfig, UnsupportedModelError
from jaxrl.models.moe import MoEMLP
from jaxrl.models.safetensors_io import SafetensorsReader, write_safetensors
from jaxrl.models.transformer import Transformer
from jaxrl.train import steps as train_steps

TINY_MOE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    mlp_only_layers=[1],  # layers 0 and 2 sparse, 1 dense
    max_position_embeddings=64,
    initializer_range=0.2,
    rms_norm_eps=1e-6,
    router_aux_loss_coef=0.01,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
PROMPTS = [[1, 5, 6, 7, 8, 9, 10, 11], [1, 20, 21], [1, 30, 31, 32, 33, 34], [1, 40]]
NEW_TOKENS = 10


def _save(path, seed=0, **overrides):
    config = transformers.Qwen3MoeConfig(**{**TINY_MOE, **overrides})
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(config)
    with torch.no_grad():  # norm scales away from 1 so that they matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    model = model.eval()
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_moe")
    return str(path), _save(path)


def _tol(ref) -> float:
    return 1e-5 * max(1.0, float(np.abs(ref).max()))


def _hf_aux(torch_model, tokens, mask) -> float:
    positions = np.maximum(np.cumsum(mask, axis=-1) - 1, 0)
    with torch.no_grad():
        out = torch_model(
            input_ids=torch.tensor(tokens),
            attention_mask=torch.tensor(mask),
            position_ids=torch.tensor(positions),
            output_router_logits=True,
        )
    return float(out.aux_loss)


def _ours(model, tokens, mask):
    with jax.default_matmul_precision("highest"):
        logits, aux = nnx.jit(lambda m, t, v: m.logits_and_aux_loss(t, v))(
            model, jnp.asarray(tokens), jnp.asarray(mask, bool)
        )
    return np.asarray(logits), float(aux)


def test_config_reads_the_routing(moe_dir):
    path, _ = moe_dir
    c = hf.load_config(path)
    assert (c.model_type, c.num_experts, c.num_experts_per_tok) == ("qwen3_moe", 8, 2)
    assert c.moe_intermediate_size == 32 and c.norm_topk_prob and c.qk_norm
    assert c.moe_layers == (0, 2) and c.router_aux_loss_coef == 0.01
    # Every existing config stays dense.
    dense = ModelConfig("qwen3", 128, 64, 96, 3, 4, 2, 16)
    assert dense.num_experts == 0 and dense.moe_layers == ()
    model = Transformer(c, rngs=nnx.Rngs(0))
    n = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert n == c.num_params()


def test_logits_and_aux_loss_match_transformers(moe_dir):
    path, torch_model = moe_dir
    model = hf.load_model(path)
    tokens, mask = left_padded_batch(128)
    ref = reference_logits(torch_model, tokens, mask)
    logits, aux = _ours(model, tokens, mask)
    diff = float(np.abs(logits - ref)[mask == 1].max())
    ref_aux = _hf_aux(torch_model, tokens, mask)
    print(f"logits max|diff|={diff:.3g} (max|ref|={np.abs(ref).max():.3g}); "
          f"aux ours={aux:.7f} hf={ref_aux:.7f} diff={abs(aux - ref_aux):.3g}")  # fmt: skip
    assert diff <= _tol(ref), diff
    assert abs(aux - ref_aux) <= 1e-5, (aux, ref_aux)
    # The plain forward is the same logits; the aux loss is not trivially k (routing unbalanced).
    # Jitted: run eagerly, each of its ops would compile a program of its own.
    with jax.default_matmul_precision("highest"):
        plain = nnx.jit(lambda m, t, v: m(t, v))(
            model, jnp.asarray(tokens), jnp.asarray(mask, bool)
        )
    plain = np.asarray(plain)
    np.testing.assert_allclose(plain, logits, atol=_tol(ref), rtol=0)
    assert abs(aux - 2.0) > 1e-3


def test_greedy_engine_matches_transformers_generate(moe_dir):
    path, torch_model = moe_dir
    model = hf.load_model(path)
    greedy = SamplingConfig(NEW_TOKENS, greedy=True, ignore_eos=True)
    engine, params = Engine.for_model(model, num_slots=4, steps_per_call=4, max_total_len=32)
    for i, p in enumerate(PROMPTS):
        engine.submit(Request(i, p, 1, greedy, max_new_tokens=NEW_TOKENS))
    with jax.default_matmul_precision("highest"):
        ours = {g.request_id: g for g in engine.run(params, jax.random.key(0))}
    ref = _hf_greedy_no_eos(torch_model)
    for i in range(len(PROMPTS)):
        np.testing.assert_array_equal(ours[i].tokens_gn[0], ref[i], err_msg=f"prompt {i}")


def _hf_greedy_no_eos(torch_model):
    eos = torch_model.generation_config.eos_token_id
    torch_model.generation_config.eos_token_id = None
    try:
        width = max(map(len, PROMPTS))
        ids = np.zeros((len(PROMPTS), width), np.int64)
        attention = np.zeros_like(ids)
        for row, p in enumerate(PROMPTS):
            ids[row, width - len(p) :], attention[row, width - len(p) :] = p, 1
        out = torch_model.generate(
            torch.tensor(ids), attention_mask=torch.tensor(attention),
            max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
        )  # fmt: skip
        return out[:, width:].numpy()
    finally:
        torch_model.generation_config.eos_token_id = eos


def test_export_reloads_in_transformers(moe_dir, tmp_path):
    path, torch_model = moe_dir
    model = hf.load_model(path)
    hf.save_hf(model, str(tmp_path / "out"))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    assert type(reloaded).__name__ == "Qwen3MoeForCausalLM"
    tokens, mask = left_padded_batch(128)
    ref = reference_logits(torch_model, tokens, mask)
    again = reference_logits(reloaded, tokens, mask)
    assert float(np.abs(again - ref).max()) <= 1e-6 * max(1.0, float(np.abs(ref).max()))
    # The exported tensors are bitwise the original ones.
    src, out = SafetensorsReader(path), SafetensorsReader(str(tmp_path / "out"))
    assert sorted(src) == sorted(out)
    for name in src:
        np.testing.assert_array_equal(src[name], out[name], err_msg=name)


def test_scanned_layers_equal_unrolled(tmp_path):
    # Scanned layers stack every layer alike: an all-sparse checkpoint (as Qwen3-MoE releases are).
    torch_model = _save(tmp_path, seed=1, mlp_only_layers=[])
    unrolled = hf.load_model(str(tmp_path))
    scanned = hf.load_model(str(tmp_path), scan_layers=True)
    assert scanned.config.moe_layers == (0, 1, 2)
    tokens, mask = left_padded_batch(128)
    a_logits, a_aux = _ours(unrolled, tokens, mask)
    b_logits, b_aux = _ours(scanned, tokens, mask)
    ref = reference_logits(torch_model, tokens, mask)
    diff = float(np.abs(a_logits - b_logits).max())
    print(f"scanned vs unrolled: max|diff|={diff:.3g}; aux diff={abs(a_aux - b_aux):.3g}")
    assert diff <= _tol(a_logits) and abs(a_aux - b_aux) <= 1e-6
    assert float(np.abs(b_logits - ref)[mask == 1].max()) <= _tol(ref)
    assert abs(b_aux - _hf_aux(torch_model, tokens, mask)) <= 1e-5
    # Mixed dense / sparse layers cannot share one scanned stack: refused with the fix.
    with pytest.raises(UnsupportedModelError, match="scan_layers=False"):
        unrolled.config.replace(mlp_only_layers=(1,), scan_layers=True)


def _loss_and_grads(model, tokens, mask):
    """The library's SFT loss (`train_steps.sft_loss`) plus the weighted load-balancing loss, and
    their gradients."""
    graphdef, params = nnx.split(model)
    batch = {"tokens_bs": jnp.where(mask, tokens, -1), "loss_mask_bs": mask}

    def loss_fn(p):
        nll, _ = train_steps.sft_loss(graphdef, p, batch, None)
        logits, aux = nnx.merge(graphdef, p).logits_and_aux_loss(tokens, mask)
        return nll + model.config.router_aux_loss_coef * aux, (logits, aux)

    (loss, (logits, aux)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    return loss, logits, aux, grads


_jit_loss_and_grads = nnx.jit(_loss_and_grads)  # one compile per mesh for both tests below


def _sharded_vs_one_device(model, tokens, mask, engine=True):
    """The train step's forward and backward on one device and with experts split over fsdp=4
    (each expert's MLP width over tp=2), then the greedy engine with experts over tp=2."""
    tokens = jnp.asarray(np.concatenate([tokens, tokens[:1]]))
    mask = jnp.asarray(np.concatenate([mask, mask[:1]]), bool)
    mesh = make_mesh(MeshConfig(("fsdp", "tp"), (4, 2)))
    graphdef, state = nnx.split(model)
    shardings = ax.param_shardings(state, mesh, ax.TRAINER_RULES)
    # From host copies: putting device arrays onto a sharding compiles a slicing program per
    # leaf shape; the values placed are the same.
    sharded_state = jax.device_put(jax.tree.map(np.asarray, state), shardings)
    experts = sharded_state["layers"][0]["mlp"]["gate_kernel"].get_value()
    assert experts.addressable_shards[0].data.shape == (8 // 4, 64, 32 // 2)  # really split
    with jax.default_matmul_precision("highest"):
        one = _jit_loss_and_grads(model, tokens, mask)
        with ax.sharding_context(mesh, ax.TRAINER_RULES):
            two = _jit_loss_and_grads(nnx.merge(graphdef, sharded_state), tokens, mask)
    # The differences in NumPy (the same float32 arithmetic): eager jnp ops compile a program per
    # leaf shape and sharding.
    one, two = jax.tree.map(np.asarray, one), jax.tree.map(np.asarray, two)
    logit_diff = float(np.abs(one[1] - two[1]).max())
    scale = float(np.abs(one[1]).max())
    grad_diff = max(
        float(np.abs(a - b).max() / max(1.0, float(np.abs(a).max())))
        for a, b in zip(jax.tree.leaves(one[3]), jax.tree.leaves(two[3]), strict=True)
    )
    aux_diff = abs(float(one[2]) - float(two[2]))
    assert logit_diff <= 1e-5 * max(1.0, scale), logit_diff
    assert aux_diff <= 1e-6 and grad_diff <= 1e-5, (aux_diff, grad_diff)
    if not engine:
        return logit_diff, aux_diff, grad_diff
    # The engine with experts over tp=2 (rows over dp=2) decodes what the one-device engine does.
    greedy = SamplingConfig(6, greedy=True, ignore_eos=True)
    gen_mesh = make_mesh(MeshConfig(("dp", "tp"), (2, 2), num_devices=4))
    runs = []
    for kwargs in ({}, {"mesh": gen_mesh, "rules": ax.GENERATOR_RULES}):
        engine, params = Engine.for_model(
            model, num_slots=4, steps_per_call=3, max_total_len=32, **kwargs
        )
        for i, p in enumerate(PROMPTS):
            engine.submit(Request(i, p, 1, greedy, max_new_tokens=6))
        with jax.default_matmul_precision("highest"):
            runs.append({g.request_id: g for g in engine.run(params, jax.random.key(0))})
    lp_diff = 0.0
    for i in range(len(PROMPTS)):
        np.testing.assert_array_equal(runs[0][i].tokens_gn, runs[1][i].tokens_gn)
        lp_diff = max(lp_diff, float(np.abs(runs[0][i].logprobs_gn - runs[1][i].logprobs_gn).max()))
    assert lp_diff <= 1e-5, lp_diff
    return logit_diff, aux_diff, grad_diff, lp_diff


def test_experts_sharded_match_one_device(moe_dir):
    path, _ = moe_dir
    model = hf.load_model(path)
    tokens, mask = left_padded_batch(128)
    diffs = _sharded_vs_one_device(model, tokens, mask)
    names = ("logits", "aux", "grads(rel)", "engine logprobs")
    shown = ", ".join(f"{n} {d:.3g}" for n, d in zip(names, diffs, strict=True))
    print("sharded vs one device:", shown)


def test_every_token_on_the_same_experts_drops_nothing(moe_dir):
    """A zero router: uniform probabilities, top-k ties broken to experts 0 and 1 for every token
    (one group holds every token, six are empty). Nothing is dropped: the layer equals the dense
    sum over the chosen experts, and sharded runs equal the one-device run."""
    path, _ = moe_dir
    model = hf.load_model(path)
    for i in model.config.moe_layers:
        mlp = model.layers[i].mlp
        mlp.router_kernel.set_value(jnp.zeros_like(mlp.router_kernel.get_value()))
    mlp = model.layers[0].mlp
    x = jax.random.normal(jax.random.key(0), (3, 12, 64))
    with jax.default_matmul_precision("highest"):
        ours = np.asarray(mlp(x))
        probs, weights, experts, _ = mlp.route(x.reshape(-1, 64))
    assert (np.asarray(experts) == [0, 1]).all()
    np.testing.assert_allclose(np.asarray(weights), 0.5, rtol=1e-6)
    ref = _dense_experts(mlp, np.asarray(x), [0, 1], [0.5, 0.5])
    assert float(np.abs(ours - ref).max()) <= 1e-5 * max(1.0, float(np.abs(ref).max()))
    tokens, mask = left_padded_batch(128)
    diffs = _sharded_vs_one_device(model, tokens, mask, engine=False)
    names = ("logits", "aux", "grads(rel)")
    shown = ", ".join(f"{n} {d:.3g}" for n, d in zip(names, diffs, strict=True))
    print("same experts, sharded vs one device:", shown)


def _dense_experts(mlp: MoEMLP, x, chosen, weights):
    gate, up, down = (np.asarray(k.get_value(), np.float64) for k in
                      (mlp.gate_kernel, mlp.up_kernel, mlp.down_kernel))  # fmt: skip
    x = x.astype(np.float64)
    out = 0.0
    for e, w in zip(chosen, weights, strict=True):
        g = x @ gate[e]
        out = out + w * ((g / (1 + np.exp(-g))) * (x @ up[e])) @ down[e]
    return out


# --- refusals -------------------------------------------------------------------------------


def _copy_without(src, dst, drop=(), reshape=None):
    shutil.copytree(src, dst)
    os.remove(os.path.join(dst, "model.safetensors"))
    reader = SafetensorsReader(src)
    tensors = {n: np.asarray(reader[n]) for n in reader if n not in drop}
    if reshape:
        name, shape = reshape
        tensors[name] = np.zeros(shape, np.float32)
    write_safetensors(os.path.join(dst, "model.safetensors"), tensors)


def test_missing_expert_tensor_is_refused_before_loading(moe_dir, tmp_path, monkeypatch):
    path, _ = moe_dir
    placed = []
    monkeypatch.setattr(jax, "make_array_from_callback", lambda *a: placed.append(a))
    monkeypatch.setattr(jnp, "asarray", lambda *a, **k: placed.append(a))
    gone = "model.layers.2.mlp.experts.5.up_proj.weight"
    _copy_without(path, tmp_path / "missing", drop=(gone,))
    with pytest.raises(hf.CheckpointMismatchError, match=r"experts\.5\.up_proj.*num_experts"):
        hf.load_params(str(tmp_path / "missing"), hf.load_config(str(tmp_path / "missing")))
    bad = "model.layers.0.mlp.experts.3.down_proj.weight"
    _copy_without(path, tmp_path / "shape", reshape=(bad, (64, 31)))
    with pytest.raises(hf.CheckpointMismatchError, match=r"experts\.3\.down_proj.*\(64, 31\)"):
        hf.load_params(str(tmp_path / "shape"), hf.load_config(str(tmp_path / "shape")))
    assert placed == []  # refused before any tensor was placed


def test_bad_routing_config_is_refused(moe_dir, tmp_path):
    path, _ = moe_dir
    shutil.copytree(path, tmp_path / "k")
    config_path = tmp_path / "k" / "config.json"
    settings = json.loads(config_path.read_text())
    settings["num_experts_per_tok"] = 9
    config_path.write_text(json.dumps(settings))
    with pytest.raises(ValueError, match=r"num_experts_per_tok=9 with num_experts=8.*config\.json"):
        hf.load_config(str(tmp_path / "k"))
    with pytest.raises(UnsupportedModelError, match="qwen3_moe only"):
        ModelConfig("qwen3", 128, 64, 96, 2, 4, 2, 16, num_experts=4, num_experts_per_tok=2,
                    moe_intermediate_size=8)  # fmt: skip


def test_expert_axis_that_does_not_divide_is_refused(moe_dir):
    path, _ = moe_dir
    # 6 experts over fsdp=4 (every other dimension divides: hidden 64, vocab 128).
    config = hf.load_config(path).replace(num_experts=6)
    mesh = make_mesh(MeshConfig(("fsdp", "tp"), (4, 1), num_devices=4))
    abstract = nnx.state(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
    with pytest.raises(ValueError, match=r"'experts', size 6.*4 devices.*6 experts.*divides 6"):
        ax.param_shardings(abstract, mesh, ax.TRAINER_RULES)
    # The checkpoint's 8 experts over tp=3 on the generator mesh: refused the same way.
    config = hf.load_config(path)
    mesh = make_mesh(MeshConfig(("dp", "tp"), (1, 3), num_devices=3))
    abstract = nnx.state(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
    with pytest.raises(ValueError, match=r"does not divide over mesh axes \('tp',\)"):
        ax.param_shardings(abstract, mesh, ax.GENERATOR_RULES)

"""The load-balancing loss in the trainer's steps (mixture-of-experts policies): the SFT and RL
steps add `coef * aux` over the real tokens of the forward pass they already run, report it as
`router_aux_loss` (gradient accumulation included), its gradient reaches the routers, dense
steps report nothing new; `LossConfig.router_aux_loss_coef` from gin; LoRA on an MoE policy is
refused before anything is built."""

from __future__ import annotations

import functools
import time

import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import launch.configs  # noqa: F401  (registers LossConfig in gin)
from jaxrl.infra.config import from_gin, parse_gin
from jaxrl.infra.mesh import MeshConfig, make_mesh
from jaxrl.infra.sharding import TRAINER_RULES
from jaxrl.models.config import ModelConfig
from jaxrl.models.masks import SegmentMask
from jaxrl.models.moe import load_balancing_loss
from jaxrl.models.transformer import Transformer
from jaxrl.rl import Rollout, collate_rollouts
from jaxrl.train import lora as lora_lib
from jaxrl.train.trainer import LossConfig, Trainer

# test_moe.py's tiny Qwen3-MoE (8 experts, top 2), two layers, both sparse (built directly: no
# checkpoint needed).
MOE = ModelConfig(
    "qwen3_moe", 128, 64, 96, 2, 4, 2, 16, num_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=32, max_position_embeddings=64, router_aux_loss_coef=0.01,
)  # fmt: skip
DENSE = ModelConfig("llama", 64, 32, 64, 2, 4, 2, 8, max_position_embeddings=64)
COEF = 0.5
PROMPT_LEN, COMPLETION_LEN = 6, 5


@functools.cache
def _params(config) -> dict:
    """Random params (numpy, read-only: shared by every step), std 0.3: unbalanced routing."""
    make = lambda: nnx.to_pure_dict(nnx.state(Transformer(config, rngs=nnx.Rngs(0), init_std=0.3)))
    return jax.tree.map(np.asarray, jax.jit(make)())


def _sft_batch(vocab):
    rng = np.random.default_rng(1)
    tokens = rng.integers(3, vocab, size=(4, 12)).astype(np.int32)
    loss_mask = np.zeros((4, 12), bool)
    for i, (prompt, answer) in enumerate([(3, 4), (2, 6), (4, 3), (5, 5)]):
        loss_mask[i, prompt : prompt + answer] = True
        tokens[i, prompt + answer :] = -1  # padding: not attended, not in the aux loss
    return {"tokens_bs": tokens, "loss_mask_bs": loss_mask}


def _rl_batch(vocab, batch_size=8, invalid=2):
    rng = np.random.default_rng(0)
    rollouts = []
    for i in range(batch_size - invalid):
        prompt = rng.integers(3, vocab, size=int(rng.integers(1, PROMPT_LEN + 1)))
        length = int(rng.integers(1, COMPLETION_LEN + 1))
        behaviour = rng.normal(-4.0, 1.0, size=length).astype(np.float32)
        completion = rng.integers(3, vocab, size=length)
        rollouts.append(Rollout(prompt, completion, behaviour, 0, float(rng.random()), i // 2))
    return collate_rollouts(
        rollouts, prompt_len=PROMPT_LEN, completion_len=COMPLETION_LEN, pad_id=0,
        batch_size=batch_size,
    )  # fmt: skip


def _step(config, kind, batch, coef, accum=1):
    """(metrics, gradient): one step from `_params(config)` under SGD of rate 1."""
    mesh = make_mesh(MeshConfig(("fsdp", "tp"), (1, 1), num_devices=1))
    loss = LossConfig(router_aux_loss_coef=coef)
    trainer = Trainer(config, mesh, TRAINER_RULES, optax.sgd(1.0), grad_accum_steps=accum,
                      loss=loss)  # fmt: skip
    params = _params(config)
    with jax.default_matmul_precision("highest"):
        state = trainer.init(params)
        step = trainer.rl_step if kind == "rl" else trainer.sft_step
        state, metrics = step(state, batch)
    grad = jax.tree.map(lambda p, q: p - np.asarray(q), params, state.params)
    return jax.device_get(metrics), grad


def _aux_loss(params, tokens, positions, attended, valid):
    model = nnx.merge(_GRAPHDEF, params)
    mask = SegmentMask.from_valid(attended)
    _, _, info = model.hidden_states(tokens, positions, mask, router_stats=True)
    stats = info.stats
    return load_balancing_loss(stats, valid)


_GRAPHDEF = nnx.graphdef(nnx.eval_shape(lambda: Transformer(MOE, rngs=nnx.Rngs(0))))
_aux_value_and_grad = jax.jit(jax.value_and_grad(_aux_loss))  # one compile per batch shape


def _direct_aux(tokens, positions, attended, valid):
    """The load-balancing loss straight from the model (`hidden_states(router_stats=True)`), and
    its gradient wrt every param."""
    with jax.default_matmul_precision("highest"):
        value, grads = _aux_value_and_grad(
            _params(MOE), *(jnp.asarray(x) for x in (tokens, positions, attended, valid))
        )
    return float(value), grads


def _router_grads(grad):
    return [np.asarray(grad["layers"][i]["mlp"]["router_kernel"]) for i in MOE.moe_layers]


def _check(kind, with_c, without, aux, aux_grads):
    (m_c, g_c), (m_0, g_0) = with_c, without
    loss_diff = float(m_c["loss"]) - float(m_0["loss"])
    err = abs(loss_diff - COEF * aux)
    # The aux term's gradient alone: SGD(1) steps with coef c minus coef 0, on each router.
    routers = [a - b for a, b in zip(_router_grads(g_c), _router_grads(g_0), strict=True)]
    norms = [float(np.linalg.norm(r)) for r in routers]
    want = [COEF * np.asarray(aux_grads["layers"][i]["mlp"]["router_kernel"])
            for i in MOE.moe_layers]  # fmt: skip
    grad_err = max(float(np.abs(r - w).max()) for r, w in zip(routers, want, strict=True))
    shown = ", ".join(f"{n:.3e}" for n in norms)
    print(f"{kind}: loss(c={COEF}) - loss(0) = {loss_diff:.7f}, c * aux = {COEF * aux:.7f} "
          f"(|diff| {err:.2e}); router_aux_loss {float(m_c['router_aux_loss']):.7f} "
          f"(coef 0: {float(m_0['router_aux_loss']):.7f}); |router grad from aux| per sparse "
          f"layer [{shown}], max|diff| to c * d aux {grad_err:.2e}")  # fmt: skip
    assert err <= 1e-5, (loss_diff, COEF * aux)
    for m in (m_c, m_0):
        assert abs(float(m["router_aux_loss"]) - aux) <= 1e-5
    assert abs(aux - 2.0) > 1e-3  # routing unbalanced: not the trivial value k
    assert min(norms) > 1e-4 and grad_err <= 1e-5 * max(1.0, max(norms))


def test_sft_step_adds_the_load_balancing_loss():
    t0 = time.time()
    batch = _sft_batch(MOE.vocab_size)
    tokens = jnp.asarray(batch["tokens_bs"])
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    valid = batch["tokens_bs"] != -1
    aux, aux_grads = _direct_aux(tokens, positions, valid, valid)
    with_c, without = (_step(MOE, "sft", batch, c) for c in (COEF, 0.0))
    _check("sft", with_c, without, aux, aux_grads)
    print(f"sft: {time.time() - t0:.1f} s")


def test_rl_step_adds_the_load_balancing_loss_per_micro_batch():
    """Two micro-batches: the aux loss of each (its own valid tokens), weighted as the main
    loss's micro-batches are (their completion tokens, AIPO's token normaliser)."""
    t0 = time.time()
    batch = _rl_batch(MOE.vocab_size)
    tokens, attended, positions = batch.sequence()
    valid = np.asarray(attended) & np.asarray(batch.valid_b)[:, None]
    half = batch.batch_size // 2
    auxes, grads = zip(*(_direct_aux(tokens[s], positions[s], attended[s], valid[s])
                         for s in (slice(0, half), slice(half, None))), strict=True)  # fmt: skip
    counts = np.asarray(batch.completion_mask_bt & batch.valid_b[:, None]).reshape(2, -1).sum(1)
    w = counts / counts.sum()
    aux = float(w[0] * auxes[0] + w[1] * auxes[1])
    aux_grads = jax.tree.map(lambda a, b: w[0] * a + w[1] * b, *grads)
    print(f"rl: micro-batch aux losses {auxes[0]:.6f}, {auxes[1]:.6f}, weights {w}")
    with_c, without = (_step(MOE, "rl", batch, c, accum=2) for c in (COEF, 0.0))
    _check("rl", with_c, without, aux, aux_grads)
    print(f"rl: {time.time() - t0:.1f} s")


def test_dense_steps_report_no_router_metric():
    """The dense steps' metrics (traced, not compiled): no `router_aux_loss`."""
    mesh = make_mesh(MeshConfig(("fsdp", "tp"), (1, 1), num_devices=1))
    loss = LossConfig(router_aux_loss_coef=COEF)
    trainer = Trainer(DENSE, mesh, TRAINER_RULES, optax.sgd(1.0), loss=loss)
    state = trainer.abstract_state()
    with trainer._context():
        _, sft = jax.eval_shape(trainer._sft, state, _sft_batch(DENSE.vocab_size), None)
        _, rl = jax.eval_shape(trainer._rl, state, _rl_batch(DENSE.vocab_size), None, None)
    assert "loss" in sft and "loss" in rl
    assert "router_aux_loss" not in sft and "router_aux_loss" not in rl
    assert loss.router_aux_coef(DENSE) == 0.0


def test_coef_defaults_to_the_model_config_and_binds_in_gin():
    assert LossConfig().router_aux_coef(MOE) == MOE.router_aux_loss_coef == 0.01
    assert LossConfig(router_aux_loss_coef=0.0).router_aux_coef(MOE) == 0.0
    with pytest.raises(ValueError, match="router_aux_loss_coef=-1.0 must be >= 0"):
        LossConfig(router_aux_loss_coef=-1.0).validate()
    try:
        parse_gin([], ["LossConfig.router_aux_loss_coef = 0.002"])
        assert from_gin(LossConfig).router_aux_loss_coef == 0.002
    finally:
        gin.clear_config()


def test_lora_on_moe_refused_before_anything_is_built(monkeypatch):
    built = []
    monkeypatch.setattr(lora_lib, "Transformer", lambda *a, **k: built.append(a))
    for lora in (lora_lib.LoraConfig(), lora_lib.LoraConfig(target_modules=r"layers/0/mlp")):
        with pytest.raises(ValueError, match=r"not supported yet.*sparse MLPs of layers \[0"):
            lora_lib.lora_model(MOE, lora)
    with pytest.raises(ValueError, match=r"TraceContextError.*layers/\\d\+/attention.*full model"):
        Trainer(MOE, make_mesh(MeshConfig(("fsdp", "tp"), (1, 1), num_devices=1)), TRAINER_RULES,
                optax.sgd(1.0), lora=lora_lib.LoraConfig())  # fmt: skip
    assert built == []
    monkeypatch.undo()
    # Attention adapters (and a dense layer's MLP: layer 1 of a mixed model) build on MoE models.
    mixed = MOE.replace(mlp_only_layers=(1,))
    ok = lora_lib.LoraConfig(target_modules=r"layers/(\d+/attention|1/mlp)")
    names = lora_lib.adapter_names(nnx.to_pure_dict(lora_lib.abstract_lora(mixed, ok)[1]))
    assert "layers/1/mlp/gate_kernel" in names and "layers/0/attention/q_kernel" in names
    with pytest.raises(ValueError, match=r"sparse MLPs of layers \[0\]"):
        lora_lib.abstract_lora(mixed, lora_lib.LoraConfig())

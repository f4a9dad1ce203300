"""The KL term through the trainer: `Trainer.rl_step` with `kl_coef > 0` and a frozen reference
policy (its own params), on a 2 x 2 trainer mesh, against a NumPy computation of the loss from the
two policies' logits. The gradient is read off an SGD step of rate 1 (new params = params - grad)
and checked against central differences of the NumPy loss, along the gradient and along a random
direction. The NumPy side shares only the model's forward pass (`Transformer.__call__`, checked
against `transformers` in test_models_parity.py) with the trainer: sequence layout, positions,
log-softmax, advantages, AIPO weights, KL estimator and normaliser are written out here."""

from __future__ import annotations

import functools

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from jaxrl.infra.mesh import MeshConfig, make_mesh
from jaxrl.infra.sharding import TRAINER_RULES
from jaxrl.models.config import ModelConfig
from jaxrl.models.transformer import Transformer
from jaxrl.rl import Rollout, collate_rollouts
from jaxrl.train.trainer import LossConfig, Trainer

CONFIG = ModelConfig("llama", 32, 32, 64, 2, 4, 2, 8, max_position_embeddings=64)
PROMPT_LEN, COMPLETION_LEN, RHO, KL_COEF = 6, 5, 2.0, 0.05


@functools.cache
def _params(seed: int) -> dict:
    """Random float32 params (NumPy): N(0, 0.3^2) weights, norm scales 1 + N(0, 0.1^2)."""
    rng = np.random.default_rng(seed)
    abstract = nnx.to_pure_dict(nnx.state(nnx.eval_shape(_model)))

    def draw(path, leaf):
        if "norm" in jax.tree_util.keystr(path):
            return (1 + 0.1 * rng.standard_normal(leaf.shape)).astype(np.float32)
        return (0.3 * rng.standard_normal(leaf.shape)).astype(np.float32)

    return jax.tree_util.tree_map_with_path(draw, abstract)


@functools.cache
def _reference() -> dict:
    """The frozen reference: the policy's params moved by N(0, 0.1^2) (as after some training)."""
    rng = np.random.default_rng(1)
    return jax.tree.map(
        lambda p: (p + 0.1 * rng.standard_normal(p.shape)).astype(np.float32), _params(0)
    )


def _model():
    return Transformer(CONFIG, rngs=nnx.Rngs(0))


@functools.cache
def _forward():
    graphdef = nnx.split(nnx.eval_shape(_model))[0]
    return jax.jit(lambda params, tokens, valid: nnx.merge(graphdef, params)(tokens, valid))


def _logprobs_np(params: dict, batch) -> np.ndarray:
    """float64 log pi(completion token t) `[B, T]` under `params` at temperature 1 (0 on padding),
    from the logits of the [prompt | completion] sequence."""
    tokens = np.concatenate([batch.prompt_ids_bp, batch.completion_ids_bt], axis=1)
    valid = np.concatenate([batch.prompt_mask_bp, batch.completion_mask_bt], axis=1)
    with jax.default_matmul_precision("highest"):
        logits = np.asarray(_forward()(params, tokens, valid), np.float64)
    logits = logits[:, PROMPT_LEN - 1 : PROMPT_LEN - 1 + COMPLETION_LEN]  # predicting each token
    shifted = logits - logits.max(-1, keepdims=True)
    logp_btv = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    picked = np.take_along_axis(logp_btv, batch.completion_ids_bt[..., None], axis=-1)[..., 0]
    return np.where(batch.completion_mask_bt, picked, 0.0)


def _loss_np(params, batch, ref_logprobs, weights_bt, kl_coef) -> tuple[float, float]:
    """(loss, kl): token mean of -w A log pi + kl_coef * k3, with the AIPO weights `weights_bt`
    held fixed (the loss stops their gradient), k3 = exp(log ref - log pi) - 1 - (log ref - log pi),
    A = reward minus its group's mean."""
    logpi = _logprobs_np(params, batch)
    mask = batch.completion_mask_bt
    rewards, groups = batch.reward_b.astype(np.float64), batch.group_id_b
    advantages = np.array(
        [r - rewards[groups == g].mean() for r, g in zip(rewards, groups, strict=True)]
    )
    log_r = ref_logprobs - logpi
    kl = np.where(mask, np.exp(log_r) - 1 - log_r, 0.0)
    per_token = -weights_bt * advantages[:, None] * logpi + kl_coef * kl
    count = mask.sum()
    return float(np.where(mask, per_token, 0.0).sum() / count), float(kl.sum() / count)


@pytest.fixture(scope="module")
def batch():
    return _batch()


def _batch():
    """4 prompts x 2 samples of varied lengths; behaviour log-probs put the AIPO ratio on both
    sides of rho."""
    rng = np.random.default_rng(0)
    rollouts = []
    for i in range(8):
        prompt = rng.integers(3, CONFIG.vocab_size, size=int(rng.integers(2, PROMPT_LEN + 1)))
        length = int(rng.integers(1, COMPLETION_LEN + 1))
        completion = rng.integers(3, CONFIG.vocab_size, size=length)
        rollouts.append(
            Rollout(prompt, completion, np.zeros(length, np.float32), 0, float(i % 3), i // 2)
        )
    batch = collate_rollouts(
        rollouts, prompt_len=PROMPT_LEN, completion_len=COMPLETION_LEN, pad_id=0
    )
    logpi = _logprobs_np(_params(0), batch)
    log_ratio = rng.choice([-1.5, -0.3, 0.2, 1.2], size=logpi.shape)  # ratios 0.22 .. 3.3
    behaviour = np.where(batch.completion_mask_bt, logpi - log_ratio, 0.0).astype(np.float32)
    return batch.replace(behaviour_logprobs_bt=behaviour)


def _sgd_step(batch, kl_coef: float):
    """(metrics, gradient) of one trainer RL step from `_params(0)` with the reference
    `_reference()` (the gradient is read off an SGD step of rate 1: params - new params)."""
    loss = LossConfig(rho=RHO, kl_coef=kl_coef, kl_estimator="k3")
    mesh = make_mesh(MeshConfig(("fsdp", "tp"), (2, 2)))
    trainer = Trainer(CONFIG, mesh, TRAINER_RULES, optax.sgd(1.0), loss=loss)
    params = _params(0)
    ref = jax.device_put(_reference(), trainer.param_shardings) if kl_coef else None
    with jax.default_matmul_precision("highest"):
        state, metrics = trainer.rl_step(trainer.init(params), batch, ref)
    grad = jax.tree.map(
        lambda p, q: np.asarray(p, np.float64) - np.asarray(q), params, state.params
    )
    return jax.device_get(metrics), grad


def test_kl_term_through_the_trainer_matches_numpy(batch):
    metrics, grad = _sgd_step(batch, KL_COEF)
    params, ref_params = _params(0), _reference()
    logpi, ref_logprobs = _logprobs_np(params, batch), _logprobs_np(ref_params, batch)
    ratio = np.exp(logpi - batch.behaviour_logprobs_bt)
    mask = batch.completion_mask_bt
    assert (ratio[mask] > RHO).any() and (ratio[mask] < 1).any()  # both AIPO regimes
    weights = np.minimum(ratio, RHO)
    want_loss, want_kl = _loss_np(params, batch, ref_logprobs, weights, KL_COEF)
    print(f"loss {float(metrics['loss']):.7g} vs {want_loss:.7g}, kl {float(metrics['kl']):.7g}")
    assert want_kl > 0.01  # the reference differs from the policy: the term is not trivially 0
    np.testing.assert_allclose(float(metrics["kl"]), want_kl, rtol=2e-5)
    np.testing.assert_allclose(float(metrics["loss"]), want_loss, rtol=2e-5)

    # The gradient: central differences of the NumPy loss along the trainer's gradient and along
    # a random direction. Along both, the KL term's share and the policy term's share are each
    # far above the tolerance, so either gradient lost or scaled wrongly would fail the check.
    loss_np = lambda p: _loss_np(p, batch, ref_logprobs, weights, KL_COEF)[0]  # noqa: E731
    kl_np = lambda p: KL_COEF * _loss_np(p, batch, ref_logprobs, weights, KL_COEF)[1]  # noqa: E731
    rng = np.random.default_rng(1)
    random = jax.tree.map(lambda g: rng.standard_normal(g.shape), grad)
    for label, direction in (("its gradient", grad), ("a random direction", random)):
        unit = _scaled(direction, 1 / _norm(direction))
        numeric, analytic = _derivative(loss_np, params, unit), _dot(grad, unit)
        kl_share = _derivative(kl_np, params, unit)
        print(
            f"d loss along {label}: trainer {analytic:.6g}, NumPy {numeric:.6g} "
            f"(KL term {kl_share:.3g}, policy term {numeric - kl_share:.3g})"
        )
        tolerance = 1e-3 * abs(numeric) + 1e-4 * _norm(grad)
        assert abs(analytic - numeric) <= tolerance, (label, analytic, numeric)
        assert min(abs(kl_share), abs(numeric - kl_share)) > 10 * tolerance, label


def _derivative(fn, params, unit, eps=1e-3) -> float:
    """Central difference of `fn` at `params` along the unit direction `unit`."""
    at = lambda e: jax.tree.map(lambda p, d: (p + e * d).astype(np.float32), params, unit)  # noqa: E731
    return (fn(at(eps)) - fn(at(-eps))) / (2 * eps)


def _dot(a, b) -> float:
    return float(
        sum(np.sum(x * y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))
    )


def _norm(tree) -> float:
    return _dot(tree, tree) ** 0.5


def _scaled(tree, factor: float):
    return jax.tree.map(lambda x: x * factor, tree)

"""Routing replay (mixture-of-experts policies): the engine records each position's experts per
layer beside its KV cache, and a forward that replays them computes the engine's log-probs
even when the generator's routers choose differently from the trainer's.

The disagreement is made on purpose, as a drift between the generator's and the trainer's
numerics would make it: while the engine's programs are traced, each router selects its top k
from its probabilities plus a fixed per-expert offset (`_skewed_route`), the gate weights still
the probabilities of the chosen experts. The weights are the same on both sides, so with replay
the trainer runs exactly the engine's computation; without it, it routes by its own top k.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.generation.engine import Engine, Request
from jaxrl.generation.sampling import SamplingConfig
from jaxrl.models import moe
from jaxrl.models.config import ModelConfig
from jaxrl.models.masks import SegmentMask
from jaxrl.models.transformer import Transformer

MOE = ModelConfig(
    "qwen3_moe", 128, 64, 96, 2, 4, 2, 16, num_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=32, max_position_embeddings=64, norm_topk_prob=True,
)  # fmt: skip
SAMPLING = SamplingConfig(temperature=1.0, max_new_tokens=8, ignore_eos=True)
PROMPTS = ((5, 9, 17, 33, 2), (7, 7, 80, 12, 40, 41, 3, 90), (100, 4))
SKEW = jnp.asarray(np.random.default_rng(3).normal(0.0, 0.15, MOE.num_experts), jnp.float32)


def _skewed_route(self, x_ne, replay_nk=None):
    """`MoEMLP.route` choosing its top k from `probs + SKEW` (gates: the probabilities)."""
    c = self.config
    logits = jnp.dot(x_ne, self.router_kernel[...].astype(c.jnp_dtype))
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    _, own = jax.lax.top_k(probs + SKEW, c.num_experts_per_tok)
    weights = jnp.take_along_axis(probs, own, axis=-1)
    if c.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return probs, weights.astype(c.jnp_dtype), own, own


@functools.cache
def _model(scan_layers: bool):
    config = MOE.replace(scan_layers=scan_layers)
    return Transformer(config, rngs=nnx.Rngs(0), init_std=0.3)


def _sample(model, skewed: bool, monkeypatch, **engine_kwargs):
    """The engine's groups (2 samples per prompt) by request id; `skewed`: its routers are."""
    with monkeypatch.context() as patch:
        if skewed:
            patch.setattr(moe.MoEMLP, "route", _skewed_route)
        engine, params = Engine.for_model(model, max_total_len=32, **engine_kwargs)
        for i, prompt in enumerate(PROMPTS):
            engine.submit(Request(i, prompt, 2, SAMPLING))
        return {g.request_id: g for g in engine.run(params, jax.random.key(1))}


def _teacher_forced(model, group, row, replay: bool):
    """`(log-probs of the row's completion, the model's own top-k [P + T, L, k])` from one
    whole-sequence forward, replaying the row's record when `replay`."""
    tokens = np.concatenate([group.prompt, group.tokens_gn[row, : group.lengths_g[row]]])
    record = group.routing_g[row]
    valid = np.ones((1, len(tokens)), bool)
    hidden, _, info = model.hidden_states(
        jnp.asarray(tokens)[None],
        jnp.arange(len(tokens))[None],
        SegmentMask.from_valid(valid),
        routing=jnp.asarray(record)[None] if replay else None,
        record_routing=True,
    )
    logprobs = jax.nn.log_softmax(model.logits(hidden)[0], axis=-1)
    p = len(group.prompt)
    completion = tokens[p:]
    picked = logprobs[p - 1 : len(tokens) - 1][np.arange(len(completion)), completion]
    return np.asarray(picked), np.asarray(info.experts[0])


@pytest.mark.parametrize("scan_layers", [False, True])
def test_engine_records_the_routing_it_ran(scan_layers, monkeypatch):
    """Every position the engine ran has the experts a whole-sequence forward chooses there, in
    both layer layouts, through shared prefills, slot moves and several decode calls; the last
    token (never run) is -1. A dense model's engine keeps no record."""
    model = _model(scan_layers)
    groups = _sample(model, False, monkeypatch, num_slots=4, steps_per_call=3)
    compared = 0
    for group in groups.values():
        assert group.routing_g is not None and len(group.routing_g) == 2
        for row in range(2):
            record = group.routing_g[row]
            total = len(group.prompt) + int(group.lengths_g[row])
            assert record.shape == (total, MOE.num_layers, 2) and record.dtype == np.int16
            assert (record[-1] == -1).all() and (record[:-1] >= 0).all()
            _, own = _teacher_forced(model, group, row, replay=False)
            np.testing.assert_array_equal(np.sort(record[:-1], -1), np.sort(own[:-1], -1))
            compared += total - 1
    assert compared > 60
    dense = Transformer(ModelConfig("llama", 64, 32, 64, 2, 4, 2, 8), rngs=nnx.Rngs(0))
    engine, params = Engine.for_model(dense, num_slots=2, max_total_len=16)
    engine.submit(Request(0, (3, 4), 1, SAMPLING))
    (result,) = engine.run(params, jax.random.key(0))
    assert result.routing_g is None and engine.programs.record is False


def test_replay_reproduces_the_engine_logprobs_where_routing_disagrees(monkeypatch):
    """With the generator's routers skewed, replaying the record gives the engine's behaviour
    log-probs (max error ~1e-6); the trainer's own routing (no replay) disagrees on a share of
    the (token, layer) choices and its log-probs miss by far more (the negative control)."""
    model = _model(False)
    groups = _sample(model, True, monkeypatch, num_slots=8, steps_per_call=4)
    replay_err, own_err, disagree, total = 0.0, 0.0, 0, 0
    for group in groups.values():
        for row in range(2):
            n = int(group.lengths_g[row])
            behaviour = group.logprobs_gn[row, :n]
            with_replay, own = _teacher_forced(model, group, row, replay=True)
            without, _ = _teacher_forced(model, group, row, replay=False)
            replay_err = max(replay_err, float(np.abs(with_replay - behaviour).max()))
            own_err = max(own_err, float(np.abs(without - behaviour).max()))
            record = group.routing_g[row][:-1]
            same = (np.sort(record, -1) == np.sort(own[:-1], -1)).all(-1)
            disagree, total = disagree + int((~same).sum()), total + same.size
    assert replay_err < 2e-5, replay_err
    assert disagree / total > 0.05, (disagree, total)
    assert own_err > 100 * max(replay_err, 1e-6), (own_err, replay_err)

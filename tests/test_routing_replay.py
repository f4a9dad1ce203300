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

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxrl.generation.engine import Engine, Request
from jaxrl.generation.sampling import SamplingConfig
from jaxrl.infra.mesh import MeshConfig, make_mesh
from jaxrl.infra.sharding import TRAINER_RULES
from jaxrl.models import moe
from jaxrl.models.config import ModelConfig
from jaxrl.models.masks import SegmentMask
from jaxrl.models.transformer import Transformer
from jaxrl.rl import Rollout, collate_rollouts
from jaxrl.rl.packing import PackedRolloutBatch, pack_rollout_batch
from jaxrl.train.lora import LoraConfig
from jaxrl.train.steps import LossConfig, _completion_forward
from jaxrl.train.trainer import Trainer

MOE = ModelConfig(
    "qwen3_moe", 128, 64, 96, 2, 4, 2, 16, num_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=32, max_position_embeddings=64, norm_topk_prob=True,
)  # fmt: skip
SAMPLING = SamplingConfig(temperature=1.0, max_new_tokens=8, ignore_eos=True)
PROMPTS = ((5, 9, 17, 33, 2), (7, 7, 80, 12, 40, 41, 3, 90), (100, 4))
SKEW = jnp.asarray(np.random.default_rng(3).normal(0.0, 0.04, MOE.num_experts), jnp.float32)


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


WIDTH = 16  # prompt + completion of every row, right-padded


@functools.partial(jax.jit, static_argnames=("graphdef", "replay"))
def _forward(graphdef, params, tokens, valid, record, *, replay: bool):
    model = nnx.merge(graphdef, params)
    hidden, _, info = model.hidden_states(
        tokens,
        jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape),
        SegmentMask.from_valid(valid),
        routing=record if replay else None,
        record_routing=True,
    )
    return jax.nn.log_softmax(model.logits(hidden), axis=-1), info.experts


def _teacher_forced(model, groups, replay: bool):
    """Per row of every group (request-major): `(log-probs of its completion, the model's own
    top-k [P + T, L, k])` from one whole-sequence forward of all rows, each replaying its own
    record when `replay`."""
    rows = [(g, r) for g in groups.values() for r in range(2)]
    tokens = np.zeros((len(rows), WIDTH), np.int32)
    record = np.full((len(rows), WIDTH, MOE.num_layers, 2), -1, np.int16)
    lengths = []
    for i, (g, r) in enumerate(rows):
        seq = np.concatenate([g.prompt, g.tokens_gn[r, : g.lengths_g[r]]])
        tokens[i, : len(seq)], record[i, : len(seq)] = seq, g.routing_g[r]
        lengths.append((len(g.prompt), len(seq)))
    graphdef, params = nnx.split(model)
    valid = np.arange(WIDTH)[None, :] < np.array([n for _, n in lengths])[:, None]
    logprobs, own = _forward(graphdef, params, tokens, valid, record, replay=replay)
    logprobs, own = np.asarray(logprobs), np.asarray(own)
    out = []
    for i, (p, n) in enumerate(lengths):
        picked = logprobs[i, p - 1 : n - 1][np.arange(n - p), tokens[i, p:n]]
        out.append((picked, own[i, :n]))
    return out


@pytest.mark.parametrize("scan_layers", [False, True])
def test_engine_records_the_routing_it_ran(scan_layers, monkeypatch):
    """Every position the engine ran has the experts a whole-sequence forward chooses there, in
    both layer layouts, through shared prefills, slot moves and several decode calls; the last
    token (never run) is -1. A dense model's engine keeps no record."""
    model = _model(scan_layers)
    groups = _sample(model, False, monkeypatch, num_slots=4, steps_per_call=3)
    compared = 0
    forced = iter(_teacher_forced(model, groups, replay=False))
    for group in groups.values():
        assert group.routing_g is not None and len(group.routing_g) == 2
        for row in range(2):
            record = group.routing_g[row]
            total = len(group.prompt) + int(group.lengths_g[row])
            assert record.shape == (total, MOE.num_layers, 2) and record.dtype == np.int16
            assert (record[-1] == -1).all() and (record[:-1] >= 0).all()
            _, own = next(forced)
            np.testing.assert_array_equal(np.sort(record[:-1], -1), np.sort(own[:-1], -1))
            compared += total - 1
    assert compared > 60
    if scan_layers:
        return
    dense = Transformer(ModelConfig("llama", 64, 32, 64, 2, 4, 2, 8), rngs=nnx.Rngs(0))
    engine, params = Engine.for_model(dense, num_slots=2, max_total_len=16)
    engine.submit(Request(0, (3, 4), 1, SAMPLING))
    (result,) = engine.run(params, jax.random.key(0))
    assert result.routing_g is None and engine.programs.record is False


def test_replay_reproduces_the_engine_logprobs_where_routing_disagrees():
    """With the generator's routers skewed, replaying the record gives the engine's behaviour
    log-probs (max error ~1e-6); the trainer's own routing (no replay) disagrees on a share of
    the (token, layer) choices and its log-probs miss by far more (the negative control)."""
    model = _model(False)
    groups = _skewed_groups()
    replay_err, own_err, disagree, total = 0.0, 0.0, 0, 0
    replayed = iter(_teacher_forced(model, groups, replay=True))
    routed = iter(_teacher_forced(model, groups, replay=False))
    for group in groups.values():
        for row in range(2):
            n = int(group.lengths_g[row])
            behaviour = group.logprobs_gn[row, :n]
            with_replay, own = next(replayed)
            without, _ = next(routed)
            replay_err = max(replay_err, float(np.abs(with_replay - behaviour).max()))
            own_err = max(own_err, float(np.abs(without - behaviour).max()))
            record = group.routing_g[row][:-1]
            same = (np.sort(record, -1) == np.sort(own[:-1], -1)).all(-1)
            disagree, total = disagree + int((~same).sum()), total + same.size
    print(f"replay {replay_err:.2e}, own {own_err:.2e}, disagreeing {disagree}/{total}")
    assert replay_err < 2e-5, replay_err
    assert disagree / total > 0.05, (disagree, total)
    assert own_err > 100 * max(replay_err, 1e-6), (own_err, replay_err)


@functools.cache
def _skewed_groups():
    """The skewed engine's groups (one run shared by the trainer-side tests)."""
    with pytest.MonkeyPatch.context() as patch:
        return _sample(_model(False), True, patch, num_slots=8, steps_per_call=4)


def _rollouts(groups):
    return [
        Rollout(
            prompt_ids=np.asarray(g.prompt, np.int32),
            completion_ids=g.tokens_gn[row, : g.lengths_g[row]],
            behaviour_logprobs=g.logprobs_gn[row, : g.lengths_g[row]],
            policy_version=0,
            reward=float(row),
            group_id=g.request_id,
            routing=g.routing_g[row],
        )
        for g in groups.values()
        for row in range(2)
    ]


@pytest.mark.parametrize("packed", [False, True])
def test_trainer_forward_replays_the_rollouts_record(packed):
    """Through the trainer's batch (padded, or packed with shared prompts): with
    `LossConfig.routing_replay` the forward's log-probs are the engine's behaviour log-probs
    (so AIPO's ratios are 1 at the behaviour version) and without it they are not; both report
    a `routing/mismatch_fraction` (the share of recorded (token, layer) choices the trainer's
    router makes differently; with replay its later layers see the engine's inputs, so the
    two differ), and replay without a record is refused."""
    model = _model(False)
    batch = collate_rollouts(
        _rollouts(_skewed_groups()), prompt_len=8, completion_len=8, pad_id=0, batch_size=8
    )
    if packed:
        batch = pack_rollout_batch(batch, row_length=32, groups=1, share_prompts=True)
    mask = np.asarray(batch.completion_mask_bt & batch.valid_b[:, None])
    behaviour = np.asarray(batch.behaviour_logprobs_bt)
    errors, fractions = {}, {}
    for replay in (True, False):
        loss = LossConfig(routing_replay=replay)
        # Jitted, as the trainer's step runs it: op by op, it compiled ~50 eager programs.
        forward = nnx.jit(lambda m, b, loss=loss: _completion_forward(m, b, loss, False, 1))
        logprobs, _, _, metrics = forward(model, batch)
        errors[replay] = float(np.abs(np.where(mask, np.asarray(logprobs) - behaviour, 0)).max())
        fractions[replay] = float(metrics["routing/mismatch_fraction"])
    assert errors[True] < 2e-5 and errors[False] > 100 * max(errors[True], 1e-6), errors
    assert min(fractions.values()) > 0.05, fractions
    print(f"max |log-prob error| {errors}, mismatch fraction {fractions}")
    plain = dataclasses.replace(batch, **{_routing_field(batch): None})
    with pytest.raises(ValueError, match="carry no routing record"):
        _completion_forward(model, plain, LossConfig(routing_replay=True), False, 1)


def _routing_field(batch) -> str:
    return "routing_rllk" if isinstance(batch, PackedRolloutBatch) else "routing_bslk"


def test_replay_refused_where_no_record_can_come():
    """Routing replay on a dense policy, a static sampler or multi-turn episodes: refused with
    the fix before anything runs."""
    replay = LossConfig(routing_replay=True)
    dense = ModelConfig("llama", 64, 32, 64, 2, 4, 2, 8)
    for config, kind, episodes, what in [
        (dense, "engine", False, "the policy is dense"),
        (MOE, "static", False, "GeneratorConfig.kind = 'engine'"),
        (MOE, "engine", True, "multi-turn episodes"),
    ]:
        with pytest.raises(ValueError, match=what):
            replay.check_replay(config, kind, episodes=episodes)
    replay.check_replay(MOE, "engine", episodes=False)
    LossConfig().check_replay(dense, "static", episodes=True)


def test_lora_trainer_step_replays_the_record():
    """A LoRA trainer (attention adapters on the mixture-of-experts policy; experts cannot take
    adapters) replays the record in its jitted RL step: at the adapters' start (B = 0, the
    base's log-probs) AIPO's log-ratios against the skewed engine's behaviour log-probs are ~0
    while the trainer's routers disagree with the record on a share of the choices."""
    model = _model(False)
    params = nnx.to_pure_dict(nnx.state(model))
    mesh = make_mesh(MeshConfig(("fsdp", "tp"), (1, 1), num_devices=1))
    lora = LoraConfig(target_modules=r"layers/\d+/attention")
    trainer = Trainer(MOE, mesh, TRAINER_RULES, optax.sgd(0.0), lora=lora,
                      loss=LossConfig(routing_replay=True))  # fmt: skip
    batch = collate_rollouts(
        _rollouts(_skewed_groups()), prompt_len=8, completion_len=8, pad_id=0, batch_size=8
    )
    _, metrics = trainer.rl_step(trainer.init(params), batch)
    metrics = jax.device_get(metrics)
    assert metrics["abs_log_ratio_max"] < 2e-5, metrics["abs_log_ratio_max"]
    assert metrics["routing/mismatch_fraction"] > 0.05, metrics

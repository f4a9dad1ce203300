"""In-flight weight updates in the engine (streaming RL, acceptance 1 of the streaming issue): a
swap forced at a fixed decode step, in both `kv_on_update` modes.

keep: every token's behaviour log-prob equals a teacher-forced forward in which each position's
keys / values and output come from the version recorded for it (a one-token-at-a-time reference
with a B=1 cache, outside the engine), within 1e-5; a reference with one version throughout
differs (negative control). recompute: after the swap, every running row's cached prefix equals
a fresh prefill of that prefix with the new weights; in keep mode it does not."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.generation.engine import Engine, Request
from jaxrl.generation.sampling import SamplingConfig
from jaxrl.models.config import ModelConfig
from jaxrl.models.transformer import Transformer, causal_mask, init_cache, positions_from_mask

PROMPTS = [[1, 5, 6, 7, 8, 9], [1, 20, 21], [1, 30, 31, 32], [1, 40, 41, 42, 43, 44, 45]]
BUDGET = 14
SWAP_AT_CALL = 5  # device calls of one decode step each: the swap lands after decode step 5
TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def two_versions():
    config = ModelConfig("llama", 64, 32, 64, 2, 4, 2, 8, max_position_embeddings=64)
    model = Transformer(config, rngs=nnx.Rngs(0), init_std=0.3)
    graphdef, v0 = nnx.split(model)
    v1 = nnx.split(Transformer(config, rngs=nnx.Rngs(1), init_std=0.3))[1]
    return model, graphdef, v0, v1


def _sample_across_swap(model, v0, v1, kv_on_update):
    """Runs the 4 requests (G=2) with v0, swapping in v1 after device call SWAP_AT_CALL (update
    is asked before every call); before the next call, records every row's cached ids and the
    cache (after the swap's recompute and one decode step with v1)."""
    engine, _ = Engine.for_model(model, num_slots=8, steps_per_call=1)
    sampling = SamplingConfig(BUDGET, temperature=TEMPERATURE, ignore_eos=True)
    calls, seen = [0], {}

    def update(version):
        calls[0] += 1
        if calls[0] == SWAP_AT_CALL + 2:
            seen["rows"] = engine.cached_sequences()
            seen["cache"] = jax.tree.map(np.asarray, engine._cache)
        return (1, v1) if calls[0] == SWAP_AT_CALL + 1 else None

    for i, p in enumerate(PROMPTS):
        engine.submit(Request(i, p, 2, sampling))
    with jax.default_matmul_precision("highest"):
        groups = list(engine.run(v0, jax.random.key(3), update=update, kv_on_update=kv_on_update))
    assert engine.stats.swaps == 1
    return engine, {g.request_id: g for g in groups}, seen


@pytest.fixture(scope="module")
def runs(two_versions):
    model, _, v0, v1 = two_versions
    return {mode: _sample_across_swap(model, v0, v1, mode) for mode in ("keep", "recompute")}


@functools.cache
def _decode_one(graphdef):
    """One position through the model with a B=1 cache (jitted once per graphdef)."""

    @jax.jit
    def step(params, cache, token, p):
        model = nnx.merge(graphdef, params)
        mask = (jnp.arange(cache[0][0].shape[1]) <= p)[None, None, :]
        hidden, cache = model.hidden_states(token[None, None], p[None, None], mask, cache, p[None])
        logits = model.logits(hidden)[0, 0].astype(jnp.float32) / TEMPERATURE
        return cache, jax.nn.log_softmax(logits)

    return step


def _mixed_version_logprobs(graphdef, versions_params, prompt, completion, versions):
    """log softmax(logits / T)[next token] for each completion token, decoding one position at a
    time with a B=1 cache: position p's keys / values and output are computed by the params of
    the version that sampled the token it predicts (prompt positions: the first token's)."""
    ids = list(prompt) + list(completion)
    n_prompt = len(prompt)
    step = _decode_one(graphdef)
    config = nnx.merge(graphdef, versions_params[0]).config
    cache = init_cache(config, 1, len(ids))
    out = []
    for p in range(len(ids) - 1):
        v = int(versions[max(p - n_prompt + 1, 0)])
        cache, logprobs = step(versions_params[v], cache, jnp.int32(ids[p]), jnp.int32(p))
        if p >= n_prompt - 1:
            out.append(float(logprobs[ids[p + 1]]))
    return np.asarray(out)


def test_keep_mode_logprobs_equal_a_forward_with_each_tokens_version(two_versions, runs):
    _, graphdef, v0, v1 = two_versions
    _, groups, _ = runs["keep"]
    worst = worst_single = 0.0
    with jax.default_matmul_precision("highest"):
        for rid, group in groups.items():
            for g in range(2):
                versions = group.versions_gn[g]
                # Steps 1..5 by version 0, the rest by version 1: the trajectory spans the swap.
                np.testing.assert_array_equal(
                    versions, [0] * SWAP_AT_CALL + [1] * (BUDGET - SWAP_AT_CALL)
                )
                ref = _mixed_version_logprobs(
                    graphdef, {0: v0, 1: v1}, PROMPTS[rid], group.tokens_gn[g], versions
                )
                worst = max(worst, float(np.abs(ref - group.logprobs_gn[g]).max()))
                single = _mixed_version_logprobs(  # negative control: version 1 throughout
                    graphdef, {0: v1, 1: v1}, PROMPTS[rid], group.tokens_gn[g], versions
                )
                worst_single = max(worst_single, float(np.abs(single - group.logprobs_gn[g]).max()))
    assert worst <= 1e-5, worst
    assert worst_single > 1e-2, worst_single


@functools.cache
def _prefill(graphdef, width: int = 32):
    """A fresh prefill of one right-padded prompt of `width` tokens (jitted once)."""

    @jax.jit
    def prefill(params, tokens, valid):
        model = nnx.merge(graphdef, params)
        _, cache = model.hidden_states(
            tokens, positions_from_mask(valid), causal_mask(valid),
            init_cache(model.config, 1, width), 0,
        )  # fmt: skip
        return cache

    return prefill


def _fresh_prefill_cache(graphdef, params, ids, width: int = 32):
    tokens = np.zeros((1, width), np.int32)
    tokens[0, : len(ids)] = ids
    return _prefill(graphdef, width)(params, tokens, np.arange(width)[None] < len(ids))


def _prefix_error(graphdef, params, seen) -> float:
    """Largest |cached - fresh prefill| over every running row's cached prefix."""
    worst = 0.0
    for slot, (_, _, ids) in seen["rows"].items():
        fresh = _fresh_prefill_cache(graphdef, params, ids)
        for ours, ref in zip(jax.tree.leaves(seen["cache"]), jax.tree.leaves(fresh), strict=True):
            diff = ours[slot, : len(ids)] - np.asarray(ref[0, : len(ids)])
            worst = max(worst, float(np.abs(diff).max()))
    return worst


def test_recompute_mode_rewrites_the_prefix_as_a_fresh_prefill(two_versions, runs):
    _, graphdef, _, v1 = two_versions
    engine, _, seen = runs["recompute"]
    assert len(seen["rows"]) == 8  # every row was mid-decode at the swap
    assert all(
        len(ids) >= len(PROMPTS[rid]) + SWAP_AT_CALL for rid, _, ids in seen["rows"].values()
    )
    # The swap re-prefilled each row's prefix (prompt + 5 tokens - the pending input token).
    assert engine.stats.recompute_tokens == sum(len(p) + SWAP_AT_CALL - 1 for p in PROMPTS) * 2
    with jax.default_matmul_precision("highest"):
        assert _prefix_error(graphdef, v1, seen) <= 1e-5
        # Negative control: in keep mode the prefix holds version 0's keys / values.
        keep_engine, _, keep_seen = runs["keep"]
        assert keep_engine.stats.recompute_tokens == 0
        assert _prefix_error(graphdef, v1, keep_seen) > 1e-2

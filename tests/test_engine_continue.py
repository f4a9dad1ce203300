"""Kept rows and continuations on the continuous-batching engine (`Request.keep_cache` /
`continues`): a continued row samples what a fresh request with the whole prompt samples, while
only the new tokens run through the model; rows that no request continues are released; per-sample
results and budgets; a row moved into a stopped sibling's slot. (Episodes continued in their slots
against episodes re-prefilled each turn: tests/test_multiturn.py, scheduling independence.)"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from disk_cache import jax_cache_dir, jax_disk_cache  # noqa: F401  (fixtures)
from flax import nnx

from jaxrl.generation.engine import Engine, Request
from jaxrl.generation.sampling import SamplingConfig
from jaxrl.models.config import ModelConfig
from jaxrl.models.transformer import Transformer

# Engines of the same shapes (here, and the 4-slot engines of the other multi-turn tests) load
# compiled programs from the session's disk cache instead of compiling them again.
pytestmark = pytest.mark.usefixtures("jax_disk_cache")

CONFIG = ModelConfig(
    "llama", 64, 32, 64, 2, 4, 4, 8, max_position_embeddings=128, eos_token_id=2, pad_token_id=0
)


@pytest.fixture(scope="module")
def model():
    return Transformer(CONFIG, rngs=nnx.Rngs(0), init_std=0.3)


def _engine(model, slots=4, keep_calls=0):
    return Engine.for_model(model, num_slots=slots, steps_per_call=4, max_total_len=64,
                            prompt_buckets=(16, 32), keep_calls=keep_calls)  # fmt: skip


def test_a_continued_row_samples_as_a_fresh_request_with_the_whole_prompt(model):
    engine, params = _engine(model, keep_calls=2)
    plain = SamplingConfig(6, ignore_eos=True)
    key = jax.random.key(3)
    first = engine.generate(params, [Request(7, [1, 5, 9, 11], 2, plain, keep_cache=True)], key)[0]
    assert len(engine.kept_rows) == 2  # both samples' rows hold their slots
    histories = [[1, 5, 9, 11, *first.tokens_gn[g].tolist(), 40 + g, 41] for g in range(2)]
    calls = engine.stats.decode_calls  # another request decodes while the kept rows wait
    engine.generate(params, [Request(8, [1, 2], 1, plain)], key)
    waited = engine.stats.decode_calls - calls
    assert waited >= 1 and engine.stats.continued_rows == 0
    prefill_before = engine.stats.prefill_tokens
    requests = [Request(20 + g, h, 1, plain, continues=(7, g)) for g, h in enumerate(histories)]
    continued = engine.generate(params, requests, key)
    assert engine.stats.prefill_tokens == prefill_before  # nothing prefilled again
    assert engine.stats.extend_tokens == 2 * 2  # per row: its last sampled token and 40 + g
    assert engine.stats.continued_rows == 2 and engine.stats.kept_wait_calls == 2 * waited
    assert not engine.kept_rows  # taken over, then freed (no keep_cache on the continuations)
    fresh_engine, _ = _engine(model)
    fresh = fresh_engine.generate(
        params, [Request(20 + g, h, 1, plain) for g, h in enumerate(histories)], key
    )
    for a, b in zip(continued, fresh, strict=True):
        np.testing.assert_array_equal(a.tokens_gn, b.tokens_gn)
        np.testing.assert_allclose(a.logprobs_gn, b.logprobs_gn, atol=1e-4)

    # A prompt that does not begin with the kept row's sequence is prefilled as usual; a group
    # short of free slots takes the slot of a row kept for `keep_calls` decode calls, and waits
    # (run returns) for a younger one, until it is released.
    engine.generate(params, [Request(30, [1, 2, 3], 2, plain, keep_cache=True)], key)
    mismatch = Request(31, [1, 2, 4, 4], 1, plain, continues=(30, 0))
    prefill_before = engine.stats.prefill_tokens
    engine.generate(params, [mismatch], key)
    assert engine.stats.prefill_tokens == prefill_before + 4 and set(engine.kept_rows) == {(30, 1)}
    assert engine.stats.decode_calls - engine.kept_rows[30, 1].since >= engine.keep_calls
    engine.submit(Request(32, [1, 2], 4, plain))
    assert [r.request_id for r in engine.run(params, key)] == [32] and not engine.kept_rows
    engine.generate(params, [Request(33, [1, 2], 1, plain, keep_cache=True)], key)
    engine.submit(Request(34, [1, 2], 4, plain))
    assert list(engine.run(params, key)) == []
    engine.release(33, 0)
    assert [r.request_id for r in engine.run(params, key)] == [34] and not engine.kept_rows


def test_per_sample_results_and_sample_budgets(model):
    engine, params = _engine(model)
    plain = SamplingConfig(6, ignore_eos=True)
    key = jax.random.key(5)
    request = Request(1, [1, 5, 9], 2, plain, sample_budgets=(2, 6))
    (whole,) = engine.generate(params, [request], key)
    assert whole.samples is None and whole.lengths_g.tolist() == [2, 6]
    engine.submit(Request(1, [1, 5, 9], 2, plain, sample_budgets=(2, 6), per_sample=True))
    rows = list(engine.run(params, key))
    assert [r.samples for r in rows] == [(0,), (1,)]  # the short row first, as it stops
    for r in rows:
        np.testing.assert_array_equal(r.tokens_gn[0], whole.tokens_gn[r.samples[0]])
    for bad in [(2,), (0, 3), (3, 7)]:
        with pytest.raises(ValueError, match="sample_budgets"):
            engine.submit(Request(2, [1, 5], 2, plain, sample_budgets=bad))


def test_a_row_moved_into_its_stopped_siblings_slot_keeps_its_own_tokens(model):
    # 15 samples stop after one token; the 16th, in the top slot, is moved down into the lowest
    # free slot, its stopped sibling's: the sibling's result must not take its tokens.
    engine, params = _engine(model, slots=16)
    plain = SamplingConfig(9, ignore_eos=True)
    key = jax.random.key(2)
    moved = engine.stats.moved_rows
    (short,) = engine.generate(
        params, [Request(1, [1, 4], 16, plain, sample_budgets=(1,) * 15 + (9,))], key
    )
    assert engine.stats.moved_rows > moved
    (full,) = engine.generate(params, [Request(1, [1, 4], 16, plain)], key)
    assert short.lengths_g.tolist() == [1] * 15 + [9]
    np.testing.assert_array_equal(short.tokens_gn[:, 0], full.tokens_gn[:, 0])
    np.testing.assert_array_equal(short.tokens_gn[15], full.tokens_gn[15])


def test_fewer_extension_rows_and_finer_widths_pad_less_and_sample_the_same(model):
    """`extend_min_rows` / `extend_buckets`: two continuations of 3 new tokens among 4 active
    slots compute 4 rows x 8 by default (rows from min(8, active), widths 8, 16, ...), 2 x 8
    with a floor of 1 row, 2 x 4 with widths (4, 12) too; the tokens are the same, the
    log-probs within fp32 rounding of differently shaped calls."""
    plain, key = SamplingConfig(6, ignore_eos=True), jax.random.key(5)
    cases = {
        32: {},
        16: {"extend_min_rows": 1},
        8: {"extend_min_rows": 1, "extend_buckets": (4, 12)},
    }
    results = []
    for padded, options in cases.items():
        engine, params = Engine.for_model(model, num_slots=4, steps_per_call=4, max_total_len=64,
                                          prompt_buckets=(16, 32), **options)  # fmt: skip
        first = engine.generate(params, [Request(7, [1, 5, 9], 2, plain, keep_cache=True)], key)
        histories = [[1, 5, 9, *first[0].tokens_gn[g].tolist(), 40, 41, 42] for g in range(2)]
        requests = [Request(20 + g, h, 1, plain, continues=(7, g)) for g, h in enumerate(histories)]
        results.append(engine.generate(params, requests, key))
        assert engine.stats.extend_tokens == 2 * 3  # its last sampled token, 40 and 41 per row
        assert engine.stats.extend_padded_tokens == padded, options
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            np.testing.assert_array_equal(a.tokens_gn, b.tokens_gn)
            np.testing.assert_allclose(a.logprobs_gn, b.logprobs_gn, atol=1e-4)
    with pytest.raises(ValueError, match="extend_min_rows=0"):
        Engine.for_model(model, num_slots=4, extend_min_rows=0)
    with pytest.raises(ValueError, match=r"extend_buckets=\(0, 8\)"):
        Engine.for_model(model, num_slots=4, extend_buckets=(0, 8))


def test_calls_that_end_at_their_first_stops_sample_the_same_in_fewer_slot_steps(model):
    """`exit_stops`: six requests of budgets 3..13 on 4 slots, then a multi-turn row's next turn,
    at 8 steps per call. Calls that end once one row has stopped (while requests wait, or while
    a row that keeps its cache runs) give the same tokens in fewer slot-steps."""
    cfg, key = SamplingConfig(16, ignore_eos=True), jax.random.key(3)
    runs = []
    for stops in (0, 1):
        engine, params = Engine.for_model(model, num_slots=4, steps_per_call=8, max_total_len=64,
                                          prompt_buckets=(16, 32), exit_stops=stops)  # fmt: skip
        batch = [Request(i, [1, 5 + i, 9], 1, cfg, sample_budgets=(3 + 2 * i,)) for i in range(6)]
        first = engine.generate(params, batch, key)
        calls = engine.stats.decode_calls
        turn = Request(30, [1, 5, 9], 1, cfg, sample_budgets=(3,), keep_cache=True)
        other = Request(31, [1, 6, 9], 1, cfg, sample_budgets=(12,))
        second = engine.generate(params, [turn, other], key)
        history = [1, 5, 9, *second[0].tokens_gn[0].tolist(), 40, 41]
        third = engine.generate(params, [Request(32, history, 1, cfg, continues=(30, 0))], key)
        runs.append((first + second + third, engine.stats, calls))
    (plain, stats0, calls0), (early, stats1, calls1) = runs
    for a, b in zip(plain, early, strict=True):
        np.testing.assert_array_equal(a.tokens_gn, b.tokens_gn)
        np.testing.assert_allclose(a.logprobs_gn, b.logprobs_gn, atol=1e-4)
    assert stats0.kept_tokens == stats1.kept_tokens == sum(3 + 2 * i for i in range(6)) + 15 + 16
    assert stats0.early_exits == 0 and stats1.early_exits > 0
    assert stats1.slot_steps < stats0.slot_steps, (stats1.slot_steps, stats0.slot_steps)
    assert stats1.continued_rows == stats0.continued_rows == 1
    with pytest.raises(ValueError, match="exit_stops=-1"):
        Engine.for_model(model, num_slots=4, exit_stops=-1)


def test_attended_positions_count_each_calls_span(model):
    """`EngineStats.attended_positions`: slot-steps times the span of their call. A 3-token
    prompt sampling 40 tokens, 8 a call on 4 slots: its last writes reach 10, 18, 26, 34, 42,
    so three calls attend over the 32-position bucket and two over the cache's 64."""
    engine, params = Engine.for_model(model, num_slots=4, steps_per_call=8, max_total_len=64,
                                      prompt_buckets=(16, 32))  # fmt: skip
    cfg = SamplingConfig(40, ignore_eos=True)
    engine.generate(params, [Request(0, [1, 5, 9], 1, cfg)], jax.random.key(0))
    assert engine.stats.decode_calls == 5 and engine.stats.slot_steps == 5 * 8 * 4
    assert engine.stats.attended_positions == 8 * 4 * (3 * 32 + 2 * 64)
    with pytest.raises(ValueError, match=r"span_buckets=\(0, 64\); need positions >= 1"):
        Engine.for_model(model, num_slots=4, max_total_len=64, span_buckets=(0, 64))

"""The continuous-batching engine: greedy parity with transformers.generate and the static Sampler
(groups, requests arriving mid-decode, scanned layers), exact behaviour log-probs while slots
refill, results independent of slot count and arrival order, one prefill per group, bounded
compilation, bad input and cancellation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from disk_cache import jax_cache_dir, jax_disk_cache  # noqa: F401  (fixtures)
from flax import nnx
from hf_fixtures import hf_greedy, save_tiny_checkpoint

from jaxrl.generation.engine import Engine, Request
from jaxrl.generation.sampler import Sampler
from jaxrl.generation.sampling import SamplingConfig, processed_logprobs
from jaxrl.models import hf
from jaxrl.models.config import ModelConfig
from jaxrl.models.transformer import Transformer

# Every test builds new engines (new jitted functions), most of the same shapes as another's:
# with the disk cache on they load those programs instead of compiling them again (13 decode
# compiles of 4 programs in the slot-count test alone). The same machine code: no result changes.
pytestmark = pytest.mark.usefixtures("jax_disk_cache")

PROMPTS = [[1, 5, 6, 7, 8, 9, 10, 11], [1, 20, 21], [1, 30, 31, 32, 33, 34], [1, 40]]
BUDGETS = [24, 9, 17, 30]  # per-request max_new_tokens: rows finish at different steps


@pytest.fixture(scope="module")
def tiny_model():
    config = ModelConfig("llama", 64, 32, 64, 2, 4, 4, 8, max_position_embeddings=128)
    return Transformer(config, rngs=nnx.Rngs(0), init_std=0.3)


@pytest.fixture(scope="module")
def forward_logits(tiny_model):
    """The tiny model's logits, one jitted function for the module: the teacher-forced rows of
    every sampling below have the same lengths, so each length compiles once, not per sampling."""
    return jax.jit(lambda tokens: tiny_model(tokens))


def _requests(sampling, prompts=PROMPTS, budgets=BUDGETS, samples=2, first_id=0):
    return [
        Request(first_id + i, p, samples, sampling, max_new_tokens=b)
        for i, (p, b) in enumerate(zip(prompts, budgets, strict=True))
    ]


def _run_with_late_arrivals(engine, params, early, late, key):
    """Submits `early`, starts decoding, and submits `late` once the first group is out (so they
    join while the other rows are mid-decode). Returns {request_id: GroupResult}."""
    for r in early:
        engine.submit(r)
    results = {}
    for group in engine.run(params, key):
        if not results:
            for r in late:
                engine.submit(r)
        results[group.request_id] = group
    return results


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_greedy_matches_transformers_and_sampler_with_groups_and_late_arrivals(scan, tmp_path):
    torch_model = save_tiny_checkpoint(tmp_path, "llama3")
    model = hf.load_model(str(tmp_path), scan_layers=scan)
    greedy = SamplingConfig(max(BUDGETS), greedy=True)
    engine, params = Engine.for_model(model, num_slots=4, steps_per_call=4)
    requests = _requests(greedy, samples=2)
    with jax.default_matmul_precision("highest"):
        ours = _run_with_late_arrivals(
            engine, params, requests[:2], requests[2:], jax.random.key(0)
        )
        static = Sampler.for_model(model)[0].generate(params, PROMPTS, greedy, jax.random.key(0))
    assert engine.stats.prefill_calls >= 2  # the late requests were prefilled mid-run
    ref_tokens, scores = hf_greedy(torch_model, PROMPTS, max(BUDGETS))
    compared = 0
    for i, budget in enumerate(BUDGETS):
        group = ours[i]
        assert group.tokens_gn.shape == (2, budget)
        # Both samples of a greedy group are the same completion.
        np.testing.assert_array_equal(group.tokens_gn[0], group.tokens_gn[1])
        n = int(group.lengths_g[0])
        # The static sampler (same stops, longer budget) agrees token for token over our rows.
        np.testing.assert_array_equal(group.tokens_gn[0, :n], static.tokens_bn[i, :n])
        np.testing.assert_allclose(group.logprobs_gn[0, :n], static.logprobs_bn[i, :n], atol=1e-5)
        ref = list(ref_tokens[i])
        ref_len = min(budget, ref.index(2) + 1 if 2 in ref[:budget] else budget)
        assert n == ref_len, (i, n, ref_len)
        for t in range(n):
            if group.tokens_gn[0, t] != ref[t]:  # allowed only at a float near-tie
                top2 = torch.topk(scores[t][i], 2).values.numpy()
                assert float(top2[0] - top2[1]) < 1e-5, (i, t)
                break
            compared += 1
    assert compared > 40  # the comparison covered real tokens


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingConfig(32, temperature=1.0),
        SamplingConfig(32, temperature=0.7, top_k=5),
        SamplingConfig(32, temperature=1.3, top_p=0.8),
    ],
    ids=["t1", "t0.7-topk5", "t1.3-topp0.8"],
)
def test_logprobs_equal_teacher_forced_forward_while_slots_refill(
    tiny_model, forward_logits, sampling
):
    engine, params = Engine.for_model(tiny_model, pad_id=0, eos_ids=(), num_slots=4,
                                      steps_per_call=3)  # fmt: skip
    requests = _requests(sampling, samples=2) + _requests(
        sampling, [p[::-1] for p in PROMPTS], BUDGETS[::-1], samples=2, first_id=10
    )
    with jax.default_matmul_precision("highest"):
        results = engine.generate(params, requests, jax.random.key(3))
        assert engine.stats.prefill_calls >= 4  # 8 groups of 2 through 4 slots: refills
        rows = [
            (list(g.prompt), g.tokens_gn[s], g.logprobs_gn[s], g.mask_gn[s])
            for g in results
            for s in range(2)
        ]
        # One unpadded row per forward: XLA:CPU's fp32 rounding changes with the batch shape
        # (a padded [16, 38] batch differs from the same rows alone by up to 2e-5 on this
        # large-logit model).
        # The logits (compiled per length once for all samplings), then this sampling's
        # processing (a small program per length).
        process = jax.jit(lambda logits: processed_logprobs(logits, sampling))
        forced = [
            np.asarray(process(forward_logits(jnp.asarray([p + list(t)]))))[0]
            for p, t, _, _ in rows
        ]
    worst, kept = 0.0, 0
    for row, (p, t, lp, m) in enumerate(rows):
        ref = forced[row][np.arange(len(p) - 1, len(p) - 1 + len(t)), t]
        worst = max(worst, float(np.abs(np.where(m, ref - lp, 0.0)).max()))
        kept += int(m.sum())
    print(f"worst |engine - teacher-forced| log-prob: {worst:.3g}")
    assert worst <= 1e-5, worst
    assert kept == sum(BUDGETS) * 4  # no EOS: every row used its whole budget


def test_same_tokens_with_4_or_32_slots_in_either_arrival_order(tiny_model):
    sampling = SamplingConfig(32, temperature=1.0, top_k=20)
    prompts = PROMPTS + [[1, 3, 4], [1, 50, 51, 52, 53], [1, 7]]
    budgets = BUDGETS + [5, 31, 12]
    requests = _requests(sampling, prompts, budgets, samples=3)
    runs = {}
    for slots in (4, 32):
        for name, order in (("fifo", requests), ("reversed", requests[::-1])):
            engine, params = Engine.for_model(tiny_model, pad_id=0, eos_ids=(), num_slots=slots,
                                              steps_per_call=5, span_buckets=(64,))  # fmt: skip
            out = engine.generate(params, order, jax.random.key(11))
            runs[slots, name] = {g.request_id: g for g in out}
            # With 32 slots the draining rows are moved down to smaller slot buckets (their
            # cache rows copied), and the tokens must not notice.
            assert (engine.stats.moved_rows > 0) == (slots == 32), engine.stats
    first = runs[4, "fifo"]
    for (slots, _), other in runs.items():
        for rid, g in first.items():
            np.testing.assert_array_equal(other[rid].tokens_gn, g.tokens_gn)
            np.testing.assert_array_equal(other[rid].mask_gn, g.mask_gn)
            if slots == 4:  # same shapes, another arrival order and other slots: bitwise
                np.testing.assert_array_equal(other[rid].logprobs_gn, g.logprobs_gn)
            else:
                # Another slot count changes the matmul shapes, and XLA:CPU's fp32 rounding with
                # them (4.5e-6 at most here, on logits of magnitude ~10).
                np.testing.assert_allclose(other[rid].logprobs_gn, g.logprobs_gn, atol=1e-5)
    for rid, g in runs[32, "fifo"].items():
        np.testing.assert_array_equal(runs[32, "reversed"][rid].logprobs_gn, g.logprobs_gn)
    # XLA:CPU's rounding difference scales with the logits: with weights at std 0.1 instead of
    # 0.3 (logits of magnitude ~3) 4 and 32 slots agree within 1e-6 (9.5e-7 measured).
    milder = Transformer(tiny_model.config, rngs=nnx.Rngs(0), init_std=0.1)
    mild = []
    for slots in (4, 32):
        engine, params = Engine.for_model(milder, pad_id=0, eos_ids=(), num_slots=slots,
                                          steps_per_call=5, span_buckets=(64,))  # fmt: skip
        mild.append(
            {g.request_id: g for g in engine.generate(params, requests, jax.random.key(11))}
        )
    for rid, g in mild[0].items():
        np.testing.assert_array_equal(mild[1][rid].tokens_gn, g.tokens_gn)
        np.testing.assert_allclose(mild[1][rid].logprobs_gn, g.logprobs_gn, atol=1e-6, rtol=0)
    # Negative control: another seed changes the tokens (the comparison can fail).
    engine, params = Engine.for_model(tiny_model, pad_id=0, eos_ids=(), num_slots=4,
                                      steps_per_call=5, span_buckets=(64,))  # fmt: skip
    other_seed = {g.request_id: g for g in engine.generate(params, requests, jax.random.key(12))}
    assert any((other_seed[r].tokens_gn != g.tokens_gn).any() for r, g in first.items())
    # The G samples of one request differ from each other (noise is keyed by the sample index).
    assert all((g.tokens_gn[0] != g.tokens_gn[1]).any() for g in first.values())


def test_a_group_costs_one_prompt_prefill(tiny_model):
    sampling = SamplingConfig(4, temperature=1.0)
    counts = {}
    for samples in (1, 4):
        engine, params = Engine.for_model(tiny_model, pad_id=0, eos_ids=(), num_slots=8)
        engine.generate(params, _requests(sampling, budgets=[4] * 4, samples=samples),
                        jax.random.key(0))  # fmt: skip
        counts[samples] = engine.stats.prefill_tokens
        assert engine.stats.kept_tokens == 4 * 4 * samples
    assert counts[1] == counts[4] == sum(map(len, PROMPTS)), counts
    # The static sampler, given the same group as G rows, prefills the prompt G times.
    assert 4 * counts[1] > counts[4]


def test_compiled_programs_are_bounded_by_the_buckets(tiny_model):
    engine, params = Engine.for_model(
        tiny_model, pad_id=0, eos_ids=(), num_slots=4, prompt_buckets=(8, 16), span_buckets=(64,)
    )
    rng = np.random.default_rng(0)
    requests = [
        Request(i, list(rng.integers(1, 60, size=int(rng.integers(1, 17)))), 1,
                SamplingConfig(8, greedy=True), max_new_tokens=int(rng.integers(1, 9)))
        for i in range(24)
    ]  # fmt: skip
    engine.generate(params, requests, jax.random.key(0))
    # prefill: (batch bucket 1, 2, 4) x (prompt bucket 8, 16) at most; decode: one span.
    assert engine.stats.num_traces <= 3 * 2 + 1, engine.stats.num_traces


def test_precompiled_programs_serve_the_whole_run_with_the_same_tokens(tiny_model):
    """`precompile` compiles every program a run can call (decode per span x active bucket,
    prefill per prompt-batch x length bucket, moves; recompute's re-prefills): a run with a swap
    (KV recomputed), slot moves and refills then traces nothing more, and its tokens and
    log-probs are the lazily compiled run's, bitwise."""
    kv_on_update = "recompute"
    sampling = SamplingConfig(32, temperature=1.0)
    prompts = PROMPTS + [[1, 3, 4], [1, 50, 51, 52, 53], [1, 7]]
    budgets = BUDGETS + [5, 31, 12]
    requests = _requests(sampling, prompts, budgets, samples=2)
    other = Transformer(tiny_model.config, rngs=nnx.Rngs(1), init_std=0.3)
    _, newer = nnx.split(other)

    def run(precompile: bool):
        engine, params = Engine.for_model(tiny_model, pad_id=0, eos_ids=(), num_slots=16,
                                          steps_per_call=4, prompt_buckets=(8,),
                                          span_buckets=(64,), max_total_len=128)  # fmt: skip
        compiled = 0
        if precompile:
            compiled = engine.precompile(params, sampling, samples_per_request=2,
                                         max_prompt_len=8, recompute=True)  # fmt: skip
        traced = engine.stats.num_traces
        for r in requests:
            engine.submit(r)
        calls = []

        def update(version):  # one swap, at the third device call
            calls.append(version)
            return (1, newer) if len(calls) == 3 else None

        out = {g.request_id: g for g in engine.run(params, jax.random.key(3), update=update,
                                                   kv_on_update=kv_on_update)}  # fmt: skip
        return out, compiled, engine.stats.num_traces - traced, engine.stats

    lazy, _, lazy_traces, _ = run(precompile=False)
    ahead, compiled, ahead_traces, stats = run(precompile=True)
    assert lazy_traces > 0 and ahead_traces == 0, (lazy_traces, ahead_traces)
    # Spans 64 and the capacity 128 x active buckets 8, 16: 4 decodes, 2 moves; prefills of
    # (1, 2, 4, 8 prompts) x width 8, and recompute's re-prefills of (1, 2, 4, 8, 16 rows) x
    # widths (8, 128) less the 4 already there.
    assert compiled == 4 + 2 + 4 + (5 * 2 - 4), compiled
    assert stats.swaps == 1 and stats.moved_rows > 0 and stats.recompute_tokens > 0, stats
    for rid, g in lazy.items():
        np.testing.assert_array_equal(ahead[rid].tokens_gn, g.tokens_gn)
        np.testing.assert_array_equal(ahead[rid].logprobs_gn, g.logprobs_gn)
        np.testing.assert_array_equal(ahead[rid].versions_gn, g.versions_gn)


def test_bad_input_is_refused_and_cancelled_requests_free_their_slots(tiny_model):
    engine, params = Engine.for_model(tiny_model, pad_id=0, eos_ids=(), num_slots=4,
                                      max_total_len=40)  # fmt: skip
    sampling = SamplingConfig(6, temperature=1.0)
    with pytest.raises(ValueError, match="request 0: the prompt is empty"):
        engine.submit(Request(0, [], 1, sampling))
    with pytest.raises(ValueError, match="prompt of 38 tokens.*context of 40.*truncate"):
        engine.submit(Request(1, [3] * 38, 1, sampling))
    with pytest.raises(ValueError, match="num_samples=5 but the engine has 4 decode slots"):
        engine.submit(Request(2, [1, 2], 5, sampling))
    engine.submit(Request(3, [1, 2], 1, sampling))
    with pytest.raises(ValueError, match="request id 3 is already queued"):
        engine.submit(Request(3, [1, 4], 1, sampling))
    engine.cancel(3)  # a queued request: dropped before it runs
    assert engine.generate(params, [], jax.random.key(0)) == []

    # A running request cancelled mid-decode: its slots go to the next request, whose result is
    # what it would have been alone.
    long_a, long_b = Request(10, [1, 5, 6], 2, sampling, 30), Request(11, [1, 7], 4, sampling, 30)
    short, last = Request(12, [1, 8, 9], 2, sampling, 3), Request(13, [1, 9], 2, sampling, 5)
    alone, params = Engine.for_model(tiny_model, pad_id=0, eos_ids=(), num_slots=4,
                                     max_total_len=40)  # fmt: skip
    expected = {g.request_id: g for g in alone.generate(params, [long_b, last], jax.random.key(1))}
    for r in (long_a, short, long_b, last):
        engine.submit(r)
    results = {}
    for group in engine.run(params, jax.random.key(1)):
        results[group.request_id] = group
        if group.request_id == 12:  # long_a is mid-decode in the other two slots
            engine.cancel(10)
    assert sorted(results) == [11, 12, 13]
    for rid in (11, 13):
        np.testing.assert_array_equal(results[rid].tokens_gn, expected[rid].tokens_gn)
    assert engine.stats.kept_tokens < 2 * 30 + 2 * 3 + 4 * 30 + 2 * 5  # long_a stopped early


def test_engine_sampler_serves_the_sampler_interface_prompt_major(tiny_model):
    """`EngineSampler.generate` (what the RL generator, evaluations and `launch.generate` call):
    rows prompt-major, each prompt one request of G samples keyed by its index in the call,
    greedy equal to the static sampler, bad input refused with nothing left queued."""
    from jaxrl.generation.engine_sampler import EngineSampler

    sampler, params = EngineSampler.for_model(tiny_model, pad_id=0, eos_ids=(), num_slots=4,
                                              steps_per_call=4, max_total_len=40)  # fmt: skip
    sampling = SamplingConfig(6, temperature=1.0)
    out = sampler.generate(params, PROMPTS, sampling, jax.random.key(5), num_samples=3)
    assert out.tokens_bn.shape == (12, 6) and out.mask_bn.all()
    # The same prompts as engine requests 0..3 of 3 samples (the sampler's own engine: no
    # new compile; the slot-count independence is test_same_tokens_with_4_or_32_slots_...).
    groups = sampler.engine.generate(
        params, _requests(sampling, budgets=[6] * 4, samples=3), jax.random.key(5)
    )
    np.testing.assert_array_equal(out.tokens_bn, np.concatenate([g.tokens_gn for g in groups]))
    assert sampler.stats.prefill_tokens == 2 * sum(map(len, PROMPTS))  # one prefill per prompt
    static = Sampler.for_model(tiny_model, pad_id=0, eos_ids=(), max_total_len=40)[0]
    greedy = SamplingConfig(6, greedy=True)
    long = [[3] * 38, [1, 2]]
    ours = sampler.generate(params, long, greedy, jax.random.key(0), truncate=True, num_samples=2)
    ref = static.generate(params, long, greedy, jax.random.key(0), truncate=True, num_samples=2)
    np.testing.assert_array_equal(ours.tokens_bn, ref.tokens_bn)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        sampler.generate(params, [[1, 2], []], sampling, jax.random.key(0))
    with pytest.raises(ValueError, match="num_samples=5 but the engine has 4 decode slots"):
        sampler.generate(params, [[1, 2]], sampling, jax.random.key(0), num_samples=5)
    again = sampler.generate(params, PROMPTS, sampling, jax.random.key(5), num_samples=3)
    np.testing.assert_array_equal(again.tokens_bn, out.tokens_bn)  # nothing was left queued
    np.testing.assert_array_equal(again.logprobs_bn, out.logprobs_bn)  # bitwise on a re-run


def test_inverse_cdf_draw_matches_a_float64_reference_and_never_takes_masked_tokens():
    """The engine's per-row draw: the first token whose float64 cumulative probability exceeds
    u * total (numpy's searchsorted), masked tokens never taken, frequencies = probabilities."""
    from jaxrl.generation.sampling import inverse_cdf_tokens

    draw = jax.jit(inverse_cdf_tokens, static_argnames="block")
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(64, 1000)) * 3
    logits[:, rng.random(1000) < 0.3] = -np.inf  # top-k / top-p style holes
    logits[:, 990:] = -np.inf  # a masked tail, inside the last (padded) block
    logprobs = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1)
    u = rng.random(64).astype(np.float32)
    u[:2] = 0.0, np.float32(1 - 2**-24)  # the ends of [0, 1)
    tokens = np.asarray(draw(logprobs, jnp.asarray(u)))
    p = np.exp(np.asarray(logprobs, np.float64))
    ref = [np.searchsorted(np.cumsum(p[b]), u[b] * p[b].sum(), side="right") for b in range(64)]
    np.testing.assert_array_equal(tokens, ref)
    assert np.isfinite(np.asarray(logprobs)[np.arange(64), tokens]).all()
    row = jax.nn.log_softmax(jnp.asarray([0.0, 1.0, 2.0, -np.inf, 0.5]))
    u = jax.random.uniform(jax.random.key(0), (20_000,))
    draws = np.asarray(draw(jnp.tile(row, (20_000, 1)), u, block=2))
    np.testing.assert_allclose(np.bincount(draws, minlength=5) / 2e4, np.exp(row), atol=0.01)


def test_rl_main_refuses_an_unknown_generator_or_engine_knobs(tmp_path):
    from jaxrl.generation.placement import GeneratorConfig
    from launch.rl import rl_main

    def run(name, **fields):
        rl_main(str(tmp_path / name), *[None] * 4, generator_config=GeneratorConfig(**fields))

    with pytest.raises(SystemExit, match=r"GeneratorConfig.kind='vllm'; expected one of \('eng"):
        run("a", kind="vllm")
    with pytest.raises(SystemExit, match="GeneratorConfig.slots=-1.*need slots >= 0"):
        run("b", slots=-1)
    with pytest.raises(SystemExit, match="GeneratorConfig.extend_min_rows=0.*row floor >= 1"):
        run("c", extend_min_rows=0)
    with pytest.raises(SystemExit, match="GeneratorConfig.keep_calls=-1; need >= 0"):
        run("d", keep_calls=-1)
    with pytest.raises(SystemExit, match="GeneratorConfig.exit_stops=-1; need >= 0"):
        run("e", exit_stops=-1)
    with pytest.raises(SystemExit, match=r"GeneratorConfig.span_buckets=\(0, 64\): need posi"):
        run("f", span_buckets=(0, 64))
    assert not any((tmp_path / n).exists() for n in "abcdef")


def test_generator_extension_buckets_reach_the_engine(tiny_model):
    """`GeneratorConfig.extend_min_rows` / `extend_widths` / `keep_calls` / `exit_stops` /
    `span_buckets`, as launch.rl passes them to `make_sampler`: the engine's extension rows and
    widths, how long kept rows hold their slots, when a decode call ends, the prefixes it
    attends to; the static sampler has none."""
    from jaxrl.generation.engine_sampler import make_sampler

    graphdef, config = nnx.graphdef(tiny_model), tiny_model.config
    common = {"pad_id": 0, "max_total_len": 64}
    sampler = make_sampler("engine", graphdef, config, num_slots=32, extend_min_rows=2,
                           extend_buckets=(8, 24, 40), keep_calls=1, exit_stops=3,
                           span_buckets=(24, 48), **common)  # fmt: skip
    engine = sampler.engine
    assert engine.extend_min_rows == 2 and engine.extend_widths() == (8, 24, 40, 64)
    assert engine.keep_calls == 1 and engine.exit_stops == 3 and engine.programs.early_exit
    assert engine.extend_widths(20) == (8, 24)  # up to the one that holds 20 new tokens
    assert engine.span_buckets == (24, 48)
    default = make_sampler("engine", graphdef, config, num_slots=32, **common).engine
    assert default.extend_min_rows == 8 and default.extend_widths() == (8, 16, 32, 64)
    assert default.keep_calls == 0 and default.exit_stops == 0
    assert default.span_buckets == (32, 64)
    static = make_sampler("static", graphdef, config, extend_min_rows=2, **common)
    assert not hasattr(static, "engine")


def test_generator_config_bindings_apply_without_rl_main_generator_config():
    """`GeneratorConfig.max_len = 4096` alone (no `rl_main.generator_config = @GeneratorConfig()`)
    reaches the run's generator config, the other fields at their defaults."""
    import gin

    import launch.configs  # noqa: F401  (registers GeneratorConfig with gin)
    from launch.rl import resolve_generator_config

    gin.clear_config()
    try:
        gin.parse_config("GeneratorConfig.max_len = 4096")
        config = resolve_generator_config(None)
    finally:
        gin.clear_config()
    assert (config.max_len, config.dtype, config.kind) == (4096, "auto", "engine")

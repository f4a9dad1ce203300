"""The KV-cache sampler: parity with transformers.generate, exact behaviour log-probs, stops,
sharding-invariant sampling, bounded compilation, bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from hf_fixtures import hf_greedy, save_tiny_checkpoint

from jaxrl.generation.sampler import Sampler
from jaxrl.generation.sampling import SamplingConfig, mask_logits, processed_logprobs
from jaxrl.infra.mesh import MeshConfig, make_mesh
from jaxrl.infra.sharding import GENERATOR_RULES
from jaxrl.models import hf
from jaxrl.models.config import ModelConfig
from jaxrl.models.transformer import Transformer

PROMPTS = [[1, 5, 6, 7, 8, 9, 10, 11], [1, 20, 21], [1, 30, 31, 32, 33, 34], [1, 40]]
NEW_TOKENS = 32


@pytest.mark.parametrize("kind", ["llama3", "qwen2", "qwen3"])
def test_greedy_matches_transformers_generate(kind, tmp_path):
    torch_model = save_tiny_checkpoint(tmp_path, kind)
    sampler, params = Sampler.for_model(hf.load_model(str(tmp_path)))
    with jax.default_matmul_precision("highest"):
        out = sampler.generate(
            params, PROMPTS, SamplingConfig(NEW_TOKENS, greedy=True), jax.random.key(0)
        )

    ref_tokens, ref_scores = hf_greedy(torch_model, PROMPTS, NEW_TOKENS)
    gaps = []  # the reference's top-2 logit gap at each compared step
    for row in range(len(PROMPTS)):
        for t in range(NEW_TOKENS):
            ours_done = not out.mask_bn[row, t]
            theirs_done = t >= ref_tokens.shape[1] or (t > 0 and 2 in ref_tokens[row, :t])
            assert ours_done == theirs_done, (kind, row, t)
            if ours_done:
                break
            top2 = torch.topk(ref_scores[t][row], 2).values.numpy()
            gaps.append(float(top2[0] - top2[1]))
            assert out.tokens_bn[row, t] == ref_tokens[row, t], (kind, row, t, gaps[-1])
    # Token-identical, exactly. Float rounding could legitimately pick the other token only at
    # a near-tie (top-2 gap within the ~1e-5 the two sides' logits differ by, see
    # test_models_parity.py); the fixtures have none, by a margin this checks.
    print(f"{kind}: {len(gaps)} tokens identical; smallest top-2 logit gap {min(gaps):.3g}")
    assert min(gaps) > 1e-4, f"{kind}: a near-tie in the fixture; change its seed or prompts"
    assert out.mask_bn.sum() > NEW_TOKENS  # the comparison covered real tokens


@pytest.fixture(scope="module")
def tiny_model():
    # kv heads, heads, vocab and mlp all divide by 4 so a tp=4 mesh splits every axis.
    config = ModelConfig("llama", 64, 32, 64, 2, 4, 4, 8, max_position_embeddings=128)
    return Transformer(config, rngs=nnx.Rngs(0), init_std=0.3)


@pytest.fixture(scope="module")
def forward_logits(tiny_model):
    """The tiny model's forward, jitted once for the module (the same shapes for every
    sampling): run eagerly, each of its ops would compile a program of its own."""
    return jax.jit(lambda tokens, valid: tiny_model(tokens, valid))


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingConfig(12, temperature=1.0),
        SamplingConfig(12, temperature=0.7, top_k=5),
        SamplingConfig(12, temperature=1.3, top_p=0.8),
        SamplingConfig(12, greedy=True),
    ],
    ids=["t1", "t0.7-topk5", "t1.3-topp0.8", "greedy"],
)
def test_logprobs_equal_teacher_forced_forward(tiny_model, forward_logits, sampling):
    sampler, params = Sampler.for_model(tiny_model, pad_id=0, eos_ids=())
    with jax.default_matmul_precision("highest"):
        out = sampler.generate(params, PROMPTS, sampling, jax.random.key(3))
        width = max(map(len, PROMPTS))
        tokens = np.zeros((len(PROMPTS), width + sampling.max_new_tokens), np.int32)
        valid = np.zeros(tokens.shape, bool)
        for row, p in enumerate(PROMPTS):
            tokens[row, width - len(p) : width], valid[row, width - len(p) : width] = p, True
        tokens[:, width:], valid[:, width:] = out.tokens_bn, out.mask_bn
        logits = forward_logits(jnp.asarray(tokens), jnp.asarray(valid))
        forced = processed_logprobs(logits[:, width - 1 : -1], sampling)
    forced = np.take_along_axis(np.asarray(forced), out.tokens_bn[..., None], axis=-1)[..., 0]
    diff = np.abs(np.where(out.mask_bn, forced - out.logprobs_bn, 0.0)).max()
    print(f"max |sampler - teacher-forced| log-prob: {diff:.3g}")
    assert diff <= 1e-5, diff
    assert np.all(out.logprobs_bn[out.mask_bn] <= 0)


def test_rows_stop_independently_on_eos(tiny_model):
    sampler, params = Sampler.for_model(tiny_model, pad_id=0, eos_ids=())
    free = sampler.generate(params, PROMPTS, SamplingConfig(16, greedy=True), jax.random.key(0))
    stop = int(free.tokens_bn[0, 3])
    stopped = sampler.generate(
        params, PROMPTS, SamplingConfig(16, greedy=True, stop_ids=(stop,)), jax.random.key(0)
    )
    lengths = []
    for row in range(len(PROMPTS)):
        hits = np.flatnonzero(free.tokens_bn[row] == stop)
        length = int(hits[0]) + 1 if hits.size else 16
        lengths.append(length)
        assert stopped.lengths_b[row] == length
        np.testing.assert_array_equal(stopped.tokens_bn[row, :length], free.tokens_bn[row, :length])
        assert np.all(stopped.tokens_bn[row, length:] == 0)
        assert not stopped.mask_bn[row, length:].any()
        assert np.all(stopped.logprobs_bn[row, length:] == 0)
    assert len(set(lengths)) > 1, lengths  # rows really stopped at different steps


def test_same_seed_same_tokens_on_one_device_and_tp4_mesh(tiny_model):
    sampling = SamplingConfig(10, temperature=1.0, top_k=10)
    single, params = Sampler.for_model(tiny_model, pad_id=0, eos_ids=())
    expected = single.generate(params, PROMPTS, sampling, jax.random.key(7))

    mesh = make_mesh(MeshConfig(("dp", "tp"), (1, 4), first_device=4))
    from jaxrl.infra.sharding import param_shardings

    graphdef, state = nnx.split(tiny_model)
    sharded = jax.device_put(state, param_shardings(state, mesh, GENERATOR_RULES))
    q = sharded["layers"][0]["attention"]["q_kernel"].get_value()
    assert len(q.sharding.device_set) == 4 and q.addressable_shards[0].data.shape[1] == 1
    on_mesh = Sampler(
        graphdef, tiny_model.config, pad_id=0, mesh=mesh, rules=GENERATOR_RULES
    ).generate(sharded, PROMPTS, sampling, jax.random.key(7))
    np.testing.assert_array_equal(on_mesh.tokens_bn, expected.tokens_bn)
    np.testing.assert_allclose(on_mesh.logprobs_bn, expected.logprobs_bn, atol=1e-5)


def test_compiles_at_most_one_program_per_bucket(tiny_model):
    sampler, params = Sampler.for_model(
        tiny_model, pad_id=0, eos_ids=(), prompt_buckets=(8, 16), batch_buckets=(4,)
    )
    sampling = SamplingConfig(4, greedy=True)
    rng = np.random.default_rng(0)
    for length in (1, 3, 5, 8, 9, 12, 16, 2, 15):
        prompts = [list(rng.integers(1, 60, size=length)) for _ in range(int(rng.integers(1, 5)))]
        sampler.generate(params, prompts, sampling, jax.random.key(0))
    assert sampler.num_traces == 2


def test_bad_input_is_refused_with_a_reason(tiny_model):
    sampler, params = Sampler.for_model(tiny_model, pad_id=0, eos_ids=(), max_total_len=40)
    key = jax.random.key(0)
    with pytest.raises(ValueError, match="prompt 1 has 38 tokens.*context of 40.*truncate"):
        sampler.generate(params, [[1, 2], [3] * 38], SamplingConfig(4), key)
    out = sampler.generate(params, [[1, 2], [3] * 38], SamplingConfig(4), key, truncate=True)
    assert out.tokens_bn.shape == (2, 4)
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        sampler.generate(params, [[]], SamplingConfig(4), key)
    with pytest.raises(ValueError, match="temperature=0.*greedy=True"):
        SamplingConfig(4, temperature=0.0)
    with pytest.raises(ValueError, match="temperature=-1"):
        SamplingConfig(4, temperature=-1.0)
    for top_p in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match=r"top_p=.*\(0, 1\]"):
            SamplingConfig(4, top_p=top_p)
    with pytest.raises(ValueError, match="top_k=-1"):
        SamplingConfig(4, top_k=-1)


def test_mask_logits_matches_numpy():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(5, 40)).astype(np.float32)
    logits[0, :3] = logits[0, 3]  # a tie at the boundary
    for top_k, top_p in ((0, 1.0), (7, 1.0), (0, 0.6), (7, 0.6), (1, 1.0)):
        ours = np.asarray(mask_logits(jnp.asarray(logits), top_k, top_p))
        ref = logits.copy()
        if top_k:
            kth = np.sort(ref, axis=-1)[:, -top_k][:, None]
            ref[ref < kth] = -np.inf
        if top_p < 1:
            for row in ref:
                probs = np.exp(row - row.max())
                probs /= probs.sum()
                order = np.argsort(-row, kind="stable")
                before = np.cumsum(probs[order]) - probs[order]
                cutoff = row[order][before < top_p].min()
                row[row < cutoff] = -np.inf
        np.testing.assert_array_equal(np.isinf(ours), np.isinf(ref), err_msg=f"{top_k} {top_p}")
        np.testing.assert_array_equal(ours[~np.isinf(ours)], ref[~np.isinf(ref)])

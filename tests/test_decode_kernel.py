"""The in-place GPU decode attention (`jaxrl.models.decode_kernel`, the "pallas_gpu" form): in
Pallas interpret mode on the CPU, fp32, through the engine on a 2-layer GQA model (unrolled and
scanned layers), equal to the XLA form (greedy tokens identical, log-probs and a decode step's
logits within 1e-5), with a negative control (each row attending one key short) that moves the
logits by more than 1e-3; compiled for an H100 (with the CUDA plugin), the decode step holds no
transpose or copy of a cache-sized buffer."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from disk_cache import jax_cache_dir, jax_disk_cache  # noqa: F401  (fixtures)
from flax import nnx

from jaxrl.generation.engine import Engine, Request
from jaxrl.generation.sampling import SamplingConfig
from jaxrl.infra import sharding as ax
from jaxrl.infra.mesh import MeshConfig, make_mesh
from jaxrl.models import decode_kernel
from jaxrl.models.config import ModelConfig
from jaxrl.models.transformer import Transformer, decode_attention_form, init_cache

# The engines of these tests repeat programs (the per-layer-copy test's prefill and decode are the
# scanned-cache test's): with the disk cache on they are loaded, not compiled again. The same
# machine code: no result changes.
pytestmark = pytest.mark.usefixtures("jax_disk_cache")

PROMPTS = [[1, 5, 6, 7, 8, 9, 10, 11], [1, 20, 21], [1, 30, 31, 32, 33, 34]]
BUDGETS = [20, 9, 14]  # rows finish at different steps, at different lengths


@pytest.fixture(scope="module")
def gqa_model():
    # 4 query heads over 2 KV heads (G = 2), head dim 16, 2 layers.
    config = ModelConfig("llama", 64, 32, 64, 2, 4, 2, 16, max_position_embeddings=128)
    return Transformer(config, rngs=nnx.Rngs(0), init_std=0.3)


def _short_by_one(monkeypatch):
    """Makes the kernel attend each row's keys but its last (an off-by-one length)."""
    local = decode_kernel._local

    def short(layer, q, k, v, visible_bc, **kw):
        positions = jnp.arange(visible_bc.shape[1])
        last = jnp.max(jnp.where(visible_bc, positions[None, :], -1), axis=1)
        return local(layer, q, k, v, visible_bc & (positions[None, :] < last[:, None]), **kw)

    monkeypatch.setattr(decode_kernel, "_local", short)


def test_kernel_equals_reference_with_splits_padding_and_idle_rows():
    """The kernel against a NumPy softmax: several splits and blocks, a left-padded row, a cache
    with more rows than queries (idle slots are not read)."""
    rng = np.random.default_rng(0)
    b, c, k, g, d = 2, 64, 2, 2, 16
    q = rng.normal(size=(b, 1, k * g, d)).astype(np.float32)
    keys, values = (rng.normal(size=(b + 1, c, k, d)).astype(np.float32) for _ in range(2))
    visible = np.zeros((b, c), bool)
    visible[0, :40] = True
    visible[1, 5:17] = True  # left padding before the row's keys
    logits = np.einsum("bkgd,bskd->bkgs", q.reshape(b, k, g, d), keys[:b]) / np.sqrt(d)
    logits = np.where(visible[:, None, None, :], logits, -np.inf)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    ref = np.einsum("bkgs,bskd->bkgd", weights, values[:b]).reshape(b, 1, k * g, d)
    for block_k, splits in [(16, 2), (16, 1), (None, None)]:
        out = decode_kernel.decode_attention(
            jnp.asarray(q), jnp.asarray(keys), jnp.asarray(values), jnp.asarray(visible),
            interpret=True, block_k=block_k, splits=splits,
        )  # fmt: skip
        np.testing.assert_allclose(np.asarray(out), ref, atol=2e-6, rtol=1e-5)


def _decode_logits(model, form):
    """Logits of one decode step of 3 rows at their own lengths (13, 6, 9 keys written), and the
    cache it wrote, traced in `form`."""
    rng = np.random.default_rng(1)
    cache = init_cache(model.config, 3, 64)
    cache = tuple((c[0] + rng.normal(size=c[0].shape), c[1] + rng.normal(size=c[1].shape))
                  for c in cache)  # fmt: skip
    pos_s = jnp.asarray([12, 5, 8], jnp.int32)
    mask = (jnp.arange(64)[None, :] <= pos_s[:, None])[:, None, :]
    tokens = jnp.asarray([[3], [4], [5]], jnp.int32)
    with decode_attention_form(form):

        @jax.jit
        def step(cache):
            hidden, cache = model.hidden_states(tokens, pos_s[:, None], mask, cache, pos_s)
            return model.logits(hidden)[:, 0], cache

        return step(jax.tree.map(jnp.asarray, cache))


def _engine_run(model, form, layer_layout="auto", engine_out=None):
    greedy = SamplingConfig(max(BUDGETS), greedy=True)
    engine, params = Engine.for_model(
        model, num_slots=4, steps_per_call=4, layer_layout=layer_layout
    )
    for i, (p, n) in enumerate(zip(PROMPTS, BUDGETS, strict=True)):
        engine.submit(Request(i, p, 1, greedy, max_new_tokens=n))
    if engine_out is not None:
        engine_out.extend([engine, params])
    with decode_attention_form(form):
        return {g.request_id: g for g in engine.run(params, jax.random.key(0))}


def test_engine_kernel_form_equals_xla_form(gqa_model, monkeypatch):
    with jax.default_matmul_precision("highest"):
        ours_logits, ours_cache = _decode_logits(gqa_model, "pallas_gpu")
        xla_logits, xla_cache = _decode_logits(gqa_model, "xla")
        np.testing.assert_allclose(ours_logits, xla_logits, atol=1e-5, rtol=0)
        for a, b in zip(jax.tree.leaves(ours_cache), jax.tree.leaves(xla_cache), strict=True):
            # The same keys / values at the same positions (rounding: the projections fuse
            # differently around a scatter than around the XLA form's per-row update).
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
        ours, xla = _engine_run(gqa_model, "pallas_gpu"), _engine_run(gqa_model, "xla")
        for i in range(len(PROMPTS)):
            np.testing.assert_array_equal(ours[i].tokens_gn, xla[i].tokens_gn)
            np.testing.assert_allclose(ours[i].logprobs_gn, xla[i].logprobs_gn, atol=1e-5)
        # Negative control: one key short per row moves the logits well past the tolerance.
        _short_by_one(monkeypatch)
        short_logits, _ = _decode_logits(gqa_model, "pallas_gpu")
    assert float(jnp.abs(short_logits - xla_logits).max()) > 1e-3


def test_scanned_layers_decode_the_stacked_cache_in_place():
    """Scanned layers carry the stacked cache `[L, B, C, K, D]` through the layer loop and the
    kernel reads layer l of it: the engine's greedy run equals the XLA form's."""
    config = ModelConfig(
        "llama", 64, 32, 64, 2, 4, 2, 16, max_position_embeddings=128, scan_layers=True
    )
    model = Transformer(config, rngs=nnx.Rngs(0), init_std=0.3)
    with jax.default_matmul_precision("highest"):
        ours, xla = _engine_run(model, "pallas_gpu"), _engine_run(model, "xla")
    for i in range(len(PROMPTS)):
        np.testing.assert_array_equal(ours[i].tokens_gn, xla[i].tokens_gn)
        np.testing.assert_allclose(ours[i].logprobs_gn, xla[i].logprobs_gn, atol=1e-5)


def test_scanned_weights_decode_on_the_engines_per_layer_copy():
    """`layer_layout="unrolled"` (what a GPU engine does with scanned layers): the programs run
    the model unrolled on the engine's per-layer copy of the stacked weights, made once per
    weights object, and decode the same greedy tokens as the stacked layout."""
    config = ModelConfig(
        "llama", 64, 32, 64, 2, 4, 2, 16, max_position_embeddings=128, scan_layers=True
    )
    model = Transformer(config, rngs=nnx.Rngs(0), init_std=0.3)
    held = []
    with jax.default_matmul_precision("highest"):
        ours = _engine_run(model, "pallas_gpu", "unrolled", held)
        stacked = _engine_run(model, "xla", "stacked")
    for i in range(len(PROMPTS)):
        np.testing.assert_array_equal(ours[i].tokens_gn, stacked[i].tokens_gn)
        np.testing.assert_allclose(ours[i].logprobs_gn, stacked[i].logprobs_gn, atol=1e-5)
    engine, params = held
    programs = engine.programs
    assert programs.unstack and not programs.model_config.scan_layers
    copy = programs.engine_params(params)
    assert programs.engine_params(params) is copy  # made once for these weights
    layer_0 = copy["layers"][0]["attention"]["q_kernel"]
    np.testing.assert_array_equal(layer_0, params["layers"]["attention"]["q_kernel"][...][0])
    auto, _ = Engine.for_model(model, num_slots=4)  # "auto" copies on GPUs only
    assert not auto.programs.unstack and auto.programs.model_config.scan_layers
    with pytest.raises(ValueError, match="layer_layout='sideways'; use one of"):
        Engine.for_model(model, num_slots=4, layer_layout="sideways")


def _continued_on_mesh(model, form):
    """Two kept rows continued (their new token through the extension, then decoded) on a 2 x 2
    CPU mesh: rows split over dp, KV heads over tp (the kernel per device inside shard_map)."""
    mesh = make_mesh(MeshConfig(("dp", "tp"), (2, 2), num_devices=4))
    engine, params = Engine.for_model(
        model, num_slots=4, steps_per_call=4, max_total_len=64, prompt_buckets=(16, 32),
        keep_calls=2, mesh=mesh, rules=ax.GENERATOR_RULES,
    )  # fmt: skip
    greedy, key = SamplingConfig(6, greedy=True, ignore_eos=True), jax.random.key(3)
    with decode_attention_form(form):
        first = engine.generate(
            params, [Request(7, [1, 5, 9, 11], 2, greedy, keep_cache=True)], key
        )
        histories = [[1, 5, 9, 11, *first[0].tokens_gn[g].tolist(), 40 + g] for g in range(2)]
        requests = [
            Request(20 + g, h, 1, greedy, continues=(7, g)) for g, h in enumerate(histories)
        ]
        continued = engine.generate(params, requests, key)
    # One new token a row: the extension is itself a one-query step over the rows' views.
    assert engine.stats.continued_rows == 2 and engine.stats.extend_tokens == 2
    return [first[0], *continued]


def test_kernel_form_on_a_mesh_with_continued_rows(gqa_model):
    with jax.default_matmul_precision("highest"):
        ours, xla = (
            _continued_on_mesh(gqa_model, "pallas_gpu"),
            _continued_on_mesh(gqa_model, "xla"),
        )
    for a, b in zip(ours, xla, strict=True):
        np.testing.assert_array_equal(a.tokens_gn, b.tokens_gn)
        np.testing.assert_allclose(a.logprobs_gn, b.logprobs_gn, atol=1e-5)


def test_compiled_h100_decode_step_reads_the_cache_in_place():
    """The engine's decode step compiled for one H100: the Pallas kernel reads the cache, and no
    transpose, copy or slice fusion produces a buffer of a cache layer's size."""
    pytest.importorskip("jax_plugins.xla_cuda12", reason="AOT GPU tests need jax-cuda12-plugin")
    from jaxrl.infra import gpu
    from jaxrl.models.presets import rlbench_tiny
    from jaxrl.plan.programs import plan_generator

    config = rlbench_tiny(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=1, num_heads=4,
        num_kv_heads=2, head_dim=64, dtype="bfloat16", param_dtype="bfloat16", scan_layers=False,
    )  # fmt: skip
    mesh = make_mesh(MeshConfig(("dp", "tp"), (1, 1)), gpu.topology_devices("h100:1x1"))
    slots, prompt, completion = 16, 256, 256
    _, decode = plan_generator(
        config, mesh, num_slots=slots, samples=4, prompt_len=prompt, completion_len=completion,
        span=384,
    )  # fmt: skip
    text = decode.compiled.as_text()
    assert "__gpu$xla.gpu.triton" in text and "decode_attention_in_place" in text
    layer_bytes = slots * (prompt + completion) * 2 * 64 * 2  # one layer's keys, bf16
    cache_sized = []
    for line in text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%(\S+) = bf16\[([\d,]+)\]", line)
        if m and ("transpose" in m.group(1) or "copy" in m.group(1) or "slice" in m.group(1)):
            size = 2 * np.prod([int(x) for x in m.group(2).split(",")])
            if size >= layer_bytes // 2:
                cache_sized.append(m.group(1))
    # (The XLA form's step has 16 such buffers: slices of the prefix, transposes into the dot
    # layout and back, the write-back.)
    assert not cache_sized, cache_sized


def test_a_cache_the_kernel_cannot_tile_decodes_in_the_xla_form_and_says_so(gqa_model, capsys):
    """A GPU-form engine over a cache of 60 positions (not a multiple of 16): the steps run in
    the XLA form over a copied prefix, and the trace says so on stderr with the kernel's rule."""
    engine, params = Engine.for_model(gqa_model, num_slots=4, steps_per_call=4, max_total_len=60)
    engine.submit(Request(0, PROMPTS[0], 1, SamplingConfig(4, greedy=True)))
    with decode_attention_form("pallas_gpu"):
        (result,) = engine.run(params, jax.random.key(0))
    assert result.tokens_gn.shape == (1, 4)
    err = capsys.readouterr().err
    assert "[engine] decode over a cache of 60 positions (head dim 16) runs in the XLA form" in err
    assert "needs a cache length that is a multiple of 16" in err

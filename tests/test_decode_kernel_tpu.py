"""The in-place TPU decode attention (`jaxrl.models.decode_kernel_tpu`, the "pallas_tpu" form): in
Pallas interpret mode on the CPU, fp32, against a NumPy softmax (several blocks, a left-padded
row, idle rows past the queries, GQA, a stacked cache read at a layer index) and through the
engine on a 2-layer GQA model (unrolled and scanned layers), equal to the XLA form (greedy tokens
identical, log-probs and a decode step's logits within 1e-5), with a negative control (each row
attending one key short) that moves the logits by more than 1e-3; compiled for a v5p:2x2x1 slice
(with libtpu, no TPU attached), the engine's decode step runs the Mosaic kernel and holds no
transpose or copy of a cache-sized buffer."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_decode_kernel import PROMPTS, _decode_logits, _engine_run

from jaxrl.models import decode_kernel_tpu
from jaxrl.models.config import ModelConfig
from jaxrl.models.transformer import Transformer


def _reference(q, keys, values, visible):
    """NumPy softmax attention of q `[B, 1, H, D]` over `[>=B, C, K, D]` where `visible`
    (`[B, C]`), float64; a row that sees nothing gets zeros."""
    b, _, h, d = q.shape
    k = keys.shape[2]
    g = h // k
    q64, keys, values = (x.astype(np.float64) for x in (q, keys[:b], values[:b]))
    logits = np.einsum("bkgd,bskd->bkgs", q64.reshape(b, k, g, d), keys) / np.sqrt(d)
    logits = np.where(visible[:, None, None, :], logits, -np.inf)
    top = np.max(logits, -1, keepdims=True)
    weights = np.where(
        visible[:, None, None, :], np.exp(logits - np.where(np.isfinite(top), top, 0)), 0
    )
    weights /= np.maximum(weights.sum(-1, keepdims=True), 1e-300)
    return np.einsum("bkgs,bskd->bkgd", weights, values).reshape(b, 1, h, d)


def test_kernel_equals_reference():
    """Blocks of 16 over 64 positions and the default tiling (one block); rows: a prefix of 40
    keys, a left-padded row (keys 21..36: its first block sees nothing), a row that sees no key
    (zeros); the cache holds 2 idle rows past the queries (filled with NaN: read, they would
    poison the output). GQA G = 2 over K = 2, and K = 1 (the squeezed head axis); a stacked
    cache `[L, Bc, C, K, D]` read at layer 1 (layer 0 NaN)."""
    rng = np.random.default_rng(0)
    b, c, g, d = 3, 64, 2, 16
    visible = np.zeros((b, c), bool)
    visible[0, :40] = True
    visible[1, 21:37] = True
    for k in (2, 1):
        q = rng.normal(size=(b, 1, k * g, d)).astype(np.float32)
        keys, values = (rng.normal(size=(b + 2, c, k, d)).astype(np.float32) for _ in range(2))
        keys[b:], values[b:] = np.nan, np.nan
        ref = _reference(q, keys, values, visible)
        for block_k in (16, None):
            out = decode_kernel_tpu.decode_attention(
                jnp.asarray(q), jnp.asarray(keys), jnp.asarray(values), jnp.asarray(visible),
                interpret=True, block_k=block_k,
            )  # fmt: skip
            np.testing.assert_allclose(np.asarray(out), ref, atol=2e-6, rtol=1e-5)
        assert not np.asarray(out[2]).any()
    stacked_k, stacked_v = (np.stack([np.full_like(x, np.nan), x]) for x in (keys, values))
    out = decode_kernel_tpu.decode_attention(
        jnp.asarray(q), jnp.asarray(stacked_k), jnp.asarray(stacked_v), jnp.asarray(visible),
        layer=jnp.int32(1), interpret=True, block_k=16,
    )  # fmt: skip
    np.testing.assert_allclose(np.asarray(out), ref, atol=2e-6, rtol=1e-5)


def test_tiling_rule():
    assert [decode_kernel_tpu.blocks_for(n) for n in (1024, 384, 128, 64, 520, 1000, 100)] == [
        512, 128, 128, 64, None, None, None,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def gqa_model():
    # 4 query heads over 2 KV heads (G = 2), head dim 16, 2 layers.
    config = ModelConfig("llama", 64, 32, 64, 2, 4, 2, 16, max_position_embeddings=128)
    return Transformer(config, rngs=nnx.Rngs(0), init_std=0.3)


def _short_by_one(monkeypatch):
    """Makes the kernel attend each row's keys but its last (an off-by-one length)."""
    local = decode_kernel_tpu._local

    def short(layer, q, k, v, visible_bc, **kw):
        positions = jnp.arange(visible_bc.shape[1])
        last = jnp.max(jnp.where(visible_bc, positions[None, :], -1), axis=1)
        return local(layer, q, k, v, visible_bc & (positions[None, :] < last[:, None]), **kw)

    monkeypatch.setattr(decode_kernel_tpu, "_local", short)


def _count_kernel_traces(monkeypatch) -> list:
    """A list that grows by one each time the kernel is traced (it ran, not a fallback)."""
    traces, local = [], decode_kernel_tpu._local

    def counted(*args, **kw):
        traces.append(args[2].shape)
        return local(*args, **kw)

    monkeypatch.setattr(decode_kernel_tpu, "_local", counted)
    return traces


def _assert_engine_runs_equal(ours, xla):
    for i in range(len(PROMPTS)):
        np.testing.assert_array_equal(ours[i].tokens_gn, xla[i].tokens_gn)
        np.testing.assert_allclose(ours[i].logprobs_gn, xla[i].logprobs_gn, atol=1e-5)


def test_engine_kernel_form_equals_xla_form(gqa_model, monkeypatch):
    """Blocks of 16 / 32 positions (interpret mode tiles any divisor), so rows span several
    blocks and the clamped index maps and skipped blocks are exercised."""
    monkeypatch.setattr(decode_kernel_tpu, "BLOCKS", (16,))
    with jax.default_matmul_precision("highest"):
        ours_logits, ours_cache = _decode_logits(gqa_model, "pallas_tpu")
        xla_logits, xla_cache = _decode_logits(gqa_model, "xla")
        np.testing.assert_allclose(ours_logits, xla_logits, atol=1e-5, rtol=0)
        for a, b in zip(jax.tree.leaves(ours_cache), jax.tree.leaves(xla_cache), strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
        monkeypatch.setattr(decode_kernel_tpu, "BLOCKS", (32,))
        traces = _count_kernel_traces(monkeypatch)
        ours = _engine_run(gqa_model, "pallas_tpu")
        # The kernel ran over the whole cache (4 slots x 64 positions: 2 blocks of 32).
        assert traces and all(shape == (4, 64, 2, 16) for shape in traces)
        _assert_engine_runs_equal(ours, _engine_run(gqa_model, "xla"))
        # Negative control: one key short per row moves the logits well past the tolerance.
        _short_by_one(monkeypatch)
        short_logits, _ = _decode_logits(gqa_model, "pallas_tpu")
    assert float(jnp.abs(short_logits - xla_logits).max()) > 1e-3


def test_scanned_layers_decode_the_stacked_cache_in_place(monkeypatch):
    """Scanned layers carry the stacked cache `[L, B, C, K, D]` through the layer loop and the
    kernel reads layer l of it: the engine's greedy run equals the XLA form's."""
    traces = _count_kernel_traces(monkeypatch)
    config = ModelConfig(
        "llama", 64, 32, 64, 2, 4, 2, 16, max_position_embeddings=128, scan_layers=True
    )
    model = Transformer(config, rngs=nnx.Rngs(0), init_std=0.3)
    with jax.default_matmul_precision("highest"):
        ours = _engine_run(model, "pallas_tpu")
        assert traces and all(shape == (2, 4, 64, 2, 16) for shape in traces)
        _assert_engine_runs_equal(ours, _engine_run(model, "xla"))


def test_kernel_per_device_on_a_mesh():
    """On a 2 x 2 CPU mesh under the generator's rules the kernel runs per device inside
    shard_map: rows over dp (each device's rows index its own shard; rows past the queries and
    a row that sees nothing on each), KV heads over tp (one a device: the squeezed head axis);
    a stacked cache read at layer 1."""
    from jaxrl.infra import sharding as ax
    from jaxrl.infra.mesh import MeshConfig, make_mesh

    mesh = make_mesh(MeshConfig(("dp", "tp"), (2, 2), num_devices=4))
    rng = np.random.default_rng(2)
    b, c, k, g, d = 3, 64, 2, 2, 16
    visible = np.zeros((b, c), bool)
    visible[0, 3:30] = True
    visible[2, :50] = True  # row 1 sees nothing; cache row 3 is idle
    q = rng.normal(size=(b, 1, k * g, d)).astype(np.float32)
    keys, values = (rng.normal(size=(2, b + 1, c, k, d)).astype(np.float32) for _ in range(2))
    keys[:, b:], values[:, b:] = np.nan, np.nan
    ref = _reference(q, keys[1], values[1], visible)
    with ax.sharding_context(mesh, ax.GENERATOR_RULES):
        attend = jax.jit(
            lambda *xs: decode_kernel_tpu.decode_attention(
                *xs, layer=jnp.int32(1), interpret=True, block_k=16
            )
        )
        out = attend(*(jnp.asarray(x) for x in (q, keys, values, visible)))
    np.testing.assert_allclose(np.asarray(out), ref, atol=2e-6, rtol=1e-5)


def _cache_sized_copies(text: str, min_bytes: int) -> list[str]:
    """Compiled-HLO values from a transpose, copy or slice of at least `min_bytes` bf16."""
    found = []
    for line in text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%(\S+) = bf16\[([\d,]+)\]", line)
        if m and any(op in m.group(1) for op in ("transpose", "copy", "slice")):
            if 2 * np.prod([int(x) for x in m.group(2).split(",")]) >= min_bytes:
                found.append(m.group(1))
    return found


def _compiled_decode_step(scan_layers: bool, form: str):
    """The engine's decode step (16 slots, 1024 positions, one step a call) of a 2-layer bf16
    GQA model (8 query heads over 4 KV heads, head dim 128) compiled for v5p:2x2x1 in `form`:
    rows over dp = 2, KV heads over tp = 2 (the kernel per device inside shard_map)."""
    from jaxrl.generation.engine import Engine
    from jaxrl.generation.sampling import SamplingConfig
    from jaxrl.infra import sharding as ax
    from jaxrl.infra.mesh import MeshConfig, make_mesh
    from jaxrl.infra.tpu import topology_devices
    from jaxrl.models.presets import rlbench_tiny
    from jaxrl.models.transformer import decode_attention_form
    from jaxrl.plan.programs import abstract_params

    config = rlbench_tiny(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=8,
        num_kv_heads=4, head_dim=128, dtype="bfloat16", param_dtype="bfloat16",
        scan_layers=scan_layers,
    )  # fmt: skip
    mesh = make_mesh(MeshConfig(("dp", "tp"), (2, 2)), topology_devices("v5p:2x2x1"))
    graphdef, params = abstract_params(config, mesh, ax.GENERATOR_RULES)
    engine = Engine(
        graphdef, config, num_slots=16, pad_id=0, eos_ids=config.eos_token_ids,
        max_total_len=1024, steps_per_call=1, prompt_buckets=(256,), span_buckets=(1024,),
        mesh=mesh, rules=ax.GENERATOR_RULES, compile_only=True,
    )  # fmt: skip
    with decode_attention_form(form):
        return engine.lower_decode(params, SamplingConfig(max_new_tokens=768, ignore_eos=True))


# One device's layer of keys: 8 rows x 1024 positions x 2 KV heads x 128, bf16.
LAYER_BYTES = 8 * 1024 * 2 * 128 * 2


@pytest.mark.parametrize("scan_layers", [True])  # the stacked cache; unrolled: the same kernel
def test_compiled_tpu_decode_step_reads_the_cache_in_place(scan_layers):
    """On a TPU mesh "auto" is the kernel form: the decode step runs the Mosaic kernel, and no
    transpose, copy or slice produces a buffer of half a device's cache layer or more."""
    pytest.importorskip("libtpu", reason="AOT TPU tests need libtpu")
    lowered = _compiled_decode_step(scan_layers, "auto")
    assert "tpu_custom_call" in lowered.as_text()
    text = lowered.compile().as_text()
    assert "decode_attention_in_place_tpu" in text
    assert not _cache_sized_copies(text, LAYER_BYTES // 2)
    if not scan_layers:
        # The control: the XLA form's step copies the cache (16 such buffers here).
        xla_text = _compiled_decode_step(scan_layers, "xla").compile().as_text()
        assert "tpu_custom_call" not in xla_text
        assert _cache_sized_copies(xla_text, LAYER_BYTES // 2)

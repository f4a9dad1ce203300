"""The engine's KV cache on a long-context model: sized from the requests (the library's default
sampler no longer allocates slots x the whole context), grown mid-run with the same samples as a
fixed-length cache, and refused up front with the figures when it cannot fit; the plain install
carries what a chat template needs."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import re
import warnings

import jax
import numpy as np
import pytest
from flax import nnx
from packaging.requirements import Requirement

from jaxrl.generation import kv_memory
from jaxrl.generation.engine import Engine, Request
from jaxrl.generation.engine_sampler import EngineSampler
from jaxrl.generation.sampling import SamplingConfig
from jaxrl.models.config import ModelConfig
from jaxrl.models.transformer import Transformer

LONG_CONTEXT = 1 << 20  # 256 slots x this = 2^28 positions: 512 GiB of fp32 keys and values


@pytest.fixture(scope="module")
def long_model():
    config = ModelConfig(
        "llama", 64, 32, 64, 2, 4, 2, 16, max_position_embeddings=LONG_CONTEXT
    )  # 512 bytes of cache per slot-position
    return Transformer(config, rngs=nnx.Rngs(0), init_std=0.3)


def test_the_documented_colocated_sampler_on_a_long_context_model_fits(tmp_path):
    """docs/API.md's recipe: `Trainer.from_hf` + `colocated_sampler(trainer, tokenizer)` with its
    defaults (256 slots) on a model whose context is 2^20 tokens samples with a cache of the
    request's length (64 positions, 8 MiB), not 256 x 2^20 positions (512 GiB)."""
    from jaxrl.generation.placement import colocated_sampler
    from jaxrl.infra.mesh import MeshConfig, make_mesh
    from jaxrl.job.specs import PolicySpec, build_model_config
    from jaxrl.models import hf
    from jaxrl.tasks.tokenizer import build_arithmetic_tokenizer
    from jaxrl.train.trainer import OptimizerConfig, Trainer

    tokenizer = build_arithmetic_tokenizer()
    config = dataclasses.replace(
        build_model_config(PolicySpec(), tokenizer), max_position_embeddings=LONG_CONTEXT
    )
    hf.save_hf(Transformer(config, rngs=nnx.Rngs(0)), str(tmp_path), tokenizer=tokenizer)
    mesh = make_mesh(MeshConfig(("fsdp", "tp"), (1, 1), num_devices=1))
    trainer, state = Trainer.from_hf(str(tmp_path), OptimizerConfig(), total_steps=1, mesh=mesh)
    sampler = colocated_sampler(trainer, tokenizer)
    assert sampler.engine.num_slots == 256 and sampler.max_total_len == LONG_CONTEXT
    prompts = [tokenizer.encode("12+7="), tokenizer.encode("3+45=")]
    out = sampler.generate(
        state.params, prompts, SamplingConfig(8), jax.random.key(0), num_samples=4
    )
    assert out.tokens_bn.shape == (8, 8)
    assert sampler.engine.capacity == 64
    positions = {leaf.shape[-3] for leaf in jax.tree.leaves(sampler.engine._cache)}
    assert positions == {64}


def test_a_growing_cache_samples_what_a_fixed_one_does(long_model):
    """Requests longer than the cache, submitted mid-run while rows decode, grow it (64 -> 128
    positions, live rows kept); every token and log-prob equals a fixed 128-position engine's."""
    sampling = SamplingConfig(12, temperature=1.0)
    short = [Request(i, [1, 2 + i, 3], 2, sampling, max_new_tokens=8 + 2 * i) for i in range(3)]
    long = [Request(10 + i, list(range(1, 60 + i)), 2, sampling) for i in range(2)]

    def run(engine, params):
        for r in short:
            engine.submit(r)
        results, sizes = {}, []
        for group in engine.run(params, jax.random.key(3)):
            sizes.append(engine.capacity)
            if not results:  # the short rows are still decoding
                for r in long:
                    engine.submit(r)
            results[group.request_id] = group
        return results, sizes

    grown, params = Engine.for_model(long_model, num_slots=8, steps_per_call=4)
    fixed, _ = Engine.for_model(long_model, num_slots=8, steps_per_call=4, max_total_len=128)
    assert grown.capacity == 64 and grown.max_capacity == LONG_CONTEXT
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours, sizes = run(grown, params)
    # Growing copies the cache into a larger one: nothing donated that XLA cannot reuse.
    assert not [str(w.message) for w in caught if "donated buffers" in str(w.message)]
    ref, _ = run(fixed, params)
    assert sizes[0] == 64 and grown.capacity == 128  # 60 + 12 tokens: the next power of two
    assert sorted(ours) == sorted(ref) == [0, 1, 2, 10, 11]
    for rid, group in ours.items():
        np.testing.assert_array_equal(group.tokens_gn, ref[rid].tokens_gn)
        np.testing.assert_array_equal(group.logprobs_gn, ref[rid].logprobs_gn)


def test_a_cache_that_cannot_fit_is_refused_before_allocation(long_model, monkeypatch):
    """A fixed cache of 256 slots x the 2^20-token context (512 GiB) is refused when built, on
    this machine's real free memory; a growing one is refused when a request would grow it past
    the free memory, before anything is allocated, with the figures and the settings to change."""
    with pytest.raises(ValueError) as refused:
        Engine.for_model(long_model, num_slots=256, max_total_len=LONG_CONTEXT)
    message = str(refused.value)
    assert "needs 137.4 GB: 256 slots x 1048576 positions x 2 layers" in message
    for fix in ("GeneratorConfig.slots", "GeneratorConfig.max_len", "max_total_len="):
        assert fix in message
    assert re.search(r"the host's available memory is \d+\.\d GB", message)

    monkeypatch.setattr(kv_memory, "host_available_bytes", lambda: 100 * 2**20)  # 100 MiB
    sampler, params = EngineSampler.for_model(long_model, num_slots=256)
    out = sampler.generate(params, [[1, 2, 3]], SamplingConfig(8), jax.random.key(0))
    assert out.tokens_bn.shape == (1, 8)  # 256 x 64 positions: 8.4 MB fits
    cache = sampler.engine._cache
    with pytest.raises(ValueError, match=r"needs 268.4 MB: 256 slots x 2048 positions"):
        sampler.generate(params, [[1] * 1500], SamplingConfig(8), jax.random.key(0))
    assert sampler.engine.capacity == 64 and sampler.engine._cache is cache  # nothing grown
    assert kv_memory.cache_bytes(long_model.config, 256, 2048) == 268_435_456


def _unconditional_requirements(dist: str, seen: set[str]) -> set[str]:
    """`dist` and every distribution it needs without extras, recursively (lower-case names)."""
    name = dist.lower().replace("_", "-")
    if name in seen:
        return seen
    seen.add(name)
    for line in importlib.metadata.requires(dist) or ():
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            _unconditional_requirements(req.name, seen)
        except importlib.metadata.PackageNotFoundError:
            continue
    return seen


def test_the_plain_install_renders_chat_templates():
    """`apply_chat_template` (and `format_prompt` over it) imports jinja2, which transformers
    does not require: the plain install (no test extras, which bring it through torch) must."""
    from jaxrl.tasks.math_jsonl import format_prompt
    from jaxrl.tasks.tokenizer import build_arithmetic_tokenizer

    assert "jinja2" in _unconditional_requirements("jaxrl", set())
    tokenizer = build_arithmetic_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    text = format_prompt("1+2=", tokenizer, instruction=None)
    assert text == "<user>1+2=<assistant>"

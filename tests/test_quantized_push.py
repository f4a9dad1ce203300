"""The 8-bit weight push (`jaxrl.sync.quantized.QuantizingSync`): quantized on the trainer's
devices and moved device to device with no host round trip, exactly the kernels the generator
would have made itself, a quarter of an fp32 push's bytes, and an engine given the pushed tree
sampling exactly what an engine quantizing full-precision weights samples."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from jaxrl.generation import quantize
from jaxrl.generation.engine import Engine
from jaxrl.infra.mesh import MeshConfig, make_mesh
from jaxrl.infra.sharding import GENERATOR_RULES, TRAINER_RULES, param_shardings
from jaxrl.models.config import ModelConfig
from jaxrl.models.transformer import Transformer
from jaxrl.sync.in_process import WeightSync
from jaxrl.sync.quantized import QuantizingSync

TRAINER = MeshConfig(("fsdp", "tp"), (2, 2), first_device=0, num_devices=4)
GENERATOR = MeshConfig(("dp", "tp"), (1, 2), first_device=4, num_devices=2)
CONFIG = ModelConfig("llama", 64, 32, 64, 2, 4, 4, 8, max_position_embeddings=64)


def _guarded():
    return (
        jax.transfer_guard_host_to_device("disallow_explicit"),
        jax.transfer_guard_device_to_host("disallow_explicit"),
    )


@pytest.mark.parametrize("scan", [False, True])
def test_the_push_moves_the_generators_own_8bit_kernels(scan):
    config = CONFIG.replace(scan_layers=scan, tie_word_embeddings=False)
    model = Transformer(config, rngs=nnx.Rngs(0), init_std=0.3)
    abstract = nnx.state(model)
    trainer_mesh, gen_mesh = make_mesh(TRAINER), make_mesh(GENERATOR)
    trainer_s = nnx.to_pure_dict(param_shardings(abstract, trainer_mesh, TRAINER_RULES))
    gen_s = nnx.to_pure_dict(param_shardings(abstract, gen_mesh, GENERATOR_RULES))
    params = jax.device_put(nnx.to_pure_dict(abstract), trainer_s)
    fmt = quantize.resolve_format("int8", "cpu")
    sync = QuantizingSync(trainer_s, gen_s, config, fmt)
    full = WeightSync(trainer_s, gen_s)
    guards = _guarded()
    with guards[0], guards[1]:
        pushed, metrics = sync.push(params, 1)
        fp32, fp32_metrics = full.push(params, 1)
    print(f"[push] {fmt}: {metrics.params_bytes} bytes against fp32 {fp32_metrics.params_bytes}")
    assert metrics.params_bytes < 0.35 * fp32_metrics.params_bytes
    # Exactly the kernels the generator makes from the full-precision push.
    own = jax.jit(lambda p: quantize.quantize_params(p, config, fmt, scan))(fp32.params)
    is_q = lambda x: isinstance(x, quantize.QuantizedKernel)  # noqa: E731
    count = sum(map(is_q, jax.tree.leaves(pushed.params, is_leaf=is_q)))
    assert count == (7 if scan else 2 * 7) + 1  # 7 kernels a layer, and lm_head
    for got, want in zip(jax.tree.leaves(pushed.params), jax.tree.leaves(own), strict=True):
        assert got.dtype == want.dtype and got.sharding.mesh.devices.flat[0].id >= 4
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    if not scan:
        return
    # An engine on the generator's devices given the pushed tree (stacked layers: its per-layer
    # copy is made of the quantized kernels) runs on exactly the weights, and layout, of an
    # engine quantizing the full-precision push itself.
    copies = []
    for given in (pushed.params, fp32.params):
        engine, _ = Engine.for_model(
            model, num_slots=4, mesh=gen_mesh, rules=GENERATOR_RULES, weights="int8",
            layer_layout="unrolled",
        )  # fmt: skip
        copies.append(engine.programs.engine_params(given))
    got, want = (jax.tree.leaves(c) for c in copies)
    assert all(isinstance(k, int) for k in copies[0]["layers"])  # per-layer weights
    for a, b in zip(got, want, strict=True):
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim) and a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_which_runs_push_8bit():
    """`launch.rl` pushes 8-bit kernels only where nothing needs the full-precision weights on
    the generator: mismatch off, one process with both roles, no LoRA (adapters alone move)."""
    from types import SimpleNamespace

    from jaxrl.generation.placement import GeneratorConfig
    from launch.rl import quantized_push

    full = SimpleNamespace(lora=None)
    assert quantized_push(GeneratorConfig(weights="int8", mismatch="off"), "both", full)
    assert not quantized_push(GeneratorConfig(weights="int8"), "both", full)  # auto: measured
    assert not quantized_push(GeneratorConfig(mismatch="off"), "both", full)  # native
    assert not quantized_push(GeneratorConfig(weights="int8", mismatch="off"), "generator", full)
    lora = SimpleNamespace(lora=object())
    assert not quantized_push(GeneratorConfig(weights="int8", mismatch="off"), "both", lora)

"""WeightSync: generator params equal the trainer's (cast) after a push, with no host round trip
(checked by JAX's transfer guards, which also catch the naive pushes), and the peak memory
stays within the documented pause-and-swap bound."""

import contextlib
import functools
import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.infra.mesh import MeshConfig, make_mesh
from jaxrl.infra.sharding import GENERATOR_RULES, TRAINER_RULES, param_shardings
from jaxrl.models.config import ModelConfig
from jaxrl.models.transformer import Transformer
from jaxrl.sync.in_process import WeightSync
from jaxrl.sync.plan import GeneratorParams, live_bytes_by_device

# Small, but every weight is 2-D or 3-D and split like a real one; 4 heads so tp=4 divides.
CONFIG = ModelConfig("llama", 256, 64, 128, 2, 4, 4, 16)
TRAINER_2X2 = MeshConfig(("fsdp", "tp"), (2, 2), first_device=0, num_devices=4)
TRAINER_FSDP2 = MeshConfig(("fsdp", "tp"), (2, 1), first_device=0, num_devices=2)
GEN_DP2_TP2 = MeshConfig(("dp", "tp"), (2, 2), first_device=4, num_devices=4)
GEN_TP2 = MeshConfig(("dp", "tp"), (1, 2), first_device=4, num_devices=2)
GEN_TP4 = MeshConfig(("dp", "tp"), (1, 4), first_device=4, num_devices=4)
GEN_COLOCATED = MeshConfig(("dp", "tp"), (2, 2), first_device=0, num_devices=4)

PAIRS = {
    "2x2 fsdp-tp -> 2x2 dp-tp": (TRAINER_2X2, GEN_DP2_TP2, None),
    "4 -> 2": (TRAINER_2X2, GEN_TP2, None),
    "2 -> 4 with replicas": (TRAINER_FSDP2, GEN_DP2_TP2, None),
    "2 -> 4 finer than the trainer": (TRAINER_FSDP2, GEN_TP4, None),
    "fp32 -> bf16": (TRAINER_2X2, GEN_DP2_TP2, jnp.bfloat16),
    "colocated": (TRAINER_2X2, GEN_COLOCATED, None),
}


@contextlib.contextmanager
def no_host_round_trip():
    with (
        jax.transfer_guard_host_to_device("disallow_explicit"),
        jax.transfer_guard_device_to_host("disallow_explicit"),
    ):
        yield


@functools.cache
def _abstract_params() -> nnx.State:
    return nnx.split(nnx.eval_shape(lambda: Transformer(CONFIG, rngs=nnx.Rngs(0))))[1]


def _setup(trainer_config, generator_config, generator_rules=GENERATOR_RULES):
    """The Transformer's params (random values: no init compile) in the trainer layout."""
    abstract = _abstract_params()
    trainer_shardings = param_shardings(abstract, make_mesh(trainer_config), TRAINER_RULES)
    generator_shardings = param_shardings(abstract, make_mesh(generator_config), generator_rules)
    rng = np.random.default_rng(0)
    host = jax.tree.map(lambda a: rng.normal(size=a.shape).astype(a.dtype), abstract)
    return jax.device_put(host, trainer_shardings), trainer_shardings, generator_shardings


def _check_equal(trainer_params, generator: GeneratorParams, generator_shardings, dtype):
    expected = jax.tree.leaves(jax.device_get(trainer_params))
    got = jax.tree.leaves(generator.params)
    for want, array, sharding in zip(
        expected, got, jax.tree.leaves(generator_shardings), strict=True
    ):
        assert array.sharding.is_equivalent_to(sharding, array.ndim)
        assert array.dtype == (dtype or want.dtype)
        np.testing.assert_array_equal(np.asarray(array), want.astype(array.dtype))


@pytest.mark.parametrize("transport", ["assemble", "reshard"])
@pytest.mark.parametrize("pair", list(PAIRS))
def test_push_equals_trainer_without_host_round_trip(pair, transport):
    trainer_config, generator_config, dtype = PAIRS[pair]
    state, trainer_shardings, generator_shardings = _setup(trainer_config, generator_config)
    sync = WeightSync(
        trainer_shardings,
        generator_shardings,
        generator_dtype=dtype,
        chunk_bytes=64 << 10,
        transport=transport,
    )
    with no_host_round_trip():
        first, _ = sync.push(state, 1)
        second, metrics = sync.push(state, 2, first)
    assert second.version == 2 and metrics.version == 2
    assert metrics.num_chunks > 1 and metrics.bytes_moved >= metrics.params_bytes > 0
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(first.params))  # swapped out
    _check_equal(state, second, generator_shardings, dtype)


def test_push_toy_pytree_and_same_layout_is_a_plain_device_put():
    trainer_mesh = make_mesh(TRAINER_2X2)
    generator_mesh = make_mesh(MeshConfig(("fsdp", "tp"), (2, 2), first_device=4, num_devices=4))
    specs = {"w_ehd": ("fsdp", "tp", None), "w_fe": ("tp", "fsdp"), "scale": (None,)}
    shapes = {"w_ehd": (8, 4, 6), "w_fe": (12, 8), "scale": (8,)}
    trainer = {k: jax.NamedSharding(trainer_mesh, jax.P(*v)) for k, v in specs.items()}
    generator = {k: jax.NamedSharding(generator_mesh, jax.P(*v)) for k, v in specs.items()}
    params = {
        k: jax.device_put(np.random.default_rng(0).normal(size=shapes[k]), trainer[k])
        for k in specs
    }
    sync = WeightSync(trainer, generator, generator_dtype=jnp.bfloat16)
    assert {route.kind for route in sync.plan(params).routes} == {"device_put"}
    with no_host_round_trip():
        pushed, _ = sync.push(params, 0)
    _check_equal(params, pushed, generator, jnp.bfloat16)


def test_guards_catch_the_naive_pushes():
    """Negative control: the guards used above do reject host round trips. (On CPU, device
    buffers are host memory: reads are zero-copy and the device-to-host guard never fires, so
    the host-to-device half of the round trip is what trips.)"""
    state, trainer_shardings, generator_shardings = _setup(TRAINER_2X2, GEN_DP2_TP2)
    # mlp.up_kernel: trainer P('fsdp', 'tp') -> generator P(None, 'tp'), a layout change.
    leaf = state["layers"][0]["mlp"]["up_kernel"].get_value()
    target = generator_shardings["layers"][0]["mlp"]["up_kernel"].get_value()
    assert target.spec == jax.P(None, "tp")
    with no_host_round_trip():
        with pytest.raises(Exception, match="Disallowed (host-to-device|device-to-host)"):
            jax.block_until_ready(jax.device_put(jax.device_get(leaf), target))
        with pytest.raises(Exception, match="Disallowed host-to-device"):
            jax.block_until_ready(jax.device_put(leaf, target))
        # ...while a slice-for-slice device_put passes the same guards.
        same = jax.NamedSharding(make_mesh(GEN_DP2_TP2), jax.P("dp", "tp"))
        jax.block_until_ready(jax.device_put(leaf, same))


def _probe_push(sync, state, version, previous):
    """Pushes and returns (plan, per-chunk rises in live bytes per device, rise after)."""
    gc.collect()
    before = live_bytes_by_device()
    rises = []

    def probe(_):
        now = live_bytes_by_device()
        rises.append({d: now.get(d, 0) - before.get(d, 0) for d in now})

    with no_host_round_trip():
        pushed, metrics = sync.push(state, version, previous, on_chunk=probe)
    now = live_bytes_by_device()
    after = {d: now.get(d, 0) - before.get(d, 0) for d in set(now) | set(before)}
    return pushed, metrics, rises, after


@pytest.mark.parametrize("transport", ["assemble", "reshard"])
def test_pause_and_swap_peak_is_params_plus_one_chunk(transport):
    state, trainer_shardings, generator_shardings = _setup(TRAINER_2X2, GEN_DP2_TP2)
    chunk_bytes = 48 << 10
    sync = WeightSync(
        trainer_shardings, generator_shardings, chunk_bytes=chunk_bytes, transport=transport
    )
    plan = sync.plan(state)
    largest_leaf = max(max(route.extra_bytes.values()) for route in plan.routes)
    assert plan.peak_extra_bytes <= max(chunk_bytes, largest_leaf)
    first, _ = sync.push(state, 0)
    pushed, metrics, rises, after = _probe_push(sync, state, 1, first)
    assert len(rises) == metrics.num_chunks == len(plan.chunks) > 3
    for rise, bound in zip(rises, plan.chunk_extra_bytes, strict=True):
        # At each chunk's high-water mark: old params + that chunk's new shards and temporaries.
        assert max(rise.values()) <= bound <= max(chunk_bytes, largest_leaf)
    assert max(max(r.values()) for r in rises) == plan.peak_extra_bytes  # exact accounting
    generator_params = sum(x.nbytes for x in jax.tree.leaves(pushed.params))
    assert max(max(r.values()) for r in rises) < generator_params / 4  # far from a 2nd copy
    assert max(after.values()) <= 0  # the new params exactly replaced the old ones


def test_double_buffer_keeps_previous_until_deleted():
    state, trainer_shardings, generator_shardings = _setup(TRAINER_2X2, GEN_DP2_TP2)
    sync = WeightSync(
        trainer_shardings, generator_shardings, chunk_bytes=48 << 10, strategy="double_buffer"
    )
    first, _ = sync.push(state, 0)
    pushed, _, _, after = _probe_push(sync, state, 1, first)
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(first.params))
    per_device = {}
    for leaf in jax.tree.leaves(pushed.params):
        for shard in leaf.addressable_shards:
            per_device[shard.device.id] = per_device.get(shard.device.id, 0) + shard.data.nbytes
    for device, nbytes in per_device.items():
        assert after[device] == nbytes  # peak = 2x params on the generator
    first.delete()
    _check_equal(state, pushed, generator_shardings, None)


def test_push_fails_fast_and_loudly():
    state, trainer_shardings, generator_shardings = _setup(TRAINER_2X2, GEN_DP2_TP2)
    sync = WeightSync(trainer_shardings, generator_shardings, chunk_bytes=48 << 10)
    first, _ = sync.push(state, 3)
    with pytest.raises(ValueError, match="must increase"):
        sync.push(state, 3, first)
    with pytest.raises(ValueError, match="sharding"):
        sync.push(jax.device_put(state, generator_shardings), 4, first)

    def fail(chunk_index):
        if chunk_index == 1:
            raise OSError("link down")

    with pytest.raises(RuntimeError, match="no complete weights"):
        sync.push(state, 4, first, on_chunk=fail)
    with pytest.raises(ValueError, match="already freed"):
        sync.push(state, 5, first)
    with pytest.raises(ValueError, match="structure"):
        WeightSync(trainer_shardings, {"a": generator_shardings})

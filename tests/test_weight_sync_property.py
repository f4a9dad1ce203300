"""Property test of the in-process WeightSync: random legal layout pairs
(`layouts_for_tests.py`: mesh shapes, axis names and device orders, device subsets of the 8
simulated devices that may overlap, replicas, parameter and generator dtypes), both transports,
pushed twice (the second time over the first result) under JAX's host-to-device and
device-to-host transfer guards. Every generator leaf must be bitwise the trainer's (after the
cast) and on the generator's sharding. A failure prints the case (its seed rebuilds it)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from layouts_for_tests import describe, host_params, make_case, shardings

from jaxrl.sync.in_process import WeightSync

NUM_CASES = 50
SEED0 = 20261201


def _expected(host: dict, dtype: str | None) -> dict:
    return {k: (v.astype(jnp.dtype(dtype)) if dtype else v) for k, v in host.items()}


def push_twice_and_check(case, transport: str) -> None:
    devices = jax.devices()
    trainer, generator = shardings(case, devices, "trainer"), shardings(case, devices, "generator")
    host = host_params(case)
    params = jax.device_put(host, trainer)  # set-up, outside the guards
    later = jax.device_put({k: v + np.asarray(1, v.dtype) for k, v in host.items()}, trainer)
    strategy = "double_buffer" if case.seed % 2 else "swap"
    sync = WeightSync(
        trainer,
        generator,
        generator_dtype=case.generator_dtype,
        transport=transport,
        strategy=strategy,
        chunk_bytes=int(np.random.default_rng(case.seed).choice([256, 4096, 1 << 20])),
    )
    with (
        jax.transfer_guard_host_to_device("disallow_explicit"),
        jax.transfer_guard_device_to_host("disallow_explicit"),
    ):
        first, _ = sync.push(params, 1)
        second, metrics = sync.push(later, 2, previous=first)
    assert metrics.version == 2 and second.version == 2
    for pushed, values in ((second, later), (first, params)):
        if strategy == "swap" and pushed is first:
            assert all(leaf.is_deleted() for leaf in jax.tree.leaves(first.params))
            continue
        want = _expected(jax.device_get(values), case.generator_dtype)
        for name, array in pushed.params.items():
            assert array.sharding.is_equivalent_to(generator[name], array.ndim), name
            assert array.dtype == want[name].dtype, (name, array.dtype, want[name].dtype)
            np.testing.assert_array_equal(
                np.asarray(array).view(np.uint8), want[name].view(np.uint8), err_msg=name
            )
    second.delete()


@pytest.mark.parametrize("transport", ["reshard", "assemble"])
def test_random_layout_pairs_push_exactly(transport):
    failures = []
    for seed in range(SEED0, SEED0 + NUM_CASES):
        case = make_case(seed, len(jax.devices()))
        try:
            push_twice_and_check(case, transport)
        except Exception as error:  # collect, so one run names every failing case
            failures.append(f"{describe(case)}\n  -> {type(error).__name__}: {error}"[:1500])
    assert not failures, f"{len(failures)} of {NUM_CASES} cases failed:\n" + "\n".join(failures)


def test_the_issue_repro_pushes_exactly_with_both_transports():
    """fsdp 2 x tp 2 on devices 0-3 -> tp 4 on devices 4-7: the reshard transport's shadow
    layout once listed the trainer's devices in another order than its input, which one jit
    cannot do ("Received incompatible devices for jitted computation")."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    d = jax.devices()
    trainer = NamedSharding(Mesh(np.array(d[:4]).reshape(2, 2), ("fsdp", "tp")), P("fsdp", "tp"))
    generator = NamedSharding(Mesh(np.array(d[4:8]).reshape(1, 4), ("dp", "tp")), P(None, "tp"))
    host = np.arange(96 * 136, dtype=np.float32).reshape(96, 136)
    x = jax.device_put(host, trainer)
    for transport in ("reshard", "assemble"):
        for dtype in (None, jnp.bfloat16):
            sync = WeightSync({"w": trainer}, {"w": generator}, transport=transport,
                              generator_dtype=dtype)  # fmt: skip
            pushed, _ = sync.push({"w": x}, 1)
            got = pushed.params["w"]
            assert got.sharding.is_equivalent_to(generator, 2)
            np.testing.assert_array_equal(np.asarray(got), host.astype(dtype or np.float32))

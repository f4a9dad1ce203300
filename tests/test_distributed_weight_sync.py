"""Cross-process weight sync in a real 2-process job (`launch.local_cluster`, 4 CPU devices per
process, gloo): after a push the generator holds exactly the trainer's values, for both
transports, with (a) the trainer on process 0 and the generator on process 1 and (b) both
meshes spanning both processes, and JAX's transfer guards see no host round trip. The params
are the test Transformer's (one layer), laid out by the trainer's and the generator's rules
tables (real layout changes: 2x2 fsdp-tp -> 2x2 dp-tp, and -> 1x2 dp-tp in bf16).

Run as a script, this file is the worker each process executes.
"""

from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLUSTER_TIMEOUT_S = 100

LAYOUTS = ("split", "span")
# Random layout pairs (tests/layouts_for_tests.py) per transport, pushed across the processes.
RANDOM_CASES = 5
# (transport, generator dtype, generator device count) pushed in each layout; the bf16 one on
# fewer generator devices than trainer devices in the split layout only (each case ~3 s).
CASES = {
    "split": (("device_put", None, 4), ("ppermute", None, 4), ("device_put", "bfloat16", 2)),
    "span": (("device_put", None, 4), ("ppermute", None, 4)),
}


def run_cluster(
    args,
    *,
    script=__file__,
    num_processes=2,
    devices_per_process=4,
    timeout_s=CLUSTER_TIMEOUT_S,
    heartbeat_timeout_s=5,
):
    """Runs `script`'s worker (default: this file's) under launch.local_cluster with a hard
    timeout; returns the CompletedProcess (output lines prefixed "[process id] ")."""
    command = [
        sys.executable, "-m", "launch.local_cluster",
        "--num_processes", str(num_processes),
        "--devices_per_process", str(devices_per_process),
        "--timeout_s", str(timeout_s),
        "--heartbeat_timeout_s", str(heartbeat_timeout_s),
        "--initialization_timeout_s", "30",
        "--",
        sys.executable, os.path.abspath(script), *args,
    ]  # fmt: skip
    return subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=timeout_s + 20, check=False
    )


def test_push_across_processes_equals_trainer():
    result = run_cluster(LAYOUTS)  # one job for all cases: a job's start-up is most of its cost
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    for layout in LAYOUTS:
        for transport, dtype, count in CASES[layout]:
            for process in (0, 1):
                line = f"[{process}] OK {layout} {transport} {dtype} {count}"
                assert line in output, output[-6000:]


def test_random_layout_pairs_across_processes():
    """The in-process property test's random layouts (any device subsets and orders of the 8
    devices of the job, so roles span processes or not, overlap or not) through
    CrossProcessWeightSync, each transport on the cases it takes."""
    result = run_cluster(["random"])
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    for transport in ("device_put", "ppermute"):
        for process in (0, 1):
            done = [
                line
                for line in output.splitlines()
                if line.startswith(f"[{process}] OK random {transport} ")
            ]
            assert len(done) == RANDOM_CASES, output[-6000:]


def _random_cases(num_devices: int):
    """The first RANDOM_CASES layout cases each transport takes ("ppermute": disjoint roles,
    trainer device count a multiple of the generator's)."""
    from layouts_for_tests import make_case

    out = {"device_put": [], "ppermute": []}
    seed = 20261201
    while min(len(v) for v in out.values()) < RANDOM_CASES:
        case = make_case(seed, num_devices)
        seed += 1
        n_t, n_g = len(case.trainer[0]), len(case.generator[0])
        if len(out["device_put"]) < RANDOM_CASES:
            out["device_put"].append(case)
        elif not set(case.trainer[0]) & set(case.generator[0]) and n_t % n_g == 0:
            if len(out["ppermute"]) < RANDOM_CASES:
                out["ppermute"].append(case)
    return out


def _push_random(info) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from layouts_for_tests import describe, host_params, shardings

    from jaxrl.sync.cross_process import CrossProcessWeightSync

    devices = jax.devices()
    for transport, cases in _random_cases(len(devices)).items():
        for case in cases:
            trainer = shardings(case, devices, "trainer")
            generator = shardings(case, devices, "generator")
            host = host_params(case)
            later = {k: v + np.asarray(1, v.dtype) for k, v in host.items()}

            def place(values, trainer=trainer):
                return {
                    k: jax.make_array_from_callback(
                        v.shape, trainer[k], lambda i, v=v: v[i], dtype=v.dtype
                    )
                    for k, v in values.items()
                }

            params, params_later = place(host), place(later)
            sync = CrossProcessWeightSync(
                trainer,
                generator,
                generator_dtype=case.generator_dtype,
                chunk_bytes=1024,
                transport=transport,
                barrier_timeout_s=30,
            )
            try:
                with (
                    jax.transfer_guard_host_to_device("disallow_explicit"),
                    jax.transfer_guard_device_to_host("disallow_explicit"),
                ):
                    first, _ = sync.push(params, 1)
                    second, _ = sync.push(params_later, 2, first)
                for name, array in second.params.items():
                    want = later[name]
                    want = (
                        want.astype(jnp.dtype(case.generator_dtype))
                        if case.generator_dtype
                        else want
                    )
                    assert array.sharding.is_equivalent_to(generator[name], array.ndim), name
                    assert array.dtype == want.dtype, (name, array.dtype)
                    for shard in array.addressable_shards:
                        np.testing.assert_array_equal(
                            np.asarray(shard.data).view(np.uint8), want[shard.index].view(np.uint8)
                        )
            except Exception as error:
                raise AssertionError(f"{transport}\n{describe(case)}") from error
            second.delete()
            print(f"OK random {transport} {case.seed}", flush=True)


def _worker(layouts) -> None:
    from jaxrl.infra.distributed import initialize_from_env

    info = initialize_from_env()
    import jax
    import numpy as np
    from flax import nnx

    from jaxrl.models.config import ModelConfig
    from jaxrl.models.transformer import Transformer

    assert jax.process_count() == 2 and jax.local_device_count() == 4
    if layouts == ["random"]:
        return _push_random(info)
    config = ModelConfig("llama", 256, 64, 128, 1, 4, 4, 16)  # 1 layer: fewer jits
    abstract = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))[1]
    rng = np.random.default_rng(0)  # the same values on every process
    host = jax.tree.map(lambda a: rng.normal(size=a.shape).astype(a.dtype), abstract)
    by_process = [jax.local_devices(process_index=p) for p in range(2)]
    for layout in layouts:
        if layout == "split":  # trainer = process 0, generator = process 1
            trainer_devices, gen_devices = by_process[0], by_process[1]
        else:  # each role has two devices on each process
            trainer_devices = by_process[0][:2] + by_process[1][:2]
            gen_devices = by_process[0][2:] + by_process[1][2:]
        _push_and_check(layout, trainer_devices, gen_devices, abstract, host, info)


def _push_and_check(layout, trainer_devices, gen_devices, abstract, host, info) -> None:
    import jax
    import numpy as np

    from jaxrl.infra.mesh import MeshConfig, make_mesh
    from jaxrl.infra.sharding import GENERATOR_RULES, TRAINER_RULES, param_shardings
    from jaxrl.sync.cross_process import CrossProcessWeightSync

    trainer_mesh = make_mesh(
        MeshConfig(
            ("fsdp", "tp"),
            (2, 2),
            device_indices=tuple(jax.devices().index(d) for d in trainer_devices),
        )
    )
    trainer_shardings = param_shardings(abstract, trainer_mesh, TRAINER_RULES)
    params = jax.tree.map(
        lambda x, s: jax.make_array_from_callback(x.shape, s, lambda i: x[i], dtype=x.dtype),
        host,
        trainer_shardings,
    )
    for transport, dtype, count in CASES[layout]:
        ids = tuple(jax.devices().index(d) for d in gen_devices[:count])
        gen_mesh = make_mesh(MeshConfig(("dp", "tp"), (count // 2, 2), device_indices=ids))
        gen_shardings = param_shardings(abstract, gen_mesh, GENERATOR_RULES)
        sync = CrossProcessWeightSync(
            trainer_shardings,
            gen_shardings,
            generator_dtype=dtype,
            chunk_bytes=64 << 10,
            transport=transport,
            barrier_timeout_s=30,
        )
        plan = sync.plan(params)
        if layout == "split":  # all crosses; "device_put" sends each block once per process
            once = plan.params_bytes if transport == "device_put" else plan.bytes_moved
            assert plan.cross_process_bytes == once, (plan.cross_process_bytes, once)
        first, _ = sync.push(params, 1)
        with (  # no host round trip on any process, as JAX's transfer guards count it
            jax.transfer_guard_host_to_device("disallow_explicit"),
            jax.transfer_guard_device_to_host("disallow_explicit"),
        ):
            second, metrics = sync.push(params, 2, first)
        assert metrics.version == 2 and metrics.num_chunks > 1, metrics
        assert all(leaf.is_deleted() for leaf in jax.tree.leaves(first.params))  # swapped out
        for want, array, sharding in zip(
            jax.tree.leaves(host),
            jax.tree.leaves(second.params),
            jax.tree.leaves(gen_shardings),
            strict=True,
        ):
            assert array.sharding.is_equivalent_to(sharding, array.ndim)
            assert array.dtype == (dtype or want.dtype), (array.dtype, dtype)
            assert len(array.addressable_shards) == len(
                [d for d in sharding.device_set if d.process_index == info.process_index]
            )
            for shard in array.addressable_shards:
                expected = want[shard.index].astype(array.dtype)
                np.testing.assert_array_equal(np.asarray(shard.data), expected)
        second.delete()
        print(f"OK {layout} {transport} {dtype} {count}", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # layouts_for_tests
    _worker(sys.argv[1:])

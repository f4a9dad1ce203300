"""The multi-process plumbing that needs no second process: DistributedConfig from / to the
environment and its validation, `initialize` refusing to run late, `check_mesh_fits`, and the
cross-process weight sync's planning and pushes inside this one process (8 CPU devices: the
same code paths minus the transfers between processes, no host round trip)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.infra import distributed
from jaxrl.infra.distributed import DistributedConfig, ProcessLayoutError
from jaxrl.infra.mesh import MeshConfig, make_mesh
from jaxrl.sync.cross_process import CrossProcessWeightSync, make_weight_sync
from jaxrl.sync.in_process import WeightSync


def test_config_round_trips_through_the_environment():
    config = DistributedConfig(
        coordinator_address="10.0.0.1:1234",
        num_processes=4,
        process_id=3,
        local_device_ids=(0, 1),
        initialization_timeout_s=30,
        heartbeat_timeout_s=10,
        transfer_address="10.0.0.2:5555",
    )
    env = config.to_env()
    assert env["JAXRL_PROCESS_ID"] == "3" and env["JAXRL_LOCAL_DEVICE_IDS"] == "0,1"
    assert DistributedConfig.from_env(env) == config
    assert DistributedConfig.from_env({}) == DistributedConfig()
    assert DistributedConfig.from_env({}).single_process  # no SLURM / MPI / TPU here


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_processes": 2, "process_id": 2}, "process ids run from 0 to 1"),
        ({"coordinator_address": "host", "num_processes": 2, "process_id": 0}, "'host:port'"),
        ({"coordinator_address": "h:1", "num_processes": 2}, "process_id is not"),
        ({"heartbeat_timeout_s": 0}, "heartbeat_timeout_s=0 must be >= 1"),
    ],
)
def test_config_errors_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DistributedConfig(**kwargs).validate()


def test_launcher_flags_are_taken_out_of_argv():
    argv = ["--workdir=/tmp/run", "--num_processes=2", "--process_id", "1", "--gin_file=a.gin"]
    argv += ["--coordinator_address=10.0.0.1:1234", "--local_device_ids=0,1"]
    overrides, rest = distributed.parse_distributed_flags(argv)
    assert rest == ["--workdir=/tmp/run", "--gin_file=a.gin"]
    assert overrides == {
        "num_processes": 2,
        "process_id": 1,
        "coordinator_address": "10.0.0.1:1234",
        "local_device_ids": (0, 1),
    }
    # No distributed flags or variables: a single-process run, argv passes through.
    assert distributed.initialize_from_argv(["--workdir=w"]) == ["--workdir=w"]


def test_from_env_rejects_bad_values():
    with pytest.raises(ValueError, match="JAXRL_NUM_PROCESSES='two'"):
        DistributedConfig.from_env({"JAXRL_NUM_PROCESSES": "two"})


def test_initialize_single_process_is_a_no_op_and_late_multi_process_is_refused():
    assert distributed.initialize(DistributedConfig(num_processes=1)).process_count == 1
    late = DistributedConfig(coordinator_address="127.0.0.1:1", num_processes=2, process_id=0)
    with pytest.raises(distributed.DistributedError, match="call it first thing"):
        distributed.initialize(late)  # conftest already started the backend
    distributed.barrier("single process: returns at once")


def test_check_mesh_fits():
    fits = {
        "trainer": MeshConfig(("fsdp", "tp"), (2, 2), first_device=0, num_devices=4),
        "generator": MeshConfig(("dp", "tp"), (2, 2), first_device=4, num_devices=4),
    }
    distributed.check_mesh_fits(fits)
    too_big = {"generator": MeshConfig(("dp", "tp"), (2, 2), first_device=6, num_devices=4)}
    with pytest.raises(ProcessLayoutError, match=r"uses devices \[6, 10\), but this job has 1"):
        distributed.check_mesh_fits(too_big)


def _toy(trainer_config, generator_config):
    trainer_mesh, gen_mesh = make_mesh(trainer_config), make_mesh(generator_config)
    specs = {"w_ehd": ("fsdp", "tp", None), "w_fe": ("tp", "fsdp"), "scale": (None,)}
    gen_specs = {"w_ehd": (None, "tp", None), "w_fe": ("tp", None), "scale": (None,)}
    shapes = {"w_ehd": (8, 4, 6), "w_fe": (12, 8), "scale": (8,)}
    trainer = {k: jax.NamedSharding(trainer_mesh, jax.P(*v)) for k, v in specs.items()}
    generator = {k: jax.NamedSharding(gen_mesh, jax.P(*v)) for k, v in gen_specs.items()}
    rng = np.random.default_rng(0)
    host = {k: rng.normal(size=shapes[k]).astype(np.float32) for k in specs}
    return jax.device_put(host, trainer), host, trainer, generator


TRAINER = MeshConfig(("fsdp", "tp"), (2, 2), first_device=0, num_devices=4)
GENERATOR = MeshConfig(("dp", "tp"), (2, 2), first_device=4, num_devices=4)


@pytest.mark.parametrize("transport", ["device_put", "ppermute"])
def test_cross_process_sync_in_one_process_equals_trainer(transport):
    params, host, trainer, generator = _toy(TRAINER, GENERATOR)
    sync = CrossProcessWeightSync(
        trainer, generator, generator_dtype=jnp.bfloat16, chunk_bytes=128, transport=transport
    )
    assert sync.plan(params).cross_process_bytes == 0
    with (
        jax.transfer_guard_host_to_device("disallow_explicit"),
        jax.transfer_guard_device_to_host("disallow_explicit"),
    ):
        first, _ = sync.push(params, 1)
        second, metrics = sync.push(params, 2, first)
    assert metrics.num_chunks > 1 and metrics.bytes_moved >= metrics.params_bytes
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(first.params))
    for k, array in second.params.items():
        assert array.sharding.is_equivalent_to(generator[k], array.ndim)
        np.testing.assert_array_equal(np.asarray(array), host[k].astype(jnp.bfloat16))


def test_ppermute_errors_name_the_fix():
    params, _, trainer, generator = _toy(TRAINER, MeshConfig(("dp", "tp"), (1, 3), 4, 3))
    with pytest.raises(ValueError, match="multiple of it; use transport='device_put'"):
        CrossProcessWeightSync(trainer, generator, transport="ppermute").plan(params)
    params, _, trainer, generator = _toy(TRAINER, MeshConfig(("dp", "tp"), (2, 2), 2, 4))
    with pytest.raises(ValueError, match=r"disjoint trainer and generator devices, but \[2, 3\]"):
        CrossProcessWeightSync(trainer, generator, transport="ppermute").plan(params)


def test_make_weight_sync_picks_the_in_process_class_in_one_process():
    _, _, trainer, generator = _toy(TRAINER, GENERATOR)
    assert isinstance(make_weight_sync(trainer, generator, transport="assemble"), WeightSync)

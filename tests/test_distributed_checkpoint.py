"""Orbax checkpoints in a 2-process job: both processes write their shards of a pytree sharded
over both processes' devices (jaxrl.infra.checkpoint.Checkpointer), the job ends, a new job with
the same process layout restores it: equal values, the requested shardings, the JSON state.

Run as a script, this file is the worker each process executes.
"""

from __future__ import annotations

import os
import sys

from test_distributed_weight_sync import run_cluster


def test_checkpoint_written_by_all_processes_restores_in_a_new_job(tmp_path):
    directory = str(tmp_path / "checkpoints")
    for mode in ("save", "restore"):
        result = run_cluster([mode, directory], script=os.path.abspath(__file__))
        output = result.stdout + result.stderr
        assert result.returncode == 0, output[-6000:]
        for process in (0, 1):
            assert f"[{process}] OK {mode}" in output, output[-6000:]
    # Each process wrote its own shards (Orbax's OCDBT layout: one directory per process).
    written = os.listdir(os.path.join(directory, "7", "state"))
    assert {"ocdbt.process_0", "ocdbt.process_1"} <= set(written), written


def _worker(mode: str, directory: str) -> None:
    from jaxrl.infra.distributed import initialize_from_env

    initialize_from_env()
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxrl.infra.checkpoint import CheckpointConfig, Checkpointer

    mesh = jax.make_mesh((4, 2), ("fsdp", "tp"), devices=jax.devices())  # spans both processes
    shardings = {
        "w": NamedSharding(mesh, P("fsdp", "tp")),
        "v": NamedSharding(mesh, P(None, "fsdp")),
        "step": NamedSharding(mesh, P()),
    }
    rng = np.random.default_rng(0)  # the same values on every process
    host = {
        "w": rng.normal(size=(8, 6)).astype(np.float32),
        "v": rng.normal(size=(3, 8)).astype(np.float32),
        "step": np.asarray(7, np.int32),
    }
    config = CheckpointConfig(save_every_steps=1, keep_last_n=2, async_save=True)
    with Checkpointer(directory, config) as ckpt:
        if mode == "save":
            state = {
                k: jax.make_array_from_callback(x.shape, shardings[k], lambda i, x=x: x[i])
                for k, x in host.items()
            }
            assert ckpt.save(7, state, extra={"policy_version": 3})
            ckpt.wait_until_finished()
        else:
            target = {
                k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings[k])
                for k, x in host.items()
            }
            restored = ckpt.restore(abstract_target=target)
            assert restored.step == 7 and restored.extra == {"policy_version": 3}
            for k, array in restored.state.items():
                assert array.sharding.is_equivalent_to(shardings[k], array.ndim), k
                for shard in array.addressable_shards:
                    np.testing.assert_array_equal(np.asarray(shard.data), host[k][shard.index])
    print(f"OK {mode}", flush=True)


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])

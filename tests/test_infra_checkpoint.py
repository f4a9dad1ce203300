"""Checkpoint wrapper: cross-mesh restore, atomicity, keep-last-N, extra state, errors."""

import logging
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxrl.infra import checkpoint as ckpt_lib
from jaxrl.infra import sharding as sh
from jaxrl.infra.mesh import MeshConfig, make_mesh

# The corrupt-checkpoint tests make Orbax fail a read on purpose; that can leave a callback for
# Orbax's asyncio loop which runs after the loop closed ("Event loop is closed", raised inside
# Orbax, reported as unraisable at whichever test is running then).
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


class Toy(nnx.Module):
    """Two annotated weights: enough to exercise every sharded dimension of the trainer rules."""

    def __init__(self, rngs: nnx.Rngs):
        normal = nnx.initializers.normal(1.0)
        self.embed = nnx.Param(
            normal(rngs.params(), (16, 8)), out_sharding=(sh.VOCAB, sh.EMBED), eager_sharding=False
        )
        self.up = nnx.Param(
            normal(rngs.params(), (8, 12)), out_sharding=(sh.EMBED, sh.MLP), eager_sharding=False
        )


def _train_state(mesh):
    """(state, abstract state without shardings, a function: mesh -> restore target)."""
    graphdef, params, params_sh = sh.init_sharded(lambda: Toy(nnx.Rngs(0)), mesh, sh.TRAINER_RULES)
    del graphdef, params_sh
    tx = optax.adam(1e-3)
    opt_state = tx.init(params)
    state = {"params": params, "opt_state": opt_state, "step": jnp.int32(7)}
    abstract = jax.eval_shape(lambda: state)

    def target_on(target_mesh):
        p_sh = sh.param_shardings(abstract["params"], target_mesh, sh.TRAINER_RULES)
        shardings = {
            "params": p_sh,
            "opt_state": sh.opt_state_shardings(
                abstract["opt_state"], abstract["params"], p_sh, target_mesh
            ),
            "step": sh.replicated(target_mesh),
        }
        return sh.attach_shardings(abstract, shardings)

    return state, target_on


def _assert_equal_trees(a, b):
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


def _config(**kw):
    return ckpt_lib.CheckpointConfig(**{"save_every_steps": 1, "keep_last_n": 3, **kw})


def test_save_on_one_mesh_restore_on_others(tmp_path):
    mesh_84 = make_mesh(MeshConfig(("fsdp", "tp"), (4, 2)))
    state, target_on = _train_state(mesh_84)
    assert state["params"]["embed"].sharding.spec == jax.sharding.PartitionSpec("tp", "fsdp")
    with ckpt_lib.Checkpointer(tmp_path / "ckpt", _config(async_save=True)) as ckpt:
        assert ckpt.save(7, state, extra={"step": 7})
        ckpt.wait_until_finished()

    other_meshes = {
        "fsdp2_tp2_on_devices_4_to_7": MeshConfig(("fsdp", "tp"), (2, 2), first_device=4),
        "one_device": MeshConfig(("fsdp", "tp"), (1, 1), first_device=3),
    }
    with ckpt_lib.Checkpointer(tmp_path / "ckpt", read_only=True) as ckpt:
        for name, mesh_config in other_meshes.items():
            mesh = make_mesh(mesh_config)
            target = target_on(mesh)
            restored = ckpt.restore(abstract_target=target)
            assert restored.step == 7, name
            _assert_equal_trees(restored.state, state)
            got = jax.tree.map(lambda x: x.sharding, restored.state)
            want = jax.tree.map(lambda x: x.sharding, target)
            assert jax.tree.leaves(got) == jax.tree.leaves(want), name


def _tiny_state(value: float):
    return {"w": jnp.full((4, 2), value, jnp.float32), "step": jnp.int32(int(value))}


def _tiny_target():
    return jax.eval_shape(lambda: _tiny_state(0.0))


def test_interrupted_saves_are_never_restored(tmp_path, caplog):
    directory = tmp_path / "ckpt"
    with ckpt_lib.Checkpointer(directory, _config(async_save=False)) as ckpt:
        ckpt.save(1, _tiny_state(1.0), extra={"step": 1})
    finished = directory / "1"
    assert (finished / ckpt_lib.COMMIT_MARKER).exists()
    # (a) Killed before the rename: the temporary directory Orbax writes into.
    shutil.copytree(finished, directory / "2.orbax-checkpoint-tmp")
    # (b) A step directory without the commit marker (a copy cut short, a non-atomic filesystem).
    shutil.copytree(finished, directory / "3")
    (directory / "3" / ckpt_lib.COMMIT_MARKER).unlink()

    with ckpt_lib.Checkpointer(directory, read_only=True) as reader:
        assert reader.all_steps() == [1] and reader.latest_step() == 1
        restored = reader.restore(abstract_target=_tiny_target())
        assert restored.step == 1 and restored.extra == {"step": 1}
    assert (directory / "3").exists(), "a reader must not delete anything"

    with caplog.at_level(logging.WARNING):
        writer = ckpt_lib.Checkpointer(directory, _config(async_save=False))
    assert not (directory / "3").exists() and "unfinished checkpoint" in caplog.text
    assert writer.save(3, _tiny_state(3.0)), "the step of a removed unfinished save is writable"
    writer.close()
    assert not (directory / "2.orbax-checkpoint-tmp").exists(), "orbax cleans tmp dirs"
    assert writer.all_steps() == [1, 3]


def test_keep_last_n_and_save_interval(tmp_path):
    config = ckpt_lib.CheckpointConfig(save_every_steps=2, keep_last_n=2, async_save=True)
    with ckpt_lib.Checkpointer(tmp_path / "ckpt", config) as ckpt:
        saved = [ckpt.save(step, _tiny_state(float(step))) for step in range(1, 9)]
        ckpt.wait_until_finished()
        assert saved == [False, True] * 4
        assert ckpt.all_steps() == [6, 8]
        assert ckpt.save(9, _tiny_state(9.0), force=True)
        ckpt.wait_until_finished()
        assert ckpt.all_steps() == [8, 9]
        restored = ckpt.restore(abstract_target=_tiny_target())
    assert restored.step == 9 and float(restored.state["w"][0, 0]) == 9.0
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["8", "9"]


def test_extra_state_round_trips(tmp_path):
    key = jax.random.fold_in(jax.random.key(42), 3)
    extra = {
        "step": np.int64(5),
        "policy_version": {"trainer": 5, "generator": 4},
        "rng": ckpt_lib.key_to_json(key),
        "data_position": {"epoch": 1, "index": jnp.int32(17)},
        "lr": np.float32(0.5),
        "names": ("a", "b"),
    }
    state = {**_tiny_state(5.0), "sampling_key": key}  # typed PRNG keys can also be arrays
    with ckpt_lib.Checkpointer(tmp_path / "ckpt", _config()) as ckpt:
        ckpt.save(5, state, extra=extra)
        assert ckpt.read_extra()["policy_version"] == {"trainer": 5, "generator": 4}
        restored = ckpt.restore(5, abstract_target=jax.eval_shape(lambda: state))
    assert jnp.array_equal(jax.random.bits(restored.state["sampling_key"]), jax.random.bits(key))
    assert restored.extra == {
        "step": 5,
        "policy_version": {"trainer": 5, "generator": 4},
        "rng": ckpt_lib.key_to_json(key),
        "data_position": {"epoch": 1, "index": 17},
        "lr": 0.5,
        "names": ["a", "b"],
    }
    round_key = ckpt_lib.key_from_json(restored.extra["rng"])
    np.testing.assert_array_equal(jax.random.bits(round_key), jax.random.bits(key))
    with pytest.raises(TypeError, match=r"extra\.bad"):
        ckpt_lib.to_json_value({"bad": object()})


def test_clear_errors(tmp_path):
    with ckpt_lib.Checkpointer(tmp_path / "empty", _config()) as ckpt:
        with pytest.raises(ckpt_lib.CheckpointNotFoundError, match="no finished checkpoint"):
            ckpt.restore(abstract_target=_tiny_target())
        ckpt.save(1, _tiny_state(1.0))
        with pytest.raises(ckpt_lib.CheckpointNotFoundError, match=r"step 4 .*\[1\]"):
            ckpt.restore(4, abstract_target=_tiny_target())
        wrong = {"w": jax.ShapeDtypeStruct((4, 3), jnp.float32), "step": _tiny_target()["step"]}
        with pytest.raises(ckpt_lib.CheckpointMismatchError, match=r"w: saved \(4, 2\), target"):
            ckpt.restore(abstract_target=wrong)
        extra_leaf = {**_tiny_target(), "bias": jax.ShapeDtypeStruct((2,), jnp.float32)}
        with pytest.raises(ckpt_lib.CheckpointMismatchError, match="no tensor.*bias"):
            ckpt.restore(abstract_target=extra_leaf)
    with pytest.raises(ValueError, match="keep_last_n"):
        ckpt_lib.Checkpointer(tmp_path / "x", ckpt_lib.CheckpointConfig(keep_last_n=0))


def test_corrupt_latest_falls_back_to_previous(tmp_path, caplog):
    directory = tmp_path / "ckpt"
    with ckpt_lib.Checkpointer(directory, _config(async_save=False)) as ckpt:
        ckpt.save(1, _tiny_state(1.0))
        ckpt.save(2, _tiny_state(2.0))
    for data_dir in (directory / "2" / "state").glob("**/d"):
        shutil.rmtree(data_dir)  # the array chunks are gone; metadata still says step 2 is there
    with (
        ckpt_lib.Checkpointer(directory, read_only=True) as reader,
        caplog.at_level(logging.WARNING),
    ):
        restored = reader.restore(abstract_target=_tiny_target())
    assert restored.step == 1 and float(restored.state["w"][0, 0]) == 1.0
    assert "step 2" in caplog.text and "falling back" in caplog.text


def test_writer_moves_a_corrupt_latest_aside_and_saves_that_step_again(tmp_path, capsys):
    """A run resuming past a corrupt newest step must be able to save that step again: the
    writer moves it to `N.corrupt` (Orbax would otherwise skip or refuse the step)."""
    directory = tmp_path / "ckpt"
    with ckpt_lib.Checkpointer(directory, _config(async_save=False)) as ckpt:
        ckpt.save(1, _tiny_state(1.0))
        ckpt.save(2, _tiny_state(2.0))
    for data_dir in (directory / "2" / "state").glob("**/d"):
        shutil.rmtree(data_dir)
    with ckpt_lib.Checkpointer(directory, _config(async_save=False)) as ckpt:
        assert ckpt.restore(abstract_target=_tiny_target()).step == 1
        assert "moved to 2.corrupt and resumed from step 1" in capsys.readouterr().out
        assert ckpt.latest_step() == 1
        ckpt.save(2, _tiny_state(5.0), force=True)
    assert sorted(p.name for p in directory.iterdir()) == ["1", "2", "2.corrupt"]
    with ckpt_lib.Checkpointer(directory, read_only=True) as reader:
        restored = reader.restore(abstract_target=_tiny_target())
    assert restored.step == 2 and float(restored.state["w"][0, 0]) == 5.0


_KILLED_WRITER = """
import os, sys, threading, time
import jax.numpy as jnp
from orbax.checkpoint._src.path import atomicity
from jaxrl.infra import checkpoint as ckpt_lib
ckpt = ckpt_lib.Checkpointer(sys.argv[1], ckpt_lib.CheckpointConfig(1, 3, async_save=True))
ckpt.save(1, {"w": jnp.ones((4, 2)), "step": jnp.int32(1)})
ckpt.wait_until_finished()

written = threading.Event()
async def never_finalize(self):  # the background writer stalls before its atomic rename
    written.set()  # every byte of step 2 is in its temporary directory
    time.sleep(60)
atomicity.AtomicRenameTemporaryPath.finalize = never_finalize
ckpt.save(2, {"w": jnp.zeros((4, 2)), "step": jnp.int32(2)})
if not written.wait(60):
    sys.exit("the save of step 2 never reached its rename")
os._exit(0)  # killed while the async save of step 2 is in flight
"""


def test_process_killed_mid_save(tmp_path):
    directory = tmp_path / "ckpt"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    subprocess.run([sys.executable, "-c", _KILLED_WRITER, str(directory)], check=True, env=env)
    leftovers = sorted(p.name for p in directory.iterdir())
    assert leftovers == ["1", "2.orbax-checkpoint-tmp"], leftovers
    assert any((directory / "2.orbax-checkpoint-tmp").glob("state*/**/d/*"))  # data was written
    with ckpt_lib.Checkpointer(directory, read_only=True) as reader:
        assert reader.latest_step() == 1
        assert reader.restore(abstract_target=_tiny_target()).step == 1


def test_all_corrupt_raises(tmp_path):
    directory = tmp_path / "ckpt"
    with ckpt_lib.Checkpointer(directory, _config(async_save=False)) as ckpt:
        ckpt.save(1, _tiny_state(1.0))
    shutil.rmtree(directory / "1" / "state")
    with ckpt_lib.Checkpointer(directory, read_only=True) as reader:
        with pytest.raises(ckpt_lib.CheckpointCorruptError, match="step 1"):
            reader.restore(abstract_target=_tiny_target())

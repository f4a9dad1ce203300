"""Meshes from device slices, rules tables, and shardings of a toy annotated nnx module."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxrl.infra import sharding as sh
from jaxrl.infra.mesh import (
    MeshConfig,
    check_disjoint,
    cpu_overlap_note,
    make_mesh,
    mesh_device_ids,
)


class ToyLM(nnx.Module):
    """Embedding, one attention projection, an MLP and a norm, annotated like the real model."""

    def __init__(self, rngs: nnx.Rngs):
        normal = nnx.initializers.normal(1.0)

        def param(shape, names):
            return nnx.Param(normal(rngs.params(), shape), out_sharding=names, eager_sharding=False)

        self.embed = param((32, 8), (sh.VOCAB, sh.EMBED))
        self.q = param((8, 4, 2), (sh.EMBED, sh.Q_HEADS, sh.HEAD_DIM))
        self.kv = param((8, 2, 2), (sh.EMBED, sh.KV_HEADS, sh.HEAD_DIM))
        self.up = param((8, 16), (sh.EMBED, sh.MLP))
        self.down = param((16, 8), (sh.MLP, sh.EMBED))
        self.norm = nnx.Param(jnp.ones((8,)), out_sharding=(sh.NORM,), eager_sharding=False)
        self.rngs = rngs  # RNG state: unannotated, replicated


def test_mesh_sizes_resolve():
    mesh = make_mesh(MeshConfig(("fsdp", "tp"), (-1, 2)))
    assert dict(mesh.shape) == {"fsdp": 4, "tp": 2}
    mesh = make_mesh(MeshConfig(("dp", "tp"), (-1, 2), first_device=4))
    assert dict(mesh.shape) == {"dp": 2, "tp": 2} and mesh_device_ids(mesh) == [4, 5, 6, 7]
    mesh = make_mesh(MeshConfig(("fsdp", "tp"), (2, 1)))  # fixed sizes take the first devices
    assert mesh_device_ids(mesh) == [0, 1]
    mesh = make_mesh(MeshConfig(("fsdp", "tp"), (1, -1), device_indices=(7, 3)))
    assert dict(mesh.shape) == {"fsdp": 1, "tp": 2} and mesh_device_ids(mesh) == [7, 3]
    assert mesh.axis_types == (jax.sharding.AxisType.Auto,) * 2


@pytest.mark.parametrize(
    "config, message",
    [
        (MeshConfig(("fsdp", "tp"), (4, 4)), "mesh needs 16 devices from index 0 but only 8 exist"),
        (MeshConfig(("fsdp", "tp"), (-1, 2), first_device=6, num_devices=4), "needs 4 devices"),
        (MeshConfig(("fsdp", "tp"), (-1, 3)), "does not divide the 8 available"),
        (MeshConfig(("fsdp", "tp"), (-1, -1)), "more than one -1"),
        (MeshConfig(("fsdp",), (2, 2)), "one size per axis"),
        (MeshConfig(("fsdp", "tp"), (2, 2), num_devices=8), "need 4 devices but the slice has 8"),
        (MeshConfig(("fsdp", "tp"), (1, 1), device_indices=(9,)), r"device indices \[9\]"),
        (MeshConfig(axis_type="manual"), "axis_type"),
    ],
)
def test_bad_meshes_give_clear_errors(config, message):
    with pytest.raises(ValueError, match=message):
        make_mesh(config)


def test_disjoint_role_meshes():
    trainer = make_mesh(MeshConfig(("fsdp", "tp"), (2, 2), num_devices=4))
    generator = make_mesh(MeshConfig(("dp", "tp"), (2, 2), first_device=4))
    check_disjoint({"trainer": trainer, "generator": generator})
    with pytest.raises(ValueError, match="device 0 is in both"):
        check_disjoint(
            {"trainer": trainer, "generator": make_mesh(MeshConfig(("dp", "tp"), (2, 2)))}
        )


def test_cpu_overlap_note_only_for_two_multi_device_role_meshes():
    trainer = make_mesh(MeshConfig(("fsdp", "tp"), (2, 2), num_devices=4))
    generator = make_mesh(MeshConfig(("dp", "tp"), (2, 2), first_device=4))
    one = make_mesh(MeshConfig(("dp", "tp"), (1, 1), first_device=4, num_devices=1))
    note = cpu_overlap_note(trainer, generator)
    assert note is not None and "4-device" in note and "axis_sizes = (1, 1)" in note
    assert cpu_overlap_note(trainer, one) is None


@pytest.mark.parametrize("role", sorted(sh.RULES_BY_ROLE))
def test_every_rules_table_covers_every_logical_axis(role):
    names = [name for name, _ in sh.rules_for_role(role)]
    assert sorted(names) == sorted(sh.LOGICAL_AXES) and len(names) == len(set(names))


def _expected_spec(names, rules):
    table = dict(rules)
    return P(*(table[n] for n in names))


@pytest.mark.parametrize(
    "role, mesh_config",
    [
        ("trainer", MeshConfig(("fsdp", "tp"), (4, 2))),
        ("generator", MeshConfig(("dp", "tp"), (4, 2))),
    ],
)
def test_init_sharded_matches_the_table(role, mesh_config):
    mesh, rules = make_mesh(mesh_config), sh.rules_for_role(role)
    graphdef, state, shardings = sh.init_sharded(lambda: ToyLM(nnx.Rngs(0)), mesh, rules)
    reference = nnx.state(ToyLM(nnx.Rngs(0)), nnx.Param)
    for path, variable in nnx.to_flat_state(state):
        array = variable.get_value()
        names = variable.get_metadata("out_sharding", None)
        want = P() if names is None else _expected_spec(names, rules)
        assert array.sharding.spec == want, path
        assert array.sharding.mesh == mesh
    params = nnx.filter_state(state, nnx.Param)
    jax.tree.map(np.testing.assert_array_equal, params, reference)  # same values as eager init
    assert nnx.merge(graphdef, state).up.get_value().shape == (8, 16)
    assert jax.tree.leaves(shardings) == [x.sharding for x in jax.tree.leaves(state)]


def test_opt_state_and_batch_shardings():
    mesh = make_mesh(MeshConfig(("fsdp", "tp"), (4, 2)))
    _, state, shardings = sh.init_sharded(lambda: ToyLM(nnx.Rngs(0)), mesh, sh.TRAINER_RULES)
    params = nnx.filter_state(state, nnx.Param)
    param_sh = nnx.filter_state(shardings, nnx.Param)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    abstract_opt = jax.eval_shape(tx.init, params)
    opt_sh = sh.opt_state_shardings(abstract_opt, params, param_sh, mesh)
    opt_state = jax.jit(tx.init, out_shardings=opt_sh)(params)
    adam = opt_state[1][0]
    assert adam.mu["up"].get_value().sharding.spec == P("fsdp", "tp")
    assert adam.nu["embed"].get_value().sharding.spec == P("tp", "fsdp")
    assert adam.count.sharding.spec == P()

    batch = {"tokens_bt": jax.ShapeDtypeStruct((8, 16), jnp.int32), "n": jnp.int32(0)}
    batch_sh = sh.batch_shardings(batch, mesh, sh.TRAINER_RULES)
    assert batch_sh["tokens_bt"].spec == P("fsdp", None) and batch_sh["n"].spec == P()
    with pytest.raises(ValueError, match=r"\['tokens_bt'\] has leading size 6"):
        sh.batch_shardings(
            {"tokens_bt": jax.ShapeDtypeStruct((6, 4), jnp.int32)}, mesh, sh.TRAINER_RULES
        )


def test_sharding_context_makes_constrain_apply():
    mesh = make_mesh(MeshConfig(("fsdp", "tp"), (4, 2)))
    x_btd = jnp.zeros((8, 3, 4))
    names = (sh.ACT_BATCH, sh.ACT_LENGTH, sh.ACT_EMBED)
    assert jax.jit(lambda x: sh.constrain(x, names))(x_btd).sharding.is_fully_replicated
    with sh.sharding_context(mesh, sh.TRAINER_RULES):
        y_btd = jax.jit(lambda x: sh.constrain(x * 2, names))(x_btd)
    want = jax.sharding.NamedSharding(mesh, P("fsdp", None, None))
    assert y_btd.sharding.is_equivalent_to(want, y_btd.ndim)


def test_sharding_errors_name_the_problem():
    mesh = make_mesh(MeshConfig(("fsdp", "tp"), (4, 2)))
    with pytest.raises(ValueError, match=r"mesh axes \['dp'\]"):
        sh.param_shardings({}, mesh, sh.GENERATOR_RULES)

    class Bare(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones((4, 4)))

    with pytest.raises(ValueError, match=r"parameter \['w'\] \(4, 4\) has no logical axis names"):
        sh.init_sharded(Bare, mesh, sh.TRAINER_RULES)
    _, state, _ = sh.init_sharded(Bare, mesh, sh.TRAINER_RULES, allow_unannotated=True)
    assert state["w"].get_value().sharding.spec == P()

    class Odd(nnx.Module):  # before: "pad ... (e.g. a vocabulary)" was said of any dimension
        def __init__(self):
            names = ("embed", "vocab")
            self.w = nnx.Param(jnp.ones((6, 6)), out_sharding=names, eager_sharding=False)

    with pytest.raises(ValueError, match=r"\('fsdp',\) \(4 devices\): give those axes") as info:
        sh.init_sharded(Odd, mesh, sh.TRAINER_RULES)
    assert "vocabulary" not in str(info.value)
    with pytest.raises(ValueError, match=r"\(4 devices\): pad the vocabulary to a multiple of 4"):
        sh.init_sharded(Odd, make_mesh(MeshConfig(("fsdp", "tp"), (1, 4))), sh.TRAINER_RULES)
    with pytest.raises(KeyError, match="no sharding rules for role 'reward'"):
        sh.rules_for_role("reward")

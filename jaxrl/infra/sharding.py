"""Logical axis names and their mapping onto mesh axes.

Model code names every parameter dimension and the main activations with the logical axes
below; a rules table per role (trainer, generator, ...) maps them onto mesh axes. Rules are
installed with `flax.core.spmd.logical_axis_rules(rules)` (thread-local, so each executor thread
can trace under its own role's table) and the mesh with `jax.set_mesh(mesh)`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.core import spmd as flax_spmd
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# Parameter axes.
VOCAB = "vocab"
EMBED = "embed"
Q_HEADS = "q_heads"
KV_HEADS = "kv_heads"
HEAD_DIM = "head_dim"
MLP = "mlp"
NORM = "norm"
LAYERS = "layers"  # the stacked layer axis of scanned models: never sharded
# Mixture-of-experts weights (`jaxrl.models.moe`): the stacked expert axis, and the hidden and
# expert-MLP dimensions of expert weights (their own names, so that a rules table can split the
# experts over a mesh axis that `embed` or `mlp` already use for dense weights).
EXPERTS = "experts"
EXPERT_EMBED = "expert_embed"
EXPERT_MLP = "expert_mlp"

# Activation axes.
ACT_BATCH = "act_batch"
ACT_LENGTH = "act_length"
ACT_EMBED = "act_embed"
ACT_HEADS = "act_heads"
ACT_KV_HEADS = "act_kv_heads"
ACT_HEAD_DIM = "act_head_dim"
ACT_MLP = "act_mlp"
ACT_VOCAB = "act_vocab"

PARAM_AXES = (
    VOCAB,
    EMBED,
    Q_HEADS,
    KV_HEADS,
    HEAD_DIM,
    MLP,
    NORM,
    LAYERS,
    EXPERTS,
    EXPERT_EMBED,
    EXPERT_MLP,
)
ACTIVATION_AXES = (
    ACT_BATCH,
    ACT_LENGTH,
    ACT_EMBED,
    ACT_HEADS,
    ACT_KV_HEADS,
    ACT_HEAD_DIM,
    ACT_MLP,
    ACT_VOCAB,
)
LOGICAL_AXES = PARAM_AXES + ACTIVATION_AXES

LogicalRules = Sequence[tuple[str, str | tuple[str, ...] | None]]


def logical_param(rngs, shape, axes: Sequence[str | None], dtype, std: float | None) -> nnx.Param:
    """A parameter ~ N(0, std^2) (std=None: ones, std=0: zeros) carrying logical axis names.

    The names go into `out_sharding` metadata with `eager_sharding=False`: models never touch a
    mesh; a role's rules table maps the names to mesh axes (`param_shardings`).
    """
    if std is None:
        value = jnp.ones(shape, dtype)
    elif std == 0.0:
        value = jnp.zeros(shape, dtype)
    else:
        value = (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    return nnx.Param(value, out_sharding=tuple(axes), eager_sharding=False)


def logical_to_pspec(logical_axes: Sequence[str | None], rules: LogicalRules) -> PartitionSpec:
    """Maps a tuple of logical axis names to a mesh PartitionSpec through `rules`.

    Every logical name must appear in `rules` (map it to None to replicate); a name missing from
    the table is an error rather than a silent replication.
    """
    table = dict(rules)
    mesh_axes = []
    for name in logical_axes:
        if name is None:
            mesh_axes.append(None)
        elif name in table:
            mesh_axes.append(table[name])
        else:
            raise KeyError(
                f"logical axis {name!r} has no entry in the sharding rules "
                f"{sorted(table)}; add it (map it to None to replicate)."
            )
    return PartitionSpec(*mesh_axes)


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    """`with_sharding_constraint` by logical names; a no-op outside a rules + mesh context.

    Models call this on their main activations. Unsharded use (tests, single device) installs no
    rules, so the model runs unchanged.
    """
    rules = flax_spmd.get_logical_axis_rules()
    if not rules or jax.sharding.get_abstract_mesh().empty:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_pspec(logical_axes, rules))


# Rules tables, one per role. Data, not code: a new parallelism layout is a new table.
# Trainer: FSDP x TP on a ("fsdp", "tp") mesh. Weights are split along `embed` over fsdp (gathered
# layer by layer in the forward pass) and along their head / hidden / vocab dimension over tp
# (Megatron-style column/row splits); the batch is split over fsdp (FSDP is data parallel for
# activations); activations keep their tp split inside attention and the MLP. Mixture-of-experts
# weights `[experts, expert_embed, expert_mlp]` are split by expert over fsdp (whole experts per
# fsdp shard in place of an embed split: the same memory per device, gathered layer by layer as
# FSDP gathers dense weights) and along each expert's MLP width over tp, as dense MLPs are.
TRAINER_RULES: LogicalRules = (
    (VOCAB, "tp"),
    (EMBED, "fsdp"),
    (Q_HEADS, "tp"),
    (KV_HEADS, "tp"),
    (HEAD_DIM, None),
    (MLP, "tp"),
    (NORM, None),
    (LAYERS, None),
    (EXPERTS, "fsdp"),
    (EXPERT_EMBED, None),
    (EXPERT_MLP, "tp"),
    (ACT_BATCH, "fsdp"),
    (ACT_LENGTH, None),
    (ACT_EMBED, None),
    (ACT_HEADS, "tp"),
    (ACT_KV_HEADS, "tp"),
    (ACT_HEAD_DIM, None),
    (ACT_MLP, "tp"),
    (ACT_VOCAB, "tp"),
)

# Generator: TP x DP replicas on a ("dp", "tp") mesh. Weights are split over tp only (each dp
# replica holds a full copy, so decoding needs no weight all-gather); the batch is split over dp.
# Experts are split whole over tp (each tp device holds num_experts / tp experts, the memory of a
# Megatron split of their MLP width).
GENERATOR_RULES: LogicalRules = (
    (VOCAB, "tp"),
    (EMBED, None),
    (Q_HEADS, "tp"),
    (KV_HEADS, "tp"),
    (HEAD_DIM, None),
    (MLP, "tp"),
    (NORM, None),
    (LAYERS, None),
    (EXPERTS, "tp"),
    (EXPERT_EMBED, None),
    (EXPERT_MLP, None),
    (ACT_BATCH, "dp"),
    (ACT_LENGTH, None),
    (ACT_EMBED, None),
    (ACT_HEADS, "tp"),
    (ACT_KV_HEADS, "tp"),
    (ACT_HEAD_DIM, None),
    (ACT_MLP, "tp"),
    (ACT_VOCAB, "tp"),
)

RULES_BY_ROLE: Mapping[str, LogicalRules] = {
    "trainer": TRAINER_RULES,
    "generator": GENERATOR_RULES,
}


def rules_for_role(role: str) -> LogicalRules:
    """The rules table of `role` ("trainer", "generator")."""
    if role not in RULES_BY_ROLE:
        raise KeyError(f"no sharding rules for role {role!r}; known roles: {sorted(RULES_BY_ROLE)}")
    return RULES_BY_ROLE[role]


def rules_mesh_axes(rules: LogicalRules) -> set[str]:
    """Every mesh axis name that `rules` maps some logical axis to."""
    axes: set[str] = set()
    for _, target in rules:
        if target is None:
            continue
        axes.update((target,) if isinstance(target, str) else target)
    return axes


def check_rules_fit_mesh(rules: LogicalRules, mesh: Mesh) -> None:
    """Raises if `rules` name a mesh axis that `mesh` lacks (size-1 axes are fine)."""
    missing = sorted(rules_mesh_axes(rules) - set(mesh.axis_names))
    if missing:
        raise ValueError(
            f"the sharding rules use mesh axes {missing} that the mesh {dict(mesh.shape)} lacks; "
            "add them to MeshConfig.axis_names (size 1 is fine) or use the role's own rules."
        )


@contextlib.contextmanager
def sharding_context(mesh: Mesh, rules: LogicalRules) -> Iterator[None]:
    """Installs `mesh` (jax.set_mesh) and `rules` (thread-local) so that `constrain` applies.

    Each executor thread traces its jitted functions under its own role's context.
    """
    check_rules_fit_mesh(rules, mesh)
    with jax.set_mesh(mesh), flax_spmd.logical_axis_rules(rules):
        yield


def replicated(mesh: Mesh) -> NamedSharding:
    """A sharding that puts a full copy on every device of `mesh`."""
    return NamedSharding(mesh, PartitionSpec())


def _variable_sharding(
    path, variable: nnx.Variable, mesh: Mesh, rules: LogicalRules, allow_unannotated: bool
) -> nnx.Variable:
    """`variable` with its value replaced by the NamedSharding its logical names map to."""
    names = variable.get_metadata("out_sharding", None)
    shape = tuple(variable.get_value().shape)
    where = jax.tree_util.keystr(path)
    if names is None:
        if isinstance(variable, nnx.Param) and shape and not allow_unannotated:
            raise ValueError(
                f"parameter {where} {shape} has no logical axis names; create it with "
                "nnx.Param(..., out_sharding=(<logical names>), eager_sharding=False) or pass "
                "allow_unannotated=True to replicate it."
            )
        return variable.replace(replicated(mesh))
    if len(names) != len(shape):
        raise ValueError(
            f"parameter {where} has shape {shape} but {len(names)} logical axis names {names}."
        )
    spec = logical_to_pspec(names, rules)
    for dim, (size, name, mesh_axes) in enumerate(zip(shape, names, spec, strict=True)):
        axes = (
            () if mesh_axes is None else (mesh_axes,) if isinstance(mesh_axes, str) else mesh_axes
        )
        split = math.prod(mesh.shape[a] for a in axes)
        if size % split:
            # Padding fixes a vocabulary (unused ids); other sizes are the model's own.
            pad = (
                f"pad the vocabulary to a multiple of {split} (unused ids), "
                if name == VOCAB
                else f"the model has {size} experts: "
                if name == EXPERTS
                else ""
            )
            raise ValueError(
                f"parameter {where} {shape}: dimension {dim} ({name!r}, size {size}) does not "
                f"divide over mesh axes {tuple(axes)} ({split} devices): {pad}give those axes "
                f"sizes whose product divides {size}, or map {name!r} to None in the rules."
            )
    return variable.replace(NamedSharding(mesh, spec))


def param_shardings(
    abstract_state: Any, mesh: Mesh, rules: LogicalRules, *, allow_unannotated: bool = False
) -> Any:
    """NamedShardings for an nnx state (abstract or concrete), same tree structure.

    Each `nnx.Variable` is mapped through its `out_sharding` logical names and `rules` (strictly:
    a logical name missing from `rules` is an error). Variables without names (RNG state,
    counters) and plain array leaves are replicated; an unannotated `nnx.Param` with ndim >= 1
    is an error unless `allow_unannotated`, since silently replicating a weight is a memory bug.

    Returns a pytree whose Variables hold NamedShardings, usable as `out_shardings` of a jit
    that returns the state.
    """
    check_rules_fit_mesh(rules, mesh)

    def one(path, leaf):
        if isinstance(leaf, nnx.Variable):
            return _variable_sharding(path, leaf, mesh, rules, allow_unannotated)
        return replicated(mesh)

    is_variable = lambda x: isinstance(x, nnx.Variable)
    return jax.tree_util.tree_map_with_path(one, abstract_state, is_leaf=is_variable)


def opt_state_shardings(
    abstract_opt_state: Any, abstract_params: Any, params_shardings: Any, mesh: Mesh
) -> Any:
    """Shardings for an optax state built from `abstract_params`.

    Optax states mirror the params (Adam's mu / nu have the params' tree structure and shapes),
    so every subtree with the params' structure and leaf shapes takes `params_shardings`; any
    other leaf (step counts, factored second moments with other shapes) is replicated.
    """
    params_def = jax.tree.structure(abstract_params)
    params_shapes = [tuple(x.shape) for x in jax.tree.leaves(abstract_params)]

    def mirrors_params(subtree) -> bool:
        if jax.tree.structure(subtree) != params_def:
            return False
        shapes = [tuple(getattr(x, "shape", ())) for x in jax.tree.leaves(subtree)]
        return shapes == params_shapes

    def one(subtree):
        return params_shardings if mirrors_params(subtree) else replicated(mesh)

    return jax.tree.map(one, abstract_opt_state, is_leaf=mirrors_params)


def place_host(tree: Any, shardings: Any) -> Any:
    """Host arrays (the same value on every process) -> global arrays laid out by `shardings`.

    On one process this is `jax.device_put`. When a sharding spans processes, each process
    places only the shards of its own devices (`jax.make_array_from_callback`), with no
    communication: `device_put` of a host array there first checks with a cross-process
    collective that every process passes the same value, and a collective issued from the
    trainer's and the generator's threads in different orders on different processes could
    deadlock. The caller guarantees the value is the same everywhere (every process computes
    its batches from the same data position and rollouts).
    """

    def one(x, sharding):
        if sharding.is_fully_addressable:
            return jax.device_put(x, sharding)
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    return jax.tree.map(one, tree, shardings)


def batch_split(mesh: Mesh, rules: LogicalRules) -> int:
    """How many ways the `act_batch` rule splits a batch's leading axis on `mesh`."""
    batch_axes = dict(rules)[ACT_BATCH]
    names = (
        () if batch_axes is None else (batch_axes,) if isinstance(batch_axes, str) else batch_axes
    )
    return math.prod(mesh.shape[a] for a in names)


def batch_shardings(abstract_batch: Any, mesh: Mesh, rules: LogicalRules) -> Any:
    """Shardings that split every leaf's leading (batch) axis as the `act_batch` rule says.

    Scalars are replicated. The leading dimension must divide evenly over the batch mesh axes
    (checked here, with the leaf named, rather than failing inside XLA).
    """
    check_rules_fit_mesh(rules, mesh)
    split = batch_split(mesh, rules)
    names = dict(rules)[ACT_BATCH]

    def one(path, leaf):
        if not leaf.shape:
            return replicated(mesh)
        if leaf.shape[0] % split:
            raise ValueError(
                f"batch leaf {jax.tree_util.keystr(path)} has leading size {leaf.shape[0]}, not "
                f"divisible by the {split} devices of mesh axes {names}; change the batch size."
            )
        spec = logical_to_pspec((ACT_BATCH,) + (None,) * (len(leaf.shape) - 1), rules)
        return NamedSharding(mesh, spec)

    return jax.tree_util.tree_map_with_path(one, abstract_batch)


def attach_shardings(abstract_tree: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs carrying `shardings`: restore targets for the checkpoint wrapper."""
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_tree, shardings
    )


def init_sharded(
    init_fn: Callable[[], nnx.Module],
    mesh: Mesh,
    rules: LogicalRules,
    *,
    allow_unannotated: bool = False,
) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """Initialises a module with every array born on its devices (no full copy on one device).

    `init_fn` builds the module (e.g. `lambda: Model(cfg, rngs=nnx.Rngs(seed))`). Its abstract
    state (`nnx.eval_shape`) gives the shardings; a jit with those `out_shardings` runs the real
    init, so XLA materialises each shard directly where it lives.

    Returns (graphdef, state, shardings); `nnx.merge(graphdef, state)` rebuilds the module.
    """
    graphdef, abstract_state = nnx.split(nnx.eval_shape(init_fn))
    shardings = param_shardings(abstract_state, mesh, rules, allow_unannotated=allow_unannotated)

    def init_state() -> nnx.State:
        return nnx.split(init_fn())[1]

    with sharding_context(mesh, rules):
        state = jax.jit(init_state, out_shardings=shardings)()
    return graphdef, state, shardings

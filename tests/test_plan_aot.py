"""Ahead-of-time compilation for a TPU topology on the CPU (`launch.plan`, `jaxrl.planning`).

Needs the libtpu wheel (test extra): libtpu describes the TPU slice, the TPU compiler compiles
for it; no TPU is attached and nothing is allocated.
"""

import jax
import pytest

pytest.importorskip("libtpu", reason="AOT TPU tests need libtpu (pip install -e '.[test]')")

from jaxrl.infra import sharding as ax  # noqa: E402
from jaxrl.infra.mesh import MeshConfig, make_mesh  # noqa: E402
from jaxrl.infra.tpu import TopologyError, device_spec, parse_topology, topology_devices  # noqa: E402
from jaxrl.models.presets import rlbench_tiny  # noqa: E402
from jaxrl.planning import abstract_rollout_batch, plan_trainer, sharded_bytes  # noqa: E402
from jaxrl.trainer import LossConfig, OptimizerConfig, Trainer  # noqa: E402

# Shards of every weight are whole TPU tiles (8 x 128 float32) on a 2 x 2 mesh.
E, F, V, H, K, D, L = 256, 512, 512, 16, 16, 128, 2
TINY = dict(vocab_size=V, hidden_size=E, intermediate_size=F, num_layers=L, num_heads=H,
            num_kv_heads=K, head_dim=D, dtype="bfloat16")  # fmt: skip


@pytest.fixture(scope="module")
def v5e_mesh():
    devices = topology_devices("v5e:2x2")
    assert {d.platform for d in devices} == {"tpu"} and len(devices) == 4
    return make_mesh(MeshConfig(("fsdp", "tp"), (2, 2)), devices)


def _argument_bytes(tree) -> int:
    """The TPU compiler's per-device argument bytes of a program that reads `tree`."""
    compiled = jax.jit(lambda t: jax.tree.map(lambda x: x + 1, t)).lower(tree).compile()
    return compiled.memory_analysis().argument_size_in_bytes


def test_memory_analysis_params_and_optimizer_bytes_match_hand_count(v5e_mesh):
    """Per-device parameter and Adam bytes from the TPU compiler's memory_analysis equal a count
    from the shapes and the FSDP x TP layout: every weight matrix is split over both axes (4
    ways), the [E] norms are replicated, a scalar takes the allocator's 512-byte minimum."""
    config = rlbench_tiny(**TINY)
    trainer = Trainer(config, v5e_mesh, ax.TRAINER_RULES, OptimizerConfig().make(10))
    state = trainer.abstract_state()
    weights = 2 * V * E + L * (2 * E * H * D + 2 * E * K * D + 3 * E * F)  # float32, 4 ways
    norms = (2 * L + 1) * E  # float32, replicated
    hand_params = 4 * weights // 4 + 4 * norms
    assert _argument_bytes(state.params) == hand_params
    # Adam's mu and nu mirror the params; Adam's and the schedule's step counts are scalars.
    counts = [x for x in jax.tree.leaves(state.opt_state) if x.shape == ()]
    assert len(counts) == 2
    hand_opt = 2 * hand_params + 2 * 512
    assert _argument_bytes(state.opt_state) == hand_opt
    assert sharded_bytes(state.params) == hand_params
    assert sharded_bytes(state.opt_state) == hand_opt
    # The whole RL step: its arguments are params + optimizer + step + batch, the state donated.
    kwargs = dict(rows=16, prompt_len=128, completion_len=128, loss=LossConfig(name="grpo"))
    report, _ = plan_trainer(config, v5e_mesh, optimizer=OptimizerConfig(), **kwargs)
    assert report.parts["params"] == hand_params
    assert report.parts["optimizer"] == hand_opt + 512  # + TrainState.step
    batch = abstract_rollout_batch(16, 128, 128)
    batch = ax.attach_shardings(batch, ax.batch_shardings(batch, v5e_mesh, ax.TRAINER_RULES))
    # jit drops arguments the program never reads: the step ignores policy_version_b (one
    # 512-byte buffer per device).
    unused = 512
    assert report.argument_bytes == hand_params + hand_opt + 512 + _argument_bytes(batch) - unused
    assert report.alias_bytes >= hand_params + hand_opt
    assert report.flops > 0 and report.bytes_accessed > 0


def test_whole_hosts_only_and_chip_figures():
    with pytest.raises(TopologyError, match=r"whole number of TPU hosts.*'v5e:2x2'"):
        parse_topology("v5e:1x1")
    with pytest.raises(TopologyError, match="3-D"):
        parse_topology("v5p:2x2")
    with pytest.raises(TopologyError, match="<chip>"):
        parse_topology("h100:8")
    assert device_spec(topology_devices("v5p:2x2x1")).hbm_bytes == 95 * 1024**3
    assert device_spec(topology_devices("v4:2x2x1")).hbm_bytes == 16 * 1024**3  # 2 cores a chip

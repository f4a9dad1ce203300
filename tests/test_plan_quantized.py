"""The plans' generator programs on the engine's 8-bit weights (`PlanConfig.generator_weights`,
`plan_generator(weights=...)`): a tiny model compiled deviceless for H100s (fp8) and a TPU v5e
slice (int8), its programs' parameters the quantized tree laid out as the weights are, and fp8
refused on TPU before any compile."""

import pytest

pytest.importorskip("jax_plugins.xla_cuda12", reason="AOT GPU plans need jax-cuda12-plugin")
pytest.importorskip("libtpu", reason="AOT TPU plans need libtpu")

from jaxrl.infra import gpu, tpu  # noqa: E402
from jaxrl.infra.mesh import MeshConfig, make_mesh  # noqa: E402
from jaxrl.models.presets import preset  # noqa: E402
from jaxrl.plan.programs import plan_generator  # noqa: E402
from launch.plan import PlanConfig  # noqa: E402

SHAPES = dict(num_slots=8, samples=2, prompt_len=32, completion_len=32)


def _plan(topology, sizes, weights):
    mesh = make_mesh(
        MeshConfig(("dp", "tp"), sizes), (gpu if topology.startswith("h") else tpu)
        .topology_devices(topology)
    )  # fmt: skip
    config = preset("rlbench_tiny", param_dtype="bfloat16", dtype="bfloat16", scan_layers=True)
    return plan_generator(config, mesh, weights=weights, **SHAPES)


@pytest.mark.parametrize(
    ("topology", "sizes", "weights"), [("h100:1x8", (2, 4), "fp8"), ("v5e:2x2", (1, 4), "int8")]
)
def test_generator_programs_take_the_8_bit_copy(topology, sizes, weights):
    native = _plan(topology, sizes, "native")
    low = _plan(topology, sizes, weights)
    for n, q in zip(native, low, strict=True):
        # The programs' parameters are the 8-bit copy, sharded as the weights are (an argument
        # without its sharding would count whole on every device): on the GPU (no tile padding
        # of the tiny model's shapes) the decode step's arguments are its parts and a few small
        # arrays (prefill reads no LM head: fewer).
        if topology.startswith("h100"):
            for r in (n, q):
                assert r.other_argument_bytes < 4096, (r.name, r.other_argument_bytes)
                assert r.name == "prefill" or r.other_argument_bytes >= 0
        assert q.parts["params"] < 0.6 * n.parts["params"]
        assert q.resident_bytes == n.parts["params"]  # the weights the copy is made from
        assert q.hand.bytes < n.hand.bytes and q.hand.flops == n.hand.flops
    if topology.startswith("h100"):  # on v5e the tiny model's decode is its cache's copies
        decode_native, decode_low = native[1].whole_step_cost(), low[1].whole_step_cost()
        assert decode_low[1] < 0.75 * decode_native[1], (decode_native, decode_low)
    assert low[1].hand.terms["weights"] < 0.6 * native[1].hand.terms["weights"]


def test_fp8_on_a_tpu_plan_is_refused_naming_int8():
    with pytest.raises(ValueError, match="no fp8 matmul units.*weights='int8'"):
        PlanConfig(generator_weights="fp8").validate()  # the default generator: v5e:2x2
    with pytest.raises(ValueError, match="expected one of"):
        PlanConfig(generator_weights="int4").validate()
    PlanConfig(generator_weights="fp8", generator_topology="h100:1x8").validate()

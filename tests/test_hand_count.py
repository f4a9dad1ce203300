"""Whole-step costs of compiled GPU programs (`jaxrl.infra.hlo_cost`: loops as they run, Pallas
kernels by their models) against the hand count (`jaxrl.plan.hand_count`), deviceless for an
H100."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

pytest.importorskip("jax_plugins.xla_cuda12")

from jaxrl.infra import gpu, hlo_cost  # noqa: E402
from jaxrl.infra.mesh import MeshConfig, make_mesh  # noqa: E402
from jaxrl.models.presets import rlbench_tiny  # noqa: E402
from jaxrl.plan import hand_count  # noqa: E402
from jaxrl.plan.programs import cost_from_hlo, plan_generator  # noqa: E402


@pytest.fixture(scope="module")
def h100():
    return make_mesh(MeshConfig(("dp", "tp"), (1, 1)), gpu.topology_devices("h100:1x1"))


def test_gathers_count_the_rows_read_where_xla_counts_the_table(h100):
    """32 rows of a [4096, 512] bf16 table: XLA:GPU's cost analysis counts the whole table, the
    walker the rows (and the same for a scatter of one key per row into a cache)."""
    spec = NamedSharding(h100, PartitionSpec())
    table = jax.ShapeDtypeStruct((4096, 512), jnp.bfloat16, sharding=spec)
    ids = jax.ShapeDtypeStruct((32,), jnp.int32, sharding=spec)
    compiled = jax.jit(lambda t, i: t[i]).lower(table, ids).compile()
    rows = 32 * 512 * 2
    assert cost_from_hlo(compiled)["bytes accessed"] >= 4096 * 512 * 2
    _, moved, _ = hlo_cost.totals(hlo_cost.kernels(compiled.as_text()))
    assert rows <= moved <= 2 * rows + 1024, moved


def test_decode_kernel_reads_each_layer_once_as_the_hand_count_says(h100):
    """The engine's decode step on the in-place kernel, 2 scanned layers (the GPU engine decodes
    them on its per-layer copy): one kernel per layer, each counted with one layer's keys and
    values, which together are the hand count's K/V read (a span as long as the cache); FLOPs
    within the hand count's and 1.3x it plus the kernel's padded query heads."""
    scan = True
    config = rlbench_tiny(
        vocab_size=1024, hidden_size=512, intermediate_size=1024, num_layers=2, num_heads=8,
        num_kv_heads=2, head_dim=64, dtype="bfloat16", param_dtype="bfloat16", scan_layers=scan,
    )  # fmt: skip
    _, decode = plan_generator(
        config, h100, num_slots=64, samples=8, prompt_len=256, completion_len=256
    )
    ks = hlo_cost.kernels(decode.compiled.as_text())
    calls = [k for k in ks if k.opcode == "custom-call"]
    assert sum(k.count for k in calls) == 2, calls
    kv_read = decode.hand.terms["K/V read"]
    assert kv_read == decode.parts["kv_cache"]  # the whole cache: span = capacity
    counted = sum(k.bytes * k.count for k in calls)
    assert kv_read <= counted <= 1.1 * kv_read, (counted, kv_read)
    flops, moved = decode.whole_step_cost()
    assert decode.hand.flops <= flops and moved >= decode.hand.bytes
    # The kernel's matmuls run 16-row tiles for G = 4 query heads: 4x the attention's FLOPs.
    attention = 4 * 64 * 8 * 64 * 2 * 512
    assert flops <= 1.3 * decode.hand.flops + 3 * attention


def test_hand_counts_of_the_train_step_scale_with_remat_and_tokens():
    """Full remat adds one forward pass of the layers; the LM head runs on completion tokens."""
    c = rlbench_tiny(vocab_size=1000, hidden_size=64, intermediate_size=128, num_layers=2)
    kw = dict(rollouts=4, prompt_len=8, completion_len=8, micro_batches=2, tp=1, state_bytes=12)
    none = hand_count.train_step(c.replace(remat_policy="none"), **kw)
    full = hand_count.train_step(c.replace(remat_policy="full"), **kw)
    layers = 2 * hand_count.layer_weights(c)
    pairs = 4 * 16 * 17 / 2
    attention = 2 * c.num_heads * c.head_dim * c.num_layers * pairs
    assert full.flops - none.flops == pytest.approx(2 * layers * 4 * 16 + 2 * attention)
    head = 6 * c.vocab_size * c.hidden_size * 4 * 8
    assert none.flops == pytest.approx(6 * layers * 64 + head + 6 * attention)
    assert np.isclose(full.bytes, sum(full.terms.values()))


WINDOWED = """
%cond (p: (f32[8,16], u32[])) -> pred[] {
  %p = (f32[8,16], u32[]) parameter(0)
  %c = u32[] constant(4)
  %i = u32[] get-tuple-element(%p), index=1
  ROOT %lt = pred[] compare(%i, %c), direction=LT
}

%fused (a: f32[8,2,512,1], b: f32[2,512,32,128]) -> f32[8,32,128,1] {
  %a = f32[8,2,512,1] parameter(0)
  %b = f32[2,512,32,128] parameter(1)
  ROOT %conv = f32[8,32,128,1] convolution(%a, %b), CONV_ATTRIBUTES
}

%body (p: (f32[8,16], u32[])) -> (f32[8,16], u32[]) {
  %p = (f32[8,16], u32[]) parameter(0)
  %x = f32[8,16] get-tuple-element(%p), index=0
  %i = u32[] get-tuple-element(%p), index=1
  %two = u32[] constant(2)
  %next = u32[] add(%i, %two)
  %lhs = f32[8,2,512,1] parameter(1)
  %rhs = f32[2,512,32,128] parameter(2)
  %piece = f32[8,32,128,1] fusion(%lhs, %rhs), kind=kOutput, calls=%fused
  ROOT %t = (f32[8,16], u32[]) tuple(%x, %next)
}

ENTRY %main (x: f32[8,16]) -> (f32[8,16], u32[]) {
  %x = f32[8,16] parameter(0)
  %zero = u32[] constant(0)
  %init = (f32[8,16], u32[]) tuple(%x, %zero)
  ROOT %w = (f32[8,16], u32[]) while(%init), condition=%cond, body=%body
}
""".replace(
    "CONV_ATTRIBUTES",
    "window={size=32x2 pad=31_31x0_0 rhs_reversal=1x0}, dim_labels=b1f0_1i0o->b0f1",
)


def test_tpu_loops_and_matmul_convolutions_are_counted_as_they_run():
    """The TPU compiler's forms, on a hand-written module: a matmul as a convolution whose window
    runs over a size-1 dim padded on both sides (one input element per output: 2 x out x 512 x
    2 FLOPs, not x 32 more), in a loop without `known_trip_count` whose counter goes 0, 2 < 4
    (2 trips, read from its condition and its body's step)."""
    ks = hlo_cost.kernels(WINDOWED)
    piece = next(k for k in ks if k.name == "piece")
    assert piece.flops == 2.0 * 8 * 32 * 128 * 512 * 2
    assert piece.count == 2


NESTED_SLICE = """
%slice_layer (w: bf16[80,64,64], i: s32[]) -> bf16[64,64] {
  %w = bf16[80,64,64] parameter(0)
  %i = s32[] parameter(1)
  %zero = s32[] constant(0)
  %ds = bf16[1,64,64] dynamic-slice(%w, %i, %zero, %zero), dynamic_slice_sizes={1,64,64}
  ROOT %layer = bf16[64,64] bitcast(%ds)
}

%matmul (x: bf16[8,64], w: bf16[80,64,64], i: s32[]) -> bf16[8,64] {
  %x = bf16[8,64] parameter(0)
  %w = bf16[80,64,64] parameter(1)
  %i = s32[] parameter(2)
  %layer = bf16[64,64] fusion(%w, %i), kind=kLoop, calls=%slice_layer
  ROOT %dot = bf16[8,64] dot(%x, %layer), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (x: bf16[8,64], w: bf16[80,64,64], i: s32[]) -> bf16[8,64] {
  %x = bf16[8,64] parameter(0)
  %w = bf16[80,64,64] parameter(1)
  %i = s32[] parameter(2)
  ROOT %y = bf16[8,64] fusion(%x, %w, %i), kind=kOutput, calls=%matmul
}
"""


def test_a_layer_sliced_out_of_stacked_weights_in_a_nested_fusion_counts_one_layer():
    """The TPU compiler fuses a layer's dynamic slice of stacked weights into the matmul's
    fusion, one fusion deeper: the matmul reads one [64, 64] layer, not the [80, 64, 64] stack."""
    (kernel,) = hlo_cost.kernels(NESTED_SLICE)
    one_layer, x_and_out, index = 64 * 64 * 2, 2 * 8 * 64 * 2, 4
    assert kernel.bytes == one_layer + x_and_out + index
    assert kernel.flops == 2 * 8 * 64 * 64


def test_train_step_on_the_fused_kernel_holds_no_scores_and_xla_does(h100):
    """The train step compiled for an H100: on the fused kernel no buffer ends in [T, T]
    (`ProgramReport.square_buffers`, `launch.plan`'s line; T = 128 is none of the model's
    dimensions, whose activations would look the same); on XLA's attention the scores are
    there. Its whole-step FLOPs are within 15% of the hand count either way."""
    from jaxrl.plan.programs import plan_trainer
    from jaxrl.train.trainer import LossConfig, OptimizerConfig

    config = rlbench_tiny(
        vocab_size=512, hidden_size=160, intermediate_size=320, num_layers=1, num_heads=4,
        num_kv_heads=2, head_dim=16, dtype="bfloat16", remat_policy="full",
    )  # fmt: skip
    mesh = make_mesh(MeshConfig(("fsdp", "tp"), (1, 1)), gpu.topology_devices("h100:1x1"))
    kwargs = dict(
        rows=4, prompt_len=64, completion_len=64, optimizer=OptimizerConfig(learning_rate=1e-6),
        loss=LossConfig(name="grpo"),
    )  # fmt: skip
    fused, _ = plan_trainer(config, mesh, **kwargs)
    xla, _ = plan_trainer(config.replace(attention_impl="xla"), mesh, **kwargs)
    assert fused.square_buffers(128) == []
    assert xla.square_buffers(128), xla.largest_buffers()
    for report in (fused, xla):
        flops, _ = report.whole_step_cost()
        assert abs(flops / report.hand.flops - 1) < 0.15, flops / report.hand.flops

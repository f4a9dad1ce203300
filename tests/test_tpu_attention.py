"""The Pallas TPU (Mosaic) flash attention (`jaxrl.models.tpu_attention`): exact against
`gpu_attention.dense_reference` in interpret mode on the CPU (outputs and q / key / value
gradients, fp32, GQA with G = 2, T not a multiple of the blocks) on the padded, packed and
shared-prompt layouts; a wrong mask fed to the kernels fails the same comparison; the sharded
forward and backward compile for a TPU slice without a TPU (Mosaic kernels), with temporaries far
below the `[B, H, T, T]` scores."""

import time

import jax
import jax.numpy as jnp
import pytest
from attention_cases import inputs, kernel_errors, rel_err, rows, value_and_grads

from jaxrl.models.gpu_attention import dense_reference
from jaxrl.models.masks import SegmentMask, segment_mask
from jaxrl.models.tpu_attention import block_visits, flash_attention, flash_self_attention

# T = 60 is padded to 64 inside the wrapper; several q and kv blocks per row, q and kv blocks of
# different sizes in both passes.
B, T, H, K, D = 2, 60, 4, 2, 16
BLOCKS = dict(block_q=16, block_k=32, block_q_bwd=32, block_k_bwd=16)


kernel_run = value_and_grads(lambda *a: flash_attention(*a, interpret=True, **BLOCKS))
reference_run = value_and_grads(dense_reference)


def _inputs(seed, b=B, t=T, h=H, kv=K, d=D):
    return inputs(seed, b, t, h, kv, d)


def _rows(*runs_per_row):
    return rows(T, *runs_per_row)


def padded():
    """segment = prefix = valid: both rows left-padded (18 and 37 padding tokens)."""
    return _rows([(18, 0, 0), (42, 1, 1)], [(37, 0, 0), (23, 1, 1)])


def packed():
    """Plain packed rows (every sequence its own prefix), one with an unused tail."""
    return _rows([(20, 1, 1), (15, 2, 2), (25, 3, 3)], [(7, 1, 1), (30, 2, 2), (14, 3, 3)])


def shared_prompt():
    """A prompt (segment 1) and 3 completions with prefix 1; a row of two such units."""
    unit_a = [(12, 1, 1), (15, 2, 1), (10, 3, 1), (17, 4, 1)]
    unit_b = [(8, 1, 1), (9, 2, 1), (11, 3, 1), (6, 4, 4), (14, 5, 4), (10, 6, 4)]
    return _rows(unit_a, unit_b)


@pytest.mark.parametrize("layout", [padded, packed, shared_prompt])
def test_exact_against_dense_reference(layout):
    q, k, v, w = _inputs(0)
    segment, prefix = layout()
    got = kernel_run(q, k, v, segment, prefix, w)
    errors = kernel_errors(got, reference_run(q, k, v, segment, prefix, w))
    print(f"{layout.__name__}: max relative errors {errors}")
    assert max(errors.values()) < 1e-5, errors
    out, (dq, _, _) = got
    assert out.shape == (B, T, H, D)
    # Queries that see no key (padding, the unused tail) give 0 and zero dq, not NaN.
    empty_bt = ~segment_mask(segment, prefix).any(-1)
    assert bool(empty_bt.any())
    for x in (out, dq):
        assert float(jnp.abs(jnp.where(empty_bt[:, :, None, None], x, 0.0)).max()) == 0.0


def test_tiles_that_see_nothing_are_skipped():
    """The tiles the kernels visit are the mask's non-empty tiles, fewer than the causal ones
    on every test layout (so the exactness tests cover the skipping)."""
    for layout in (padded, packed, shared_prompt):
        segment, prefix = (jnp.pad(x, ((0, 0), (0, 4))) for x in layout())  # T = 64
        visits = block_visits(segment, prefix, 16, 16)
        tiles = segment_mask(segment, prefix).reshape(B, 4, 16, 4, 16).any(axis=(2, 4))
        assert bool((visits == tiles).all())
        assert int(visits.sum()) < 4 * 5 // 2 * B, layout.__name__


def test_wrong_mask_fails_the_comparison():
    """Negative controls: the kernels fed a mask that lets completion 3 see its sibling 2, or a
    padded row one token longer, differ from the reference by far more than the tolerance."""
    q, k, v, w = _inputs(0)
    segment, prefix = shared_prompt()
    wrong_prefix = prefix.at[0, 27:37].set(2)  # completion 3 (segment 3) -> segment 2's "prompt"
    got = kernel_run(q, k, v, segment, wrong_prefix, w)
    sibling = rel_err(got[0], reference_run(q, k, v, segment, prefix, w)[0])
    segment, prefix = padded()
    longer = segment.at[1, 36].set(1)  # off by one: 24 real tokens where the reference has 23
    got = kernel_run(q, k, v, longer, longer, w)
    off_by_one = rel_err(got[0], reference_run(q, k, v, segment, prefix, w)[0])
    print(f"negative controls: sibling visible {sibling:.3g}, off-by-one length {off_by_one:.3g}")
    assert sibling > 1e-3 and off_by_one > 1e-3


def test_self_attention_sharded_on_cpu_mesh():
    """flash_self_attention inside shard_map (batch over fsdp, heads over tp) on the CPU mesh:
    the same numbers as the dense reference."""
    from jaxrl.infra import sharding as ax
    from jaxrl.infra.mesh import MeshConfig, make_mesh

    mesh = make_mesh(MeshConfig(("fsdp", "tp"), (2, 2)), jax.devices()[:4])
    q, k, v, _ = _inputs(2)
    segment, prefix = shared_prompt()
    with ax.sharding_context(mesh, ax.TRAINER_RULES):
        out = jax.jit(flash_self_attention)(q, k, v, SegmentMask(segment, prefix))
    assert rel_err(out, dense_reference(q, k, v, segment, prefix)) < 1e-5


def test_batch_split_when_the_tile_lists_exceed_smem(monkeypatch):
    """A batch whose visited-tile lists exceed the SMEM budget runs as one call per row (the
    budget shrunk to one row's lists here): still exact; a row alone over it is refused."""
    from jaxrl.models import tpu_attention

    t = 64
    per_row = 4 * max((t // 16) * (1 + t // 32), (t // 32) * (1 + t // 16))
    monkeypatch.setattr(tpu_attention, "SMEM_LIST_BYTES", per_row)
    run = value_and_grads(lambda *a: flash_attention(*a, interpret=True, **BLOCKS))
    q, k, v, w = _inputs(3)
    segment, prefix = packed()
    forward = jax.make_jaxpr(lambda *a: flash_attention(*a, interpret=True, **BLOCKS))
    assert str(forward(q, k, v, segment, prefix)).count("pallas_call[") == B  # a call per row
    errors = kernel_errors(
        run(q, k, v, segment, prefix, w), reference_run(q, k, v, segment, prefix, w)
    )
    assert max(errors.values()) < 1e-5, errors
    monkeypatch.setattr(tpu_attention, "SMEM_LIST_BYTES", per_row - 4)
    with pytest.raises(ValueError, match="pass larger blocks"):
        flash_attention(q, k, v, segment, prefix, interpret=True, **BLOCKS)


def test_refusals_name_the_fix():
    q, k, v, _ = _inputs(0)
    segment, prefix = padded()
    with pytest.raises(ValueError, match="power of two >= 8"):
        flash_attention(q, k, v, segment, prefix, interpret=True, block_q=48)
    with pytest.raises(ValueError, match="multiple of 128 on a TPU"):
        flash_attention(q, k, v, segment, prefix, interpret=False, block_q=16, block_k=32)
    with pytest.raises(ValueError, match="not a multiple of 3 kv heads"):
        flash_attention(q, k[:, :, :1].repeat(3, axis=2), v[:, :, :1].repeat(3, axis=2), segment)


def test_compiles_for_tpu_without_a_tpu():
    """jit(grad) of flash_self_attention lowered with bf16 shapes for a v5p:2x2x1 mesh (batch
    over fsdp, heads over tp; deviceless, the kernels compiled by Mosaic): temporaries far below
    the per-device [B, H, T, T] fp32 scores an XLA attention holds."""
    pytest.importorskip("libtpu", reason="deviceless TPU compiles need libtpu")
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxrl.infra import sharding as ax
    from jaxrl.infra.mesh import MeshConfig, make_mesh
    from jaxrl.infra.tpu import topology_devices

    mesh = make_mesh(MeshConfig(("fsdp", "tp"), (2, 2)), topology_devices("v5p:2x2x1"))
    b, t, h, kv, d = 4, 1024, 8, 4, 128
    spec = lambda *axes: NamedSharding(mesh, PartitionSpec(*axes))
    q = jax.ShapeDtypeStruct((b, t, h, d), jnp.bfloat16, sharding=spec("fsdp", None, "tp"))
    key = jax.ShapeDtypeStruct((b, t, kv, d), jnp.bfloat16, sharding=spec("fsdp", None, "tp"))
    ids = jax.ShapeDtypeStruct((b, t), jnp.int32, sharding=spec("fsdp"))

    def loss(q, k, v, segment, prefix):
        out = flash_self_attention(q, k, v, SegmentMask(segment, prefix))
        return out.astype(jnp.float32).sum()

    start = time.time()
    with ax.sharding_context(mesh, ax.TRAINER_RULES):
        lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, key, key, ids, ids)
    assert "tpu_custom_call" in lowered.as_text()  # Mosaic kernels, not interpret-mode loops
    compiled = lowered.compile()
    seconds = time.time() - start
    temp = compiled.memory_analysis().temp_size_in_bytes
    scores_bytes = (b // 2) * (h // 2) * t * t * 4  # per device
    print(f"v5p grad: temp {temp} B vs scores {scores_bytes} B, compiled in {seconds:.1f} s")
    assert temp < scores_bytes / 4

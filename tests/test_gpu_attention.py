"""The Pallas Triton flash attention (`jaxrl.models.gpu_attention`): exact against a dense
reference in interpret mode on the CPU (outputs and q / key / value gradients, fp32, GQA with
G = 2) on the padded, packed and shared-prompt layouts; a wrong mask fed to the kernel fails the
same comparison; forward and backward compile for an H100 without a GPU, with temporaries far
below the `[B, H, T, T]` scores."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import inputs, kernel_errors, rel_err, rows, value_and_grads

from jaxrl.models.gpu_attention import block_visits, dense_reference, flash_attention
from jaxrl.rl.packing import segment_mask

B, T, H, K, D = 2, 64, 4, 2, 32
# Several q and kv blocks per row, q and kv blocks of different sizes in both passes.
BLOCKS = dict(block_q=32, block_k=16, block_q_bwd=16, block_k_bwd=32)


kernel_run = value_and_grads(lambda *a: flash_attention(*a, interpret=True, **BLOCKS))
reference_run = value_and_grads(dense_reference)


def _inputs(seed, b=B, t=T, h=H, kv=K, d=D):
    return inputs(seed, b, t, h, kv, d)


def _rows(*runs_per_row):
    return rows(T, *runs_per_row)


def padded():
    """segment = prefix = valid: row 0 left-padded (44 real tokens), row 1 right-padded (37)."""
    return _rows([(20, 0, 0), (44, 1, 1)], [(37, 1, 1)])


def packed():
    """Plain packed rows (every sequence its own prefix), one with an unused tail."""
    return _rows([(20, 1, 1), (15, 2, 2), (25, 3, 3)], [(7, 1, 1), (33, 2, 2), (24, 3, 3)])


def shared_prompt():
    """A prompt (segment 1) and 3 completions with prefix 1; a row of two such units."""
    unit_a = [(12, 1, 1), (15, 2, 1), (10, 3, 1), (17, 4, 1)]
    unit_b = [(8, 1, 1), (9, 2, 1), (11, 3, 1), (6, 4, 4), (14, 5, 4), (12, 6, 4)]
    return _rows(unit_a, unit_b)


@pytest.mark.parametrize("layout", [padded, packed, shared_prompt])
def test_exact_against_dense_reference(layout):
    q, k, v, w = _inputs(0)
    segment, prefix = layout()
    errors = kernel_errors(
        kernel_run(q, k, v, segment, prefix, w), reference_run(q, k, v, segment, prefix, w)
    )
    print(f"{layout.__name__}: max relative errors {errors}")
    assert max(errors.values()) < 1e-5, errors
    # Queries that see no key (padding, the unused tail) give 0, not NaN.
    out, _ = kernel_run(q, k, v, segment, prefix, w)
    empty_bt = ~segment_mask(segment, prefix).any(-1)
    assert bool(empty_bt.any())
    assert float(jnp.abs(jnp.where(empty_bt[:, :, None, None], out, 0.0)).max()) == 0.0


def test_unaligned_length_and_small_head_dim_are_padded_inside():
    """T = 50 (not a multiple of the blocks) and D = 8 (< Triton's 16): padded inside the
    wrapper and sliced back, still exact (scale 1 / sqrt(8))."""
    t, d = 50, 8
    q, k, v, w = _inputs(1, t=t, d=d)
    segment = jnp.asarray(np.repeat([[1] * 30 + [2] * 20], B, axis=0), jnp.int32)
    segment = segment.at[1, :5].set(0)
    got = value_and_grads(lambda *a: flash_attention(*a, interpret=True, **BLOCKS))
    errors = kernel_errors(
        got(q, k, v, segment, segment, w), reference_run(q, k, v, segment, segment, w)
    )
    print(f"T=50, D=8: max relative errors {errors}")
    assert max(errors.values()) < 1e-5, errors
    assert got(q, k, v, segment, segment, w)[0].shape == (B, t, H, d)


def test_tiles_that_see_nothing_are_skipped():
    """The tiles the kernels visit are the mask's non-empty tiles: fewer than the causal ones on
    every test layout (so the exactness tests cover the skipping); a completion's q block skips
    a block of its siblings, and a left-padded row its leading padding."""
    for layout in (padded, packed, shared_prompt):
        segment, prefix = layout()
        visits = block_visits(segment, prefix, 16, 16)
        tiles = segment_mask(segment, prefix).reshape(B, 4, 16, 4, 16).any(axis=(2, 4))
        assert bool((visits == tiles).all())
        causal = 4 * 5 // 2 * B
        assert int(visits.sum()) < causal, layout.__name__
    segment, prefix = shared_prompt()
    visits = block_visits(segment, prefix, 16, 16)
    # Row 0: prompt 0-11, completions 12-26, 27-36, 37-53: q block 3 (the last completion)
    # sees the prompt's block 0 and its own blocks 2, 3, not block 1 (its siblings only).
    assert visits[0, 3].tolist() == [True, False, True, True]
    segment, prefix = padded()
    assert not bool(block_visits(segment, prefix, 16, 16)[0, :, 0].any())


def test_wrong_mask_fails_the_comparison():
    """Negative controls: the kernel fed a mask that lets completion 3 see its sibling 2, or a
    padded row one token longer, differs from the reference by far more than the tolerance."""
    q, k, v, w = _inputs(0)
    segment, prefix = shared_prompt()
    wrong_prefix = prefix.at[0, 27:37].set(2)  # completion 3 (segment 3) -> segment 2's "prompt"
    got = kernel_run(q, k, v, segment, wrong_prefix, w)
    sibling = rel_err(got[0], reference_run(q, k, v, segment, prefix, w)[0])
    segment, prefix = padded()
    longer = segment.at[1, 37].set(1)  # off by one: 38 real tokens where the reference has 37
    got = kernel_run(q, k, v, longer, longer, w)
    off_by_one = rel_err(got[0], reference_run(q, k, v, segment, prefix, w)[0])
    print(f"negative controls: sibling visible {sibling:.3g}, off-by-one length {off_by_one:.3g}")
    assert sibling > 1e-3 and off_by_one > 1e-3


def test_refusals_name_the_fix():
    q, k, v, _ = _inputs(0)
    segment, prefix = padded()
    with pytest.raises(ValueError, match="power of two >= 16"):
        flash_attention(q, k, v, segment, prefix, interpret=True, block_q=48)
    with pytest.raises(ValueError, match="not a multiple of 3 kv heads"):
        flash_attention(q, k[:, :, :1].repeat(3, axis=2), v[:, :, :1].repeat(3, axis=2), segment)


def test_compiles_for_h100_without_a_gpu():
    """Forward and grad lowered with bf16 shapes for one H100 (deviceless XLA:GPU, the kernels
    compiled by Triton): temporaries far below the [B, H, T, T] fp32 scores the XLA path holds."""
    pytest.importorskip("jax_plugins.xla_cuda12", reason="deviceless GPU compiles need the plugin")
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from jaxrl.infra import gpu

    devices = gpu.topology_devices("h100:1x1")
    sharding = NamedSharding(Mesh(np.array(devices[:1]), ("x",)), PartitionSpec())
    b, t, h, kv, d = 2, 2048, 8, 4, 128
    args = [
        jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
        for shape, dtype in [
            ((b, t, h, d), jnp.bfloat16), ((b, t, kv, d), jnp.bfloat16),
            ((b, t, kv, d), jnp.bfloat16), ((b, t), jnp.int32), ((b, t), jnp.int32),
        ]
    ]  # fmt: skip

    def loss(q, k, v, segment, prefix):
        return flash_attention(q, k, v, segment, prefix).astype(jnp.float32).sum()

    scores_bytes = b * h * t * t * 4
    for name, fn in [("forward", flash_attention), ("grad", jax.grad(loss, argnums=(0, 1, 2)))]:
        start = time.time()
        compiled = jax.jit(fn).lower(*args).compile()
        seconds = time.time() - start
        temp = compiled.memory_analysis().temp_size_in_bytes
        print(f"{name}: temp {temp} B vs scores {scores_bytes} B, compiled in {seconds:.1f} s")
        assert "__gpu$xla.gpu.triton" in compiled.as_text()
        assert temp < scores_bytes / 4

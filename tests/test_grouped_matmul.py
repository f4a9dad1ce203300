"""The grouped matmul of the mixture-of-experts layers (`jaxrl.models.grouped_matmul`): the TPU
path (Pallas megablox, in interpret mode here), the GPU path (the Pallas Triton kernels of
`jaxrl.models.grouped_matmul_gpu`, in interpret mode here; compiled deviceless for an H100) and
the `tiled` XLA form against `jax.lax.ragged_dot` in values and gradients, on one device and
split over 8 simulated devices as the trainer's and the generator's rules split experts; and
the CPU path left as `ragged_dot`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.infra import sharding as ax
from jaxrl.infra.mesh import MeshConfig, make_mesh
from jaxrl.models import grouped_matmul as gm

M, K, N = 40, 16, 24  # 40 rows: not a multiple of the 16-row tile (padded into the last group)
SIZES = [(7, 0, 13, 0, 20), (0, 0, 40, 0, 0), (0, 10, 10, 10, 10)]  # empty groups, one group


def _inputs(sizes, seed=0):
    kx, kw, kc = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (M, K), jnp.float32)
    w = jax.random.normal(kw, (len(sizes), K, N), jnp.float32)
    cotangent = jax.random.normal(kc, (M, N), jnp.float32)
    return x, w, jnp.asarray(sizes, jnp.int32), cotangent


def _value_and_grads(f, x, w, sizes, cotangent):
    out, vjp = jax.vjp(lambda x, w: f(x, w, sizes), x, w)
    return (out, *vjp(cotangent))


def _close(got, want, atol=1e-5):
    for g, r in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=atol)


def test_megablox_equals_ragged_dot_in_values_and_gradients():
    x, w, s, ct = _inputs(SIZES[0])
    want = _value_and_grads(jax.lax.ragged_dot, x, w, s, ct)
    tpu = lambda x, w, s: gm.grouped_matmul(x, w, s, platform="tpu")  # noqa: E731
    _close(jax.jit(lambda *a: _value_and_grads(tpu, *a))(x, w, s, ct), want)


@pytest.mark.parametrize("tile", [8, 64])
def test_tiled_equals_ragged_dot_in_values_and_gradients(tile):
    f = lambda x, w, s: gm.tiled(x, w, s, tile=tile)  # noqa: E731
    run = jax.jit(lambda *a: _value_and_grads(f, *a))  # group sizes are data: one compile
    for sizes in (*SIZES, (40, 0, 0, 0, 0), (0, 0, 0, 0, 40)):
        x, w, s, ct = _inputs(sizes)
        _close(run(x, w, s, ct), _value_and_grads(jax.lax.ragged_dot, x, w, s, ct))


def test_local_group_sizes_clip_each_group_to_a_devices_rows():
    sizes = jnp.asarray([7, 0, 13, 0, 20], jnp.int32)
    per_device = [gm.local_group_sizes(sizes, d * 10, 10) for d in range(4)]
    assert [list(map(int, p)) for p in per_device] == [
        [7, 0, 3, 0, 0], [0, 0, 10, 0, 0], [0, 0, 0, 0, 10], [0, 0, 0, 0, 10],
    ]  # fmt: skip


@pytest.mark.parametrize(
    "platform,role", [("gpu", "trainer"), ("tpu", "generator"), ("gpu", "generator")]
)
def test_split_over_devices_equals_one_device(platform, role):
    """Trainer rules on an (fsdp 4, tp 2) mesh: rows over fsdp, every expert gathered, each
    expert's MLP width over tp (the gate / up form splits N, the down form K: partial sums
    added). Generator rules on (dp 4, tp 2): rows over dp, experts split over tp (each device
    multiplies its experts' rows; the devices' results added)."""
    axes = ("fsdp", "tp") if role == "trainer" else ("dp", "tp")
    mesh = make_mesh(MeshConfig(axes, (4, 2)), jax.devices()[:8])
    x, w, s, ct = _inputs((7, 0, 13, 20), seed=1)
    want = _value_and_grads(jax.lax.ragged_dot, x, w, s, ct)
    down_axes = (ax.EXPERTS, ax.EXPERT_MLP, ax.EXPERT_EMBED)
    for w_axes in (gm.WEIGHT_AXES, down_axes):
        f = lambda x, w, s: gm.grouped_matmul(x, w, s, w_axes=w_axes, platform=platform)  # noqa: B023,E731
        with ax.sharding_context(mesh, ax.rules_for_role(role)):
            got = jax.jit(lambda *a: _value_and_grads(f, *a))(x, w, s, ct)  # noqa: B023
        _close(got, want)


def test_the_cpu_program_keeps_ragged_dot():
    x, w, s, _ = _inputs(SIZES[0])
    auto = jax.jit(lambda x, w, s: gm.grouped_matmul(x, w, s)).lower(x, w, s).as_text()
    plain = jax.jit(lambda x, w, s: jax.lax.ragged_dot(x, w, s)).lower(x, w, s).as_text()
    assert auto == plain


def test_hand_count_of_a_mixture_of_experts_counts_a_tokens_experts():
    """Qwen3-30B-A3B: 3.3B active parameters a token (the layers' 2.73B and the two embedding
    tables), 30.5B stored; a dense model's active and stored weights are its layers'."""
    from jaxrl.models.presets import llama3_8b, qwen3_30b_a3b
    from jaxrl.plan import hand_count

    moe, dense = qwen3_30b_a3b(), llama3_8b()
    tables = 2 * moe.vocab_size * moe.hidden_size
    assert hand_count.active_weights(moe) + tables == pytest.approx(3.35e9, rel=0.01)
    assert hand_count.stored_weights(moe) + tables == pytest.approx(moe.num_params(), rel=1e-4)
    layers = dense.num_layers * hand_count.layer_weights(dense)
    assert hand_count.active_weights(dense) == hand_count.stored_weights(dense) == layers


def test_the_cost_walker_counts_a_grouped_matmul_kernel_by_its_rows():
    """`hlo_cost`'s model of the megablox kernels: 2 M K N for `gmm` (out [M, N]) and for `tgmm`
    (out [G, K, N] from lhs [K, M]), whatever wraps their names (`transpose(jvp(jit(gmm)))`)."""
    from jaxrl.infra import hlo_cost

    gmm = hlo_cost._grouped(["s32[]", "s32[6]", "bf16[64,16]", "bf16[5,16,24]"], "bf16[64,24]")
    tgmm = hlo_cost._grouped(["s32[]", "s32[6]", "bf16[16,64]", "bf16[64,24]"], "bf16[5,16,24]")
    assert gmm[0] == tgmm[0] == 2 * 64 * 16 * 24
    assert gmm[1] == 2 * (64 * 16 + 5 * 16 * 24 + 64 * 24) + 28
    # 1 of the 5 groups on this device (group_offset): a fifth of the rows on average
    local = hlo_cost._grouped(["s32[]", "s32[6]", "bf16[64,16]", "bf16[1,16,24]"], "bf16[64,24]")
    assert local[0] == pytest.approx(2 * 64 * 16 * 24 / 5)


def test_routed_experts_per_device_equal_the_layers_experts():
    """`routed_experts` (each device sorts its own tokens) split over (fsdp 4, tp 2) equals
    `MoEMLP._experts` on one device, values and gradients (within 1e-4 of gradients up to 12:
    the tp halves of the MLP width add in another order)."""
    from flax import nnx

    from jaxrl.models.config import ModelConfig
    from jaxrl.models.moe import MoEMLP

    c = ModelConfig(
        model_type="qwen3_moe", vocab_size=32, hidden_size=16, intermediate_size=32,
        num_layers=1, num_heads=2, num_kv_heads=2, head_dim=8, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=8, dtype="float32", param_dtype="float32",
    )  # fmt: skip
    layer = MoEMLP(c, nnx.Rngs(0), 0.5)
    x = jax.random.normal(jax.random.key(1), (16, 16), jnp.float32)
    _, weights, experts, *_ = layer.route(x)
    kernels = (layer.gate_kernel[...], layer.up_kernel[...], layer.down_kernel[...])

    def value_and_grads(platform):
        def loss(x, k):
            return jnp.sum(jnp.sin(gm.routed_experts(x, weights, experts, *k, platform=platform)))

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))

    want = value_and_grads(None)(x, kernels)  # ragged_dot, one device: as _experts
    _close(
        [gm.routed_experts(x, weights, experts, *kernels)], [layer._experts(x, weights, experts)]
    )
    mesh = make_mesh(MeshConfig(("fsdp", "tp"), (4, 2)), jax.devices()[:8])
    with ax.sharding_context(mesh, ax.rules_for_role("trainer")):
        got = value_and_grads("gpu")(x, kernels)
    _close(jax.tree.leaves(got), jax.tree.leaves(want), atol=1e-4)


def test_triton_kernels_equal_ragged_dot_in_values_and_gradients():
    """`grouped_matmul_gpu.gmm` (Pallas interpret mode; 40 rows in 16-row tiles, and in 32-row
    tiles whose shared ones run in two 16-row blocks; N 24 padded to a 32-column block) against
    `ragged_dot`: empty groups, one group, the first or last group alone; and with only groups
    1-3 of 5 held (`first` 1: the reference's other groups' matrices zero, so their rows'
    outputs and dx are zero)."""
    from jaxrl.models import grouped_matmul_gpu

    def triton(first, tile):
        def f(x, w, s):
            held = w if first is None else w[first : first + 3]
            return grouped_matmul_gpu.gmm(x, held, s, first=first, tile=tile, interpret=True)

        return jax.jit(lambda *a: _value_and_grads(f, *a))

    held = jnp.zeros((5, 1, 1)).at[1:4].set(1.0)
    for tile in (16, 32):
        # One jitted function per (first, tile): the same shapes for every sizes, one compile.
        run, run_held = triton(None, tile), triton(1, tile)
        for sizes in (*SIZES, (40, 0, 0, 0, 0), (0, 0, 0, 0, 40)):
            x, w, s, ct = _inputs(sizes)
            _close(run(x, w, s, ct), _value_and_grads(jax.lax.ragged_dot, x, w, s, ct))
        for sizes in (SIZES[0], SIZES[2]):
            x, w, s, ct = _inputs(sizes)
            out, dx, dw = run_held(x, w, s, ct)
            want = _value_and_grads(jax.lax.ragged_dot, x, w * held, s, ct)
            _close((out, dx, dw), (want[0], want[1], want[2] * held))


def test_triton_kernels_compile_for_h100_and_are_costed_by_their_rows():
    """Qwen3-30B-A3B's gate projection (M 4096 rows, K 2048, N 768, 128 experts, bf16), forward
    and both gradients, compiled deviceless for one H100 (the kernels through Triton): three
    Triton calls, costed by `hlo_cost` at `2 M K N` each, nothing like the `tiled` form's
    gathered `[visits, K, N]` weights in temporaries."""
    pytest.importorskip("jax_plugins.xla_cuda12", reason="deviceless GPU compiles need the plugin")
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from jaxrl.infra import gpu, hlo_cost
    from jaxrl.models import grouped_matmul_gpu

    devices = gpu.topology_devices("h100:1x1")
    sharding = NamedSharding(Mesh(np.array(devices[:1]), ("x",)), PartitionSpec())
    m, k, n, g = 4096, 2048, 768, 128
    args = [
        jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
        for shape, dtype in [((m, k), jnp.bfloat16), ((g, k, n), jnp.bfloat16), ((g,), jnp.int32)]
    ]

    def step(x, w, s):
        y, vjp = jax.vjp(lambda x, w: grouped_matmul_gpu.gmm(x, w, s, tile=128), x, w)
        return y, *vjp(y)

    compiled = jax.jit(step).lower(*args).compile()
    text = compiled.as_text()
    assert text.count("__gpu$xla.gpu.triton") == 3
    costed = [c for c in hlo_cost.kernels(text) if c.flops == 2.0 * m * k * n]
    assert len(costed) == 3
    visits = m // 128 + g - 1
    assert compiled.memory_analysis().temp_size_in_bytes < visits * k * n * 2 / 16


def test_a_sharded_moe_layer_routing_per_device_equals_one_device():
    """`MoEMLP` in a GPU program (the "pallas_gpu" form: the Triton kernels in interpret mode)
    under the trainer's rules on (fsdp 4, tp 2) sorts each device's tokens (`routed_experts`,
    as `routes_per_device` says) and equals the CPU program on one device (the global sort,
    `ragged_dot`): output and the gradients of x and every parameter within 1e-5 of each
    array's largest magnitude (the tp halves of the MLP width add in another order). The
    generator's layout (experts over tp) keeps the global sort."""
    from flax import nnx

    from jaxrl.models import attention_forms
    from jaxrl.models.config import ModelConfig
    from jaxrl.models.moe import MoEMLP

    c = ModelConfig(
        model_type="qwen3_moe", vocab_size=32, hidden_size=16, intermediate_size=32,
        num_layers=1, num_heads=2, num_kv_heads=2, head_dim=8, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, dtype="float32", param_dtype="float32",
    )  # fmt: skip
    graph, params = nnx.split(MoEMLP(c, nnx.Rngs(0), 0.5))
    x = jax.random.normal(jax.random.key(1), (4, 4, 16), jnp.float32)

    def run():
        def loss(params, x):
            out = nnx.merge(graph, params)(x)
            return jnp.sum(jnp.sin(out)), out

        return jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))(params, x)

    want = run()
    mesh = make_mesh(MeshConfig(("fsdp", "tp"), (4, 2)), jax.devices()[:8])
    with ax.sharding_context(mesh, ax.rules_for_role("trainer")):
        assert gm.routes_per_device(c.num_experts, 16)
        with attention_forms.decode_attention_form("pallas_gpu"):
            got = run()
            jaxpr = str(jax.make_jaxpr(lambda p, x: nnx.merge(graph, p)(x))(params, x))
    assert jaxpr.count("shard_map[") == 1  # one per device around the three matmuls, not three
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        _close([g], [w], atol=1e-5 * max(1.0, float(jnp.max(jnp.abs(w)))))
    generator = make_mesh(MeshConfig(("dp", "tp"), (4, 2)), jax.devices()[:8])
    with ax.sharding_context(generator, ax.rules_for_role("generator")):
        assert not gm.routes_per_device(c.num_experts, 16)

"""The speed-up model (`bench.scale`): its arithmetic, and the HLO walk it reads programs with
(`jaxrl.infra.hlo_cost`) against XLA's own cost analysis and hand counts."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from bench.scale import (
    MMAP_THRESHOLD,
    Machine,
    ProgramCost,
    StepPrediction,
    fresh_pages,
    program_seconds,
    roofline,
)
from jaxrl.infra import hlo_cost


def test_roofline_takes_the_slower_bound():
    assert roofline(2e9, 1e6, 1e9, 1e9) == pytest.approx(2.0)  # compute bound
    assert roofline(1e6, 3e9, 1e9, 1e9) == pytest.approx(3.0)  # memory bound


def test_program_seconds_sums_kernel_rooflines_launches_calls_and_pages():
    m = Machine(peak_flops=1e9, bandwidth=1e9, launch_s=1e-3, call_s=0.5, page_s=1e-6)
    # kernel 1: compute bound 2 s, run 3 times; kernel 2: memory bound 4 s, once; 1000 pages
    cost = ProgramCost(((2e9, 1e6, 3), (1e3, 4e9, 1)), pages=1000)
    assert program_seconds(cost, m) == pytest.approx(0.5 + 3 * (2 + 1e-3) + (4 + 1e-3) + 1e-3)
    assert (cost.flops, cost.launches) == (6e9 + 1e3, 4)


def test_fresh_pages_only_above_the_mmap_threshold():
    assert fresh_pages(MMAP_THRESHOLD - 1, 0) == 0
    assert fresh_pages(MMAP_THRESHOLD, 8 * 4096) == MMAP_THRESHOLD // 4096
    assert fresh_pages(2 * MMAP_THRESHOLD, MMAP_THRESHOLD) == 3 * MMAP_THRESHOLD // 4096


def test_step_prediction_sync_and_async():
    pred = StepPrediction(generate_s=2.0, train_s=4.0, sync_s=0.5)
    assert pred.sync_step_s == pytest.approx(6.0)
    assert pred.async_step_s == pytest.approx(4.5)  # max(Tg, Tt + Ts)
    assert StepPrediction(3.0, 1.0).speedup == pytest.approx(4.0 / 3.0)


def _compiled(fn, *args):
    return jax.jit(fn).lower(*args).compile()


def test_hlo_walk_matches_cost_analysis_without_loops():
    x, w1, w2 = jnp.ones((64, 96)), jnp.ones((96, 128)), jnp.ones((128, 32))
    compiled = _compiled(lambda x, a, b: jnp.tanh(x @ a) @ b, x, w1, w2)
    flops, bytes_, launches = hlo_cost.totals(hlo_cost.kernels(compiled.as_text()))
    assert flops == 2 * 64 * 96 * 128 + 2 * 64 * 128 * 32  # dots only, by hand
    cost = compiled.cost_analysis()
    assert bytes_ == pytest.approx(cost["bytes accessed"], rel=0.05)
    assert cost["flops"] >= flops  # XLA also counts the tanh's elementwise work
    assert launches >= 2


def test_hlo_walk_counts_every_trip_of_a_loop():
    x, w = jnp.ones((64, 128)), jnp.ones((128, 128))
    compiled = _compiled(lambda x, w: jax.lax.fori_loop(0, 7, lambda i, v: v @ w, x), x, w)
    flops, _, _ = hlo_cost.totals(hlo_cost.kernels(compiled.as_text()))
    one = 2 * 64 * 128 * 128
    assert flops == 7 * one
    assert compiled.cost_analysis()["flops"] < 2 * one  # XLA's own count: the body once


def test_hlo_walk_uses_default_trips_for_a_dynamic_loop():
    x, w = jnp.ones((8, 16)), jnp.ones((16, 16))

    def f(x, w, n):
        return jax.lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, c[1] @ w), (0, x))[1]

    text = _compiled(f, x, w, 5).as_text()
    flops, _, _ = hlo_cost.totals(hlo_cost.kernels(text, default_trips=5))
    assert flops == 5 * 2 * 8 * 16 * 16


def test_llamarl_train_count_is_six_n_per_token_plus_attention():
    from bench.scale_llamarl import H100, SETTINGS, shapes, train_seconds

    s = SETTINGS[0]
    m = shapes(s.preset)
    tokens = s.prompts * s.samples * (s.prompt_len + s.completion_len)
    dense = 6 * m["params"] * tokens / (64 * H100["peak_bf16"])
    assert 8.0e9 < m["params"] < 8.1e9  # Llama 3.1 8B
    t = train_seconds(s, m, 64)
    assert dense < t < 1.2 * dense  # attention adds under 20% at 3072 tokens


def test_llamarl_table_is_written_as_a_result(tmp_path, monkeypatch):
    import json

    import bench.common
    from bench import scale_llamarl

    monkeypatch.setattr(bench.common, "RESULTS_DIR", str(tmp_path))
    predictions = scale_llamarl.main([])
    result = json.loads((tmp_path / "scale_llamarl.json").read_text())
    assert [r["model"] for r in result["rows"]] == ["8B", "70B", "405B"]
    for row, p in zip(result["rows"], predictions, strict=True):
        assert row["sync"].endswith(f" = {p['sync']:.2f} s")
        assert row["async"].startswith(f"max({p['async_generate']:.2f}, ")
        assert row["speedup"] == f"{p['speedup']:.2f}x"
    assert (tmp_path / "scale_llamarl.md").read_text().count("\n| ") == 4  # header + 3 rows


def test_hlo_walk_counts_slices_and_in_place_updates_as_xla_does():
    buf, row = jnp.zeros((1024, 256)), jnp.ones((1, 256))  # a 1 MiB buffer, a 1 KiB row
    update = jax.jit(
        lambda b, r, i: jax.lax.dynamic_update_slice(b, r * 2.0, (i, 0)), donate_argnums=0
    )
    read = jax.jit(lambda b, i: jax.lax.dynamic_slice(b, (i, 0), (4, 256)) * 2.0)
    for compiled in (update.lower(buf, row, 3).compile(), read.lower(buf, 3).compile()):
        _, bytes_, _ = hlo_cost.totals(hlo_cost.kernels(compiled.as_text()))
        assert bytes_ == pytest.approx(compiled.cost_analysis()["bytes accessed"], rel=0.01)
        assert bytes_ < 16 * 1024  # the touched rows, not the whole buffer


def test_collectives_are_counted_by_group_size_and_priced_per_group():
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    mesh = jax.make_mesh((4, 2), ("a", "b"))

    def f(x):  # 3 all-reduces over pairs ("b", 2 devices), 1 over quads ("a", 4)
        for _ in range(3):
            x = jax.lax.psum(x, "b") * 0.5
        return jax.lax.psum(x, "a")

    spec = P(("a", "b"))
    fn = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec))
    x = jax.device_put(jnp.ones((64,)), NamedSharding(mesh, spec))
    ks = hlo_cost.kernels(fn.lower(x).compile().as_text())
    assert hlo_cost.collectives(ks) == ((2, 3), (4, 1))
    m = Machine(1e9, 1e9, collective_s=((2, 1e-4), (8, 5e-4)))
    cost = ProgramCost((), collectives=((2, 3), (4, 1), (0, 2)))
    # a group of 4 costs what the next measured size (8) costs; 0 (all devices) the largest
    assert program_seconds(cost, m) == pytest.approx(3e-4 + 5e-4 + 2 * 5e-4)


def test_host_fit_recovers_the_constants_of_a_synthetic_schedule():
    from bench.engine_host import BATCHES, HostCost, fit

    true = HostCost(step_s=1e-3, call_s=6e-4, row_s=2e-5)
    counts = [(5, 128), (2, 32), (5, 32), (2, 128)]  # the engine's schedule of `BATCHES`
    assert len(counts) == len(BATCHES)
    got = fit([(c, r, true.seconds(c, r)) for c, r in counts])
    for a, b in zip(dataclasses.astuple(got), dataclasses.astuple(true), strict=True):
        assert a == pytest.approx(b, rel=1e-9)
    assert true.seconds(5, 128) == pytest.approx(1e-3 + 5 * 6e-4 + 128 * 2e-5)
    # negative control: extra cost per device call lands in call_s, not in the row term
    skewed = fit([(c, r, true.seconds(c, r) + 1e-3 * c) for c, r in counts])
    assert skewed.call_s == pytest.approx(1.6e-3) and skewed.row_s == pytest.approx(2e-5)


def test_rows_of_a_device_call():
    from bench.engine_host import rows_of

    assert rows_of("decode", (), {"active": 32, "span": 48}) == 32
    assert rows_of("sample", (None, jnp.zeros((64, 16))), {}) == 64
    assert rows_of("prefill", (), {}) == 0


def test_recorder_keys_arrays_by_shape_and_static_args_by_value():
    from bench.scale_validate import _signature

    class Loud:  # an array-like whose printing would be the cost the old key paid
        shape, dtype = (4, 8), jnp.float32

        def __repr__(self):
            raise AssertionError("an array argument was printed")

    assert _signature(Loud()) == ((4, 8), jnp.float32)
    assert _signature(32) != _signature(48)  # static args (span, active) tell programs apart
    assert _signature(jnp.zeros((2, 3), jnp.int32)) == ((2, 3), jnp.dtype("int32"))

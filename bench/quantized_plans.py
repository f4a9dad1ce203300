"""`python -m bench quantized-plans [--table matmul|decode|llamarl|all] [--models 8B,70B]
[--platforms h100,v5p]`: the plans with the engine's 8-bit generator weights
(`PlanConfig.generator_weights`, `jaxrl.generation.quantize`) beside bf16, compiled deviceless on
this CPU (XLA:GPU through the CUDA plugin, the TPU compiler through libtpu):

- `matmul` (bench/results/quantized_plans_matmul.json): one projection of Llama 3 8B's MLP,
  `[R, 4096] @ [4096, 14336]`, at a decode step's 64 rows and a prefill's 8192, compiled for one
  H100 and one v5e chip in each form (`FORMS`): bf16, int8 weight-only, fp8 weight-only, fp8 x
  fp8 with per-row activation scales; per run (`jaxrl.infra.hlo_cost`): bytes, FLOPs, kernels,
  the bytes against bf16, or the compiler's message where it refuses a form.
- `decode` (quantized_plans_decode.json): the 8B plans' generator as `launch.plan` plans it
  (`DECODE_PLANS`: configs/plan/llama3_8b_grpo_h100.gin, 2 x TP 4 on h100:1x8, bf16 against
  fp8; configs/plan/llama3_8b_grpo.gin, TP 4 on v5e:2x2, bf16 against int8): per device, the
  engine's weights, the decode step's whole-step bytes and FLOPs as compiled, XLA's cost
  analysis (a loop body once), the hand count (`jaxrl.plan.hand_count`), and the decode step
  and prefill at the device's roofline.
- `llamarl` (quantized_plans_llamarl.json; `_70b` added to the name for 70B, and each platform's
  name unless `--platforms h100,v5p`): `bench.scale_llamarl --compiled`'s rows (the
  speed-up model's composition on programs compiled for the platform) with the generator's
  programs compiled on 8-bit weights (fp8 on H100, int8 on v5p) beside bf16; the train step is
  compiled once and shared, the weight push moves bf16 in both (the engine quantizes on the
  generator's devices).
"""

from __future__ import annotations

import argparse
import json
import time

from jaxrl.infra import platforms

GiB = 1024**3
K, N = 4096, 14336  # Llama 3 8B: hidden size, MLP width
MATMUL_ROWS = (64, 8192)
FORMS = ("bf16", "int8 weight-only", "fp8 weight-only", "fp8 x fp8 (per-row scales)")
MATMUL_COLUMNS = [
    ("device", "device"), ("rows", "rows"), ("form", "operands"), ("bytes", "bytes"),
    ("flops", "FLOPs"), ("vs_bf16", "bytes vs bf16"), ("kernels", "kernels"),
    ("compiled", "compiled"),
]  # fmt: skip

# (plan, config, generator weights against bf16)
DECODE_PLANS = (
    ("8B, 8 x H100 (2 x TP 4)", "configs/plan/llama3_8b_grpo_h100.gin", "fp8"),
    ("8B, v5e:2x2 (TP 4)", "configs/plan/llama3_8b_grpo.gin", "int8"),
)
DECODE_COLUMNS = [
    ("plan", "plan (generator)"), ("weights", "weights"), ("params_gib", "engine weights GiB"),
    ("total_gib", "decode total GiB"), ("decode_bytes", "decode bytes"),
    ("decode_flops", "decode FLOPs"), ("xla_bytes", "decode bytes (XLA, loop once)"),
    ("hand_bytes", "hand count bytes"), ("decode_ms", "decode step ms (roofline)"),
    ("bound", "bound"), ("vs_bf16", "decode vs bf16"), ("prefill_ms", "prefill ms (roofline)"),
]  # fmt: skip
LLAMARL_WEIGHTS = {"h100": "fp8", "v5p": "int8"}
LLAMARL_COLUMNS = [
    ("name", "model"), ("platform", "devices"), ("weights", "generator weights"),
    ("split", "devices (async: generator)"),
    ("sync_s", "sync: generate + train + reshard = step s"),
    ("async_s", "async: max(generate, train + push) = step s"),
    ("decode_ms", "decode step ms (async)"), ("speedups", "speed-up predicted / paper"),
    ("vs_bf16", "step vs bf16, sync / async"),
]  # fmt: skip


def _forms():
    import jax
    import jax.numpy as jnp

    dims = (((1,), (0,)), ((), ()))

    def weight_only(x, q, s):
        y = jax.lax.dot_general(x, q.astype(x.dtype), dims, preferred_element_type=jnp.float32)
        return (y * s).astype(x.dtype)

    def fp8_fp8(x, q, s):  # per-row symmetric activation scales, as "int8_dynamic" does
        x32 = x.astype(jnp.float32)
        amax = jnp.max(jnp.abs(x32), axis=1, keepdims=True)
        rows = jnp.where(amax > 0, amax / 448.0, 1.0)
        xq = jnp.clip(x32 / rows, -448, 448).astype(jnp.float8_e4m3fn)
        y = jax.lax.dot_general(xq, q, dims, preferred_element_type=jnp.float32)
        return (y * rows * s).astype(x.dtype)

    kernels = {"bf16": jnp.bfloat16, "int8 weight-only": jnp.int8}
    kernels |= {
        "fp8 weight-only": jnp.float8_e4m3fn,
        "fp8 x fp8 (per-row scales)": jnp.float8_e4m3fn,
    }
    fns = {"bf16": lambda x, w, s: x @ w, "fp8 x fp8 (per-row scales)": fp8_fp8}
    return {form: (fns.get(form, weight_only), kernels[form]) for form in FORMS}


def matmul_table() -> list[dict]:
    import jax
    import jax.numpy as jnp

    from jaxrl.infra import gpu, hlo_cost, tpu

    devices = {
        "H100": gpu.topology_devices("h100:1x1")[0],
        "v5e": tpu.topology_devices("v5e:2x2")[0],
    }
    rows = []
    for device, dev in devices.items():
        sharding = jax.sharding.SingleDeviceSharding(dev)
        for r in MATMUL_ROWS:
            base = None
            for form, (fn, dtype) in _forms().items():
                args = [
                    jax.ShapeDtypeStruct(shape, t, sharding=sharding)
                    for shape, t in (((r, K), jnp.bfloat16), ((K, N), dtype), ((N,), jnp.float32))
                ]
                row = {"device": device, "rows": r, "form": form}
                try:
                    compiled = jax.jit(fn).lower(*args).compile()
                except jax.errors.JaxRuntimeError as err:
                    row["compiled"] = "refused: " + str(err).splitlines()[0][:200]
                    rows.append(row)
                    continue
                flops, bytes_, launches = hlo_cost.totals(hlo_cost.kernels(compiled.as_text()))
                base = bytes_ if form == "bf16" else base
                row |= dict(
                    bytes_raw=bytes_, flops_raw=flops, bytes=f"{bytes_:.3g}", flops=f"{flops:.3g}",
                    vs_bf16=f"{bytes_ / base:.2f}" if base else "n/a", kernels=launches,
                    compiled="yes",
                )  # fmt: skip
                rows.append(row)
                print(json.dumps({"bench": "quantized_plans_matmul", **row}), flush=True)
    return rows


def _roofline_ms(cost, spec) -> tuple[float, str]:
    compute, memory = cost[0] / spec.peak_flops, cost[1] / spec.hbm_bandwidth
    return max(compute, memory) * 1e3, "compute" if compute >= memory else "HBM"


def decode_table() -> list[dict]:
    from bench.plan_tables import load_config
    from launch.plan import plan_generator_role

    rows = []
    for plan, gin_file, low in DECODE_PLANS:
        base = None
        for weights in ("native", low):
            start = time.perf_counter()
            params = (
                f'PlanConfig.generator_weights="{weights}"',
                'PlanConfig.roles=("generator",)',
            )
            role = plan_generator_role(load_config(gin_file, params))
            prefill, decode = role.reports
            cost, spec = decode.whole_step_cost(), role.spec
            ms, bound = _roofline_ms(cost, spec)
            base = ms if weights == "native" else base
            row = dict(
                plan=plan, config=gin_file, weights="bf16" if weights == "native" else weights,
                params_gib=f"{decode.parts['params'] / GiB:.2f}",
                total_gib=f"{decode.total_bytes / GiB:.2f}",
                decode_bytes=f"{cost[1]:.3g}", decode_flops=f"{cost[0]:.3g}",
                xla_bytes=f"{decode.bytes_accessed:.3g}", hand_bytes=f"{decode.hand.bytes:.3g}",
                decode_ms=f"{ms:.3g}", bound=bound, vs_bf16=f"{ms / base:.2f}",
                prefill_ms=f"{_roofline_ms(prefill.whole_step_cost(), spec)[0]:.4g}",
                decode_bytes_raw=cost[1], decode_flops_raw=cost[0], decode_s=ms / 1e3,
                params_bytes=decode.parts["params"], resident_bytes=decode.resident_bytes,
                hand_terms=decode.hand.terms, device=spec.name,
                plan_s=round(time.perf_counter() - start, 1),
            )  # fmt: skip
            rows.append(row)
            print(json.dumps({"bench": "quantized_plans_decode", **row}), flush=True)
    return rows


def llamarl_table(models: list[str], platforms_: list[str]) -> list[dict]:
    from bench.scale_llamarl import HARDWARE, SETTINGS, compiled_costs, predict_compiled

    rows = []
    for platform in platforms_:
        hw = HARDWARE[platform]
        for s in (s for s in SETTINGS if s.name in models):
            start = time.perf_counter()
            native = compiled_costs(s, hw=hw)
            low = compiled_costs(
                s, hw=hw, weights=LLAMARL_WEIGHTS[platform], train_row=native["train_row"]
            )
            base = None
            for costs in (native, low):
                r = predict_compiled(s, costs, hw)
                base = r if costs is native else base
                r |= dict(
                    platform=platform.upper(),
                    weights="bf16" if r["weights"] == "native" else r["weights"],
                    split=f"{r['gpus']} ({r['gen_gpus']} generate, TP {r['tp']})",
                    sync_s=f"{r['sync_generate']:.2f} + {r['sync_train']:.2f} + "
                    f"{r['sync_reshard']:.2f} = {r['sync']:.2f}",
                    async_s=f"max({r['async_generate']:.2f}, {r['async_train']:.2f} + "
                    f"{r['async_push']:.2f}) = {r['asynch']:.2f}",
                    decode_ms=f"{r['async_decode_ms']:.1f}",
                    speedups=f"{r['speedup']:.2f}x / {r['paper_speedup']:.2f}x",
                    vs_bf16=f"{r['sync'] / base['sync']:.2f} / {r['asynch'] / base['asynch']:.2f}",
                    plan_s=round(time.perf_counter() - start, 1),
                )  # fmt: skip
                rows.append(r)
                print(
                    json.dumps({"bench": "quantized_plans_llamarl", **r}, default=str), flush=True
                )
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--table", choices=("matmul", "decode", "llamarl", "all"), default="all")
    parser.add_argument("--models", default="8B", help="LlamaRL settings: 8B, 70B")
    parser.add_argument("--platforms", default="h100,v5p", help="LlamaRL rows: h100, v5p")
    args = parser.parse_args(argv)
    models, platforms_ = args.models.split(","), args.platforms.split(",")
    if bad := [p for p in platforms_ if p not in LLAMARL_WEIGHTS]:
        raise SystemExit(f"--platforms {bad}: use some of {sorted(LLAMARL_WEIGHTS)}")
    if bad := [m for m in models if m not in ("8B", "70B")]:
        raise SystemExit(f"--models {bad}: use some of 8B, 70B")
    platforms.compile_only()
    from bench.common import write_results

    with platforms.without_plugin_noise():
        if args.table in ("matmul", "all"):
            note = (
                f"[R, {K}] @ [{K}, {N}] (Llama 3 8B's MLP up / gate) on one H100 (XLA:GPU) and "
                "one v5e chip (TPU compiler), deviceless; bytes / FLOPs / kernels of the run "
                "(jaxrl.infra.hlo_cost)"
            )
            print(write_results("quantized_plans_matmul", matmul_table(), MATMUL_COLUMNS, note))
        if args.table in ("decode", "all"):
            note = (
                "the 8B plans' generator per device (launch.plan's plan_generator_role), bf16 "
                "against the engine's 8-bit copy; decode bytes / FLOPs: the whole step as "
                "compiled (hlo_cost); step times at the device's peaks"
            )
            print(write_results("quantized_plans_decode", decode_table(), DECODE_COLUMNS, note))
        if args.table in ("llamarl", "all"):
            note = (
                "bench.scale_llamarl --compiled's composition with the generator's programs on "
                "bf16 and on the engine's 8-bit copy (train step compiled once, shared)"
            )
            rows = llamarl_table(models, platforms_)
            name = "quantized_plans_llamarl" + "".join(f"_{m.lower()}" for m in models if m != "8B")
            if platforms_ != ["h100", "v5p"]:
                name += "".join(f"_{p}" for p in platforms_)
            print(write_results(name, rows, LLAMARL_COLUMNS, note))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

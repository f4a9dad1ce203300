"""Run the programs `launch.plan` compiled for a GPU without one, on a GPU, and measure them.

    python -m launch.plan --gin_file=configs/plan/llama3_1b_h200.gin --serialize_to=/tmp/aot
    python -m bench.gpu_check --aot_dir=/tmp/aot          # on a machine with the GPU

For each `<program>.aot` in the directory (train_step, prefill, decode_step, weight_push):

1. deserializes the executable XLA:GPU built deviceless (`serialize_executable.
   deserialize_and_load`) and runs it on zero-filled inputs of its argument shapes, laid out
   as it expects (donated inputs are made afresh for every call): median seconds a call over
   `--steps` calls after `--warmup`;
2. compiles the same program on the device (the planner's own functions on a mesh of the real
   GPUs, so XLA:GPU autotunes its GEMMs), times it the same way, and prints both, with the
   device compile's `memory_analysis()` total beside the deviceless one.

Reported: the train step's MFU (6 x params x tokens of the step over seconds x the GPU's dense
BF16 peak, `jaxrl.infra.gpu.SYSTEMS`), the decode step's tokens/s (one token per slot a call)
and the HBM bandwidth it used (its argument bytes, the weights and the KV cache it reads, over
its seconds, also as a share of the GPU's peak), the prefill's tokens/s, the seconds of the
weight push's largest chunk (the program `launch.plan` serializes).

First (`parity`), the library's GPU kernels against XLA on the device: the fused attention
(`jaxrl.models.gpu_attention`: output and dq / dk / dv on padded, packed and shared-prompt
layouts, GQA, fp32 and bf16, against `dense_reference` at the highest matmul precision) and the
in-place decode kernel (`jaxrl.models.decode_kernel`, against `jax.nn.dot_product_attention`),
each error (max |a - b| / max |b|) beside its limit (`PARITY_LIMITS`: fp32 runs the kernels'
dots in TF32 on the GPU, as XLA does); a miss makes the run exit 1.

Results go to bench/results/gpu_check.json / .md. Needs a GPU: elsewhere it exits 2 and says so,
after checking its arguments.
"""

from __future__ import annotations

import argparse
import functools
import glob
import os
import pickle
import statistics
import sys
import time

from jaxrl.infra.paths import user_path
from jaxrl.infra.platforms import quiet_jax_start, without_plugin_noise

PROGRAMS = ("train_step", "prefill", "decode_step", "weight_push")
# Parity limits by dtype on a GPU (TF32 dots for fp32, bf16 inputs), and in interpret mode.
PARITY_LIMITS = {"float32": 2e-3, "bfloat16": 2e-2, "interpret": 1e-5}


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--aot_dir", required=True, type=user_path, help="launch.plan --serialize_to's directory"
    )
    parser.add_argument("--steps", type=int, default=10, help="timed calls a program")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls first")
    parser.add_argument(
        "--no_device_compile", action="store_true", help="only run the deserialized programs"
    )
    parser.add_argument("--results", default="gpu_check", help="bench/results/<name>.json/.md")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error(f"--steps={args.steps} must be >= 1 and --warmup={args.warmup} >= 0")
    paths = sorted(glob.glob(os.path.join(args.aot_dir, "*.aot")))
    if not paths:
        parser.error(
            f"--aot_dir={args.aot_dir!r} holds no .aot files: write them with `python -m "
            "launch.plan --gin_file=configs/plan/llama3_1b_h200.gin --serialize_to=DIR`"
        )
    unknown = [p for p in paths if os.path.basename(p)[: -len(".aot")] not in PROGRAMS]
    if unknown:
        parser.error(f"not programs of launch.plan ({', '.join(PROGRAMS)}): {unknown}")
    return args, paths


def _inputs(compiled, args_spec):
    """Zero-filled arguments of `compiled`'s shapes, with its input shardings."""
    import jax
    import jax.numpy as jnp

    shardings = jax.tree.leaves(compiled.input_shardings)
    leaves = [
        jax.device_put(jnp.zeros(shape, dtype), sharding)
        for (shape, dtype), sharding in zip(args_spec, shardings, strict=True)
    ]
    return jax.tree.unflatten(compiled.in_tree, leaves)


def time_calls(compiled, args_spec, steps: int, warmup: int) -> float:
    """Median seconds of one call of `compiled` (inputs made afresh for each: some are
    donated)."""
    import jax

    times = []
    for i in range(warmup + steps):
        call_args, call_kwargs = _inputs(compiled, args_spec)
        jax.block_until_ready((call_args, call_kwargs))
        start = time.perf_counter()
        jax.block_until_ready(compiled(*call_args, **call_kwargs))
        if i >= warmup:
            times.append(time.perf_counter() - start)
        del call_args, call_kwargs
    return statistics.median(times)


def device_programs(config: dict) -> dict:
    """The planner's programs compiled on this machine's GPUs: {name: ProgramReport}."""
    import dataclasses

    import jax

    from jaxrl.infra.mesh import MeshConfig, make_mesh
    from jaxrl.plan.programs import plan_generator, plan_trainer, plan_weight_push
    from jaxrl.train.trainer import LossConfig, OptimizerConfig
    from launch.plan import PlanConfig

    fields = {f.name for f in dataclasses.fields(PlanConfig)}
    plan = PlanConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in config.items()
                         if k in fields})  # fmt: skip

    def mesh(axes, sizes):
        devices = jax.devices()
        return make_mesh(MeshConfig(tuple(axes), tuple(sizes)), devices)

    trainer_mesh = mesh(plan.trainer_axes, plan.trainer_axis_sizes)
    generator_mesh = mesh(plan.generator_axes, plan.generator_axis_sizes)
    out = {}
    if "trainer" in plan.roles:
        report, _ = plan_trainer(
            plan.model_config("trainer"),
            trainer_mesh,
            rows=plan.prompts * plan.samples,
            prompt_len=plan.prompt_len,
            completion_len=plan.completion_len,
            optimizer=OptimizerConfig(learning_rate=1e-6, grad_accum_steps=plan.grad_accum_steps),
            loss=LossConfig(name=plan.loss),
        )
        out["train_step"] = report
    if "generator" in plan.roles:
        prefill, decode = plan_generator(
            plan.model_config("generator"),
            generator_mesh,
            num_slots=plan.slots,
            samples=plan.samples,
            prompt_len=plan.prompt_len,
            completion_len=plan.completion_len,
        )
        out.update(prefill=prefill, decode_step=decode)
    if "push" in plan.roles:
        out["weight_push"] = plan_weight_push(
            plan.model_config("trainer"),
            trainer_mesh,
            plan.model_config("generator"),
            generator_mesh,
        ).report
    return out


def measures(name: str, seconds: float, saved: dict, spec) -> dict:
    """The figures of one program's timing: MFU, tokens/s, bandwidth (module docstring)."""
    from jaxrl.models.presets import preset

    c = saved["config"]
    rows = c["prompts"] * c["samples"]
    slots = c["num_slots"] or rows
    out = {}
    if name == "train_step":
        flops = 6 * preset(c["model"]).num_params() * rows * (c["prompt_len"] + c["completion_len"])
        out["MFU"] = flops / (seconds * spec.peak_flops)
    elif name == "decode_step":
        read = sum(_nbytes(shape, dtype) for shape, dtype in saved["args"])
        out["tokens/s"] = slots / seconds
        out["HBM GB/s"] = read / seconds / 1e9
        out["HBM share"] = read / seconds / spec.hbm_bandwidth
    elif name == "prefill":
        out["tokens/s"] = max(slots // c["samples"], 1) * c["prompt_len"] / seconds
    return out


def _flash_layouts(b: int, t: int):
    """(segment, prefix) of a padded batch (left and right padding), packed rows (3 sequences)
    and a shared-prompt row (a prompt and 3 completions), `[b, t]` int32 each."""
    import numpy as np

    valid = np.zeros((b, t), np.int32)
    for r in range(b):
        n = t - 3 - r * t // (2 * b)  # real tokens: right padding on odd rows, left on even
        valid[r] = np.arange(t) < n if r % 2 else np.arange(t) >= t - n
    packed = np.zeros((b, t), np.int32)
    packed[:, : t // 4], packed[:, t // 4 : 2 * t // 3], packed[:, 2 * t // 3 : t - 2] = 1, 2, 3
    shared = np.zeros((b, t), np.int32)
    cuts = (0, t // 4, t // 2, 3 * t // 4, t - 3)
    for i, (a, z) in enumerate(zip(cuts[:-1], cuts[1:], strict=True)):
        shared[:, a:z] = i + 1
    return {
        "padded": (valid, valid),
        "packed": (packed, packed),
        "shared_prompt": (shared, np.where(shared > 0, 1, 0).astype(np.int32)),
    }


def _out_and_grads(attention, q, k, v, segment, prefix, w):
    """The output on real queries and dq / dk / dv of sum(out * w) there, float32."""
    import jax
    import jax.numpy as jnp

    real = (segment > 0)[:, :, None, None]

    def loss(q, k, v):
        out = attention(q, k, v, segment, prefix).astype(jnp.float32)
        return jnp.sum(jnp.where(real, out * w, 0.0)), jnp.where(real, out, 0.0)

    (_, out), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(q, k, v)
    return [x.astype(jnp.float32) for x in (out, *grads)]


def parity(cpu: bool = False) -> list[dict]:
    """The GPU kernels' errors against XLA (module docstring); `cpu`: tiny shapes in Pallas
    interpret mode, fp32 (a check of this function on a machine without a GPU)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from bench.decode_kernel_gpu import errors as decode_errors
    from jaxrl.models import gpu_attention

    b, t, h, kv, d = (2, 32, 4, 2, 16) if cpu else (2, 1024, 8, 4, 128)
    blocks = dict(block_q=16, block_k=16, block_q_bwd=16, block_k_bwd=16) if cpu else {}
    rng = np.random.default_rng(0)
    rows = []
    for dtype in ("float32",) if cpu else ("float32", "bfloat16"):
        q = jnp.asarray(rng.normal(size=(b, t, h, d)), dtype)
        k, v = (jnp.asarray(rng.normal(size=(b, t, kv, d)), dtype) for _ in range(2))
        w = jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32)
        for layout, ids in _flash_layouts(b, t).items():
            segment, prefix = (jnp.asarray(x) for x in ids)
            with jax.default_matmul_precision("highest"):
                ref = _out_and_grads(gpu_attention.dense_reference, q, k, v, segment, prefix, w)
            flash = functools.partial(gpu_attention.flash_attention, interpret=cpu, **blocks)
            ours = _out_and_grads(flash, q, k, v, segment, prefix, w)
            error = max(
                float(jnp.abs(a - r).max()) / float(jnp.abs(r).max())
                for a, r in zip(ours, ref, strict=True)
            )
            rows.append(dict(kernel="flash_attention", case=layout, dtype=dtype, error=error))
    for r in decode_errors(cpu):
        for key in ("error", "stacked_error"):
            case = r["shape"] + (" (stacked cache)" if key == "stacked_error" else "")
            rows.append(dict(kernel="decode_attention", case=case, dtype=r["dtype"], error=r[key]))
    rows = [r for r in rows if not (cpu and r["dtype"] != "float32")]
    for r in rows:
        r["limit"] = PARITY_LIMITS["interpret" if cpu else r["dtype"]]
        r["ok"] = r["error"] <= r["limit"]
    return rows


def _nbytes(shape, dtype) -> int:
    import numpy as np

    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


def main(argv=None) -> int:
    args, paths = parse_args(argv)
    quiet_jax_start()
    import jax
    from jax.experimental import serialize_executable

    from jaxrl.infra import gpu

    with without_plugin_noise():  # starting the backends, on a machine without a driver
        devices = jax.devices()
    if devices[0].platform != "gpu":
        print(
            f"bench.gpu_check needs a GPU; this machine runs JAX on {devices[0].platform} "
            f"({len(devices)} devices). Copy {args.aot_dir} to a machine with the GPU the plan "
            "was compiled for and run it there.",
            file=sys.stderr,
        )
        return 2
    spec = gpu.device_spec(devices)
    checks = parity()
    for row in checks:
        print(row, flush=True)
    saved = {}
    for path in paths:
        with open(path, "rb") as f:
            item = pickle.load(f)
        saved[item["name"]] = item
    config = next(iter(saved.values()))["config"]
    on_device = {} if args.no_device_compile else device_programs(config)
    rows = []
    for name in PROGRAMS:
        if name not in saved:
            continue
        item = saved[name]
        loaded = serialize_executable.deserialize_and_load(
            item["payload"], item["in_tree"], item["out_tree"]
        )
        seconds = time_calls(loaded, item["args"], args.steps, args.warmup)
        row = dict(program=name, source="deviceless, deserialized", seconds=seconds)
        row.update(measures(name, seconds, item, spec))
        rows.append(row)
        print(row, flush=True)
        report = on_device.get(name)
        if report is not None:
            seconds = time_calls(report.compiled, item["args"], args.steps, args.warmup)
            row = dict(
                program=name,
                source="compiled on the device",
                seconds=seconds,
                compile_s=report.compile_seconds,
                total_GiB=report.total_bytes / 1024**3,
            )
            row.update(measures(name, seconds, item, spec))
            rows.append(row)
            print(row, flush=True)
    from bench.common import command, machine, write_results

    columns = [("program", "program"), ("source", "executable"), ("seconds", "s a call"),
               ("MFU", "MFU"), ("tokens/s", "tokens/s"), ("HBM GB/s", "HBM GB/s"),
               ("HBM share", "of peak BW"), ("compile_s", "compile s"),
               ("total_GiB", "memory GiB"), ("kernel", "kernel"), ("case", "parity case"),
               ("dtype", "dtype"), ("error", "error vs XLA"), ("limit", "limit"),
               ("ok", "within")]  # fmt: skip
    print(write_results(args.results, checks + rows, columns, f"`{command()}` on {machine()}"))
    misses = [r for r in checks if not r["ok"]]
    for r in misses:
        print(f"parity: {r['kernel']} {r['case']} {r['dtype']}: error {r['error']:.3g} over "
              f"{r['limit']:.0e}", file=sys.stderr)  # fmt: skip
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())

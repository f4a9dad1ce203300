"""Plan an RL run for TPU slices or NVIDIA GPU nodes without the hardware: compile the trainer's
RL step, the generator's prefill / decode and the weight push for the target topologies and
print what one device needs.

    python -m launch.plan --gin_file=configs/plan/llama3_8b_grpo.gin
    python -m launch.plan --gin_file=configs/plan/llama3_8b_grpo_h100.gin
    python -m launch.plan --gin_param='PlanConfig.model="llama3_70b"' \
        --gin_param='PlanConfig.trainer_topology="v5p:4x4x4"'
    python -m launch.plan --gin_file=configs/plan/llama3_1b_h200.gin --serialize_to=/tmp/aot

A topology names its platform: a TPU slice ('v5p:2x2x2', `jaxrl.infra.tpu`) or a GPU system
('<system>:<nodes>x<gpus>', 'h100:1x8', 'h200:2x8', `jaxrl.infra.gpu`); both print the same
tables. Everything is abstract (`jax.ShapeDtypeStruct`s with shardings): nothing is allocated,
no checkpoint is read. Needs the libtpu wheel for TPUs and the CUDA plugin + ptxas wheels for
GPUs (all in the `test` extra). It runs JAX on the CPU whatever the machine has, unless
JAX_PLATFORMS says otherwise (`jaxrl.infra.platforms.compile_only`). Exits 1 when a program does not
fit its device's memory, with the mesh change that would make it fit; 2 on a config error.
`--serialize_to=DIR` writes each compiled program (`jax.experimental.serialize_executable`) for
`bench/gpu_check.py` to load and run on a real device.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import pickle
import sys
from pathlib import Path
from typing import Any

import gin
import jax

from jaxrl.generation import quantize
from jaxrl.infra import gpu, platforms, tpu
from jaxrl.infra.chips import ChipSpec, TopologyError
from jaxrl.infra.config import (
    ConfigError,
    build_config,
    parse_gin,
    register_config,
    resolve_bindings,
    without_gin_call_notes,
)
from jaxrl.infra.mesh import MeshConfig, make_mesh, resolve_axis_sizes
from jaxrl.infra.paths import user_path
from jaxrl.models.presets import PRESETS, preset
from jaxrl.plan.programs import (
    GiB,
    ProgramReport,
    generator_fix,
    plan_generator,
    plan_trainer,
    plan_weight_push,
    probe_per_step,
    roofline_seconds,
    trainer_fix_layout,
)
from jaxrl.train.trainer import LossConfig, OptimizerConfig
from launch.plan_notes import (  # noqa: F401  (GPU_DEFAULT_MEM_FRACTION: public here)
    GPU_DEFAULT_MEM_FRACTION,
    hand_count_lines,
    memory_fraction_note,
    xla_notes,
)

ROLES = ("trainer", "generator", "push")


def parse_topology(name: str) -> None:
    """Checks a TPU slice or GPU system name (`jaxrl.infra.tpu` / `jaxrl.infra.gpu`)."""
    (gpu if gpu.is_gpu_topology(name) else tpu).parse_topology(name)


def topology_devices(name: str) -> list[jax.Device]:
    return (gpu if gpu.is_gpu_topology(name) else tpu).topology_devices(name)


def device_spec(devices) -> ChipSpec:
    """The per-device memory and peaks of `devices`, whichever platform they are."""
    return (gpu if devices[0].platform == "gpu" else tpu).device_spec(devices)


@register_config
@dataclasses.dataclass(frozen=True)
class PlanConfig:
    """One RL step's shapes and where each role runs.

    model: a preset of `jaxrl.models.presets.PRESETS` (real Llama 3.1 / Qwen3 shapes).
    trainer_param_dtype: the trainer's master weights and Adam moments; generator_param_dtype:
      the weights the generator decodes with (the weight push casts); dtype: compute dtype.
    generator_weights: the engine's copy of them, `GeneratorConfig.weights` ("native", "int8",
      "fp8" ...: `jaxrl.generation.quantize`; fp8 is refused on TPU).
    *_topology: a TPU slice, '<chip>:<X>x<Y>[x<Z>]' (whole hosts: 2x2 chips each).
    *_axes / *_axis_sizes: the role's mesh over the slice (one size may be -1: the rest).
      Trainer axes from ("dp", "fsdp", "tp") (dp replicates the weights), generator ("dp", "tp").
    prompts x samples rollouts of prompt_len + completion_len tokens per step.
    num_slots: generator decode rows held at once (0: prompts x samples, all at once).
    grad_accum_steps: trainer micro-batches per step.
    per_step_cost: also compile 1- and 2-layer probes to scale FLOPs / bytes to a whole step
      (XLA counts a loop body once).
    roles: which roles to plan, from `ROLES`: "trainer" (the RL step), "generator" (prefill
      and one decode step), "push" (the weight push from the trainer's layout to the
      generator's, compiled on the trainer devices).
    Topologies: a TPU slice ('v5p:2x2x2') or a GPU system ('h100:1x8'). attention_impl as
      `ModelConfig.attention_impl`: None, the platform's own (GPU: the Pallas Triton kernels;
      TPU: the Pallas Mosaic kernels), "xla", "pallas" (as None); "cudnn" is refused (TPUs
      cannot run it; on GPUs it needs the cuDNN wheel and does not serialize).
    """

    model: str = "llama3_8b"
    trainer_param_dtype: str = "float32"
    generator_param_dtype: str = "bfloat16"
    generator_weights: str = "native"
    dtype: str = "bfloat16"
    remat_policy: str = "full"
    scan_layers: bool = True
    attention_impl: str | None = None
    trainer_topology: str = "v5p:2x2x2"
    trainer_axes: tuple[str, ...] = ("fsdp", "tp")
    trainer_axis_sizes: tuple[int, ...] = (-1, 1)
    generator_topology: str = "v5e:2x2"
    generator_axes: tuple[str, ...] = ("dp", "tp")
    generator_axis_sizes: tuple[int, ...] = (1, -1)
    prompts: int = 64
    samples: int = 8
    prompt_len: int = 1024
    completion_len: int = 1024
    num_slots: int = 0
    grad_accum_steps: int = 1
    loss: str = "grpo"
    per_step_cost: bool = False
    roles: tuple[str, ...] = ROLES

    def validate(self) -> None:
        if self.model not in PRESETS:
            raise ValueError(f"model={self.model!r}; choose one of {sorted(PRESETS)}")
        for name in ("trainer_topology", "generator_topology"):
            parse_topology(getattr(self, name))
        unknown = set(self.roles) - set(ROLES)
        if unknown or not self.roles:
            raise ValueError(f"roles={self.roles}; use some of {ROLES}")
        on_gpu = [gpu.is_gpu_topology(t) for t in (self.trainer_topology, self.generator_topology)]
        if any(on_gpu) and self.attention_impl == "cudnn":
            raise ValueError(
                "attention_impl='cudnn' on a GPU topology: cuDNN attention needs the ~2 GB "
                "nvidia-cudnn-cu12 wheel and its executables do not serialize; plan with None "
                "(the GPU's Pallas Triton kernels, the default) or 'xla'"
            )
        if not all(on_gpu) and self.attention_impl == "cudnn":
            raise ValueError(
                "attention_impl='cudnn' on a TPU topology: cuDNN runs on NVIDIA GPUs only; plan "
                "with None (the TPU's Pallas Mosaic kernels, the default) or 'xla'"
            )
        quantize.resolve_format(self.generator_weights, "gpu" if on_gpu[1] else "tpu")
        for name in ("prompts", "samples", "prompt_len", "completion_len", "grad_accum_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if (self.prompts * self.samples) % self.grad_accum_steps:
            raise ValueError(
                f"{self.prompts} x {self.samples} rollouts do not split into "
                f"grad_accum_steps={self.grad_accum_steps} micro-batches"
            )
        self.model_config("trainer")  # dtype / remat / attention names

    @property
    def slots(self) -> int:
        return self.num_slots or self.prompts * self.samples

    def model_config(self, role: str):
        param_dtype = self.trainer_param_dtype if role == "trainer" else self.generator_param_dtype
        return preset(
            self.model,
            param_dtype=param_dtype,
            dtype=self.dtype,
            remat_policy=self.remat_policy,
            scan_layers=self.scan_layers,
            attention_impl=self.attention_impl,
        )


def _mesh(role: str, topology: str, axes, sizes):
    """The role's mesh over every device of `topology`: a mesh on part of the slice failed
    later, and misleadingly (a 3-device FSDP axis: "pad the vocabulary" for an embedding of
    4096), or planned a run that leaves chips idle."""
    devices = topology_devices(topology)
    field = f"PlanConfig.{role}_axis_sizes={tuple(sizes)}"
    try:
        n = math.prod(resolve_axis_sizes(sizes, len(devices)))
    except ValueError as err:
        raise TopologyError(f"{field} on {topology!r}: {err}") from None
    if n != len(devices):
        raise TopologyError(
            f"{field} (axes {tuple(axes)}) is a mesh of {n} devices, but {topology!r} has "
            f"{len(devices)}: a plan's mesh spans its slice. Give sizes whose product is "
            f"{len(devices)} (one may be -1: the rest), or another {role}_topology."
        )
    return make_mesh(MeshConfig(tuple(axes), tuple(sizes)), devices), devices


def table_cost(report: ProgramReport, spec: ChipSpec, step_cost: tuple[float, float] | None):
    """(FLOPs, bytes, roofline seconds) of a program as its table row gives them: the probes'
    whole step with `per_step_cost`, else XLA's cost analysis (a loop body once)."""
    flops, bytes_ = step_cost or (report.flops, report.bytes_accessed)
    return flops, bytes_, roofline_seconds(flops, bytes_, spec.peak_flops, spec.hbm_bandwidth)


def _row(report: ProgramReport, spec: ChipSpec, step_cost: tuple[float, float] | None):
    p = report.parts
    state = p.get("optimizer", 0)
    # The compiler's arguments beyond params / optimizer / cache: the batch, less any input
    # the program never reads (jit drops it: prefill computes no logits, so no lm_head).
    data = report.argument_bytes - p["params"] - state - p.get("kv_cache", 0)
    flops, bytes_, roofline = table_cost(report, spec, step_cost)
    return [
        report.name,
        f"{p['params'] / GiB:.2f}",
        f"{state / GiB:.2f}",
        f"{p.get('kv_cache', 0) / GiB:.2f}",
        f"{data / GiB:.2f}",
        f"{report.temp_bytes / GiB:.2f}",
        f"{report.total_bytes / GiB:.2f}",
        f"{spec.hbm_bytes / GiB:.0f}",
        "yes" if report.total_bytes <= spec.hbm_bytes else "NO",
        f"{flops:.3g}",
        f"{bytes_:.3g}",
        f"{roofline * 1e3:.3g}",
        f"{report.compile_seconds:.0f}",
    ]


HEADER = [
    "program",
    "params",
    "optimizer",
    "kv cache",
    "batch/other",
    "temp",
    "total",
    "HBM",
    "fits",
    "FLOPs",
    "bytes",
    "roofline ms",
    "compile s",
]


def print_table(title: str, rows: list[list[str]]) -> None:
    """One role's programs, the same columns on every platform (the title names the device)."""
    print(f"\n{title}  (per device; GiB unless named)")
    widths = [max(len(r[i]) for r in [HEADER, *rows]) for i in range(len(HEADER))]
    for r in [HEADER, *rows]:
        print("| " + " | ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) + " |")


# JAX on a GPU takes this share of the device's memory unless told otherwise.
def _config_lines(config: PlanConfig, fix) -> list[str]:
    """The gin lines that plan the trainer with `fix` (a `TrainerFix`), and a config file of
    `configs/plan/` that holds them already, if one does."""
    topology = config.trainer_topology
    if gpu.is_gpu_topology(topology):
        target = gpu.topology_with(gpu.parse_topology(topology)[0], fix.devices)
    else:
        target = tpu.slice_with(tpu.parse_topology(topology)[0], fix.devices)
    lines = []
    if target and target != topology:
        lines.append(f'PlanConfig.trainer_topology = "{target}"')
    if tuple(config.trainer_axes) == ("fsdp", "tp"):
        lines.append(f"PlanConfig.trainer_axis_sizes = ({fix.fsdp}, {fix.tp})")
    else:
        lines.append('PlanConfig.trainer_axes = ("fsdp", "tp")')
        lines.append(f"PlanConfig.trainer_axis_sizes = ({fix.fsdp}, {fix.tp})")
    if fix.grad_accum_steps and fix.grad_accum_steps != config.grad_accum_steps:
        lines.append(f"PlanConfig.grad_accum_steps = {fix.grad_accum_steps}")
    return lines


CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


def ready_config(model: str, lines: list[str]) -> str | None:
    """A file of configs/plan/ that sets every one of `lines` for `model` (itself or through a
    file it includes), as a path relative to the repository; None if there is none."""
    folder = Path(CONFIG_DIR) / "plan"
    if not folder.is_dir():
        return None
    repo = Path(CONFIG_DIR).parent
    model_line = f'PlanConfig.model = "{model}"'
    for path in sorted(folder.glob("*.gin")):
        text = path.read_text(encoding="utf-8")
        if not all(line in text for line in lines):
            continue
        includes = [x.split("'")[1] for x in text.splitlines() if x.startswith("include '")]
        texts = [text] + [
            (repo / i).read_text(encoding="utf-8") for i in includes if (repo / i).is_file()
        ]
        if any(model_line in t for t in texts):
            return f"configs/plan/{path.name}"
    return None


def _where(topology: str, spec: ChipSpec, devices, mesh) -> str:
    return f"{topology} ({spec.name}, {len(devices)} devices), mesh {dict(mesh.shape)}"


@dataclasses.dataclass(frozen=True)
class RolePlan:
    """One role's compiled programs and where they were planned: `reports` (the trainer's
    train_step; the generator's prefill and decode_step), the device's `spec`, the `devices` and
    `mesh`, `costs` (per program name, the whole step's (FLOPs, bytes) from the 1- and 2-layer
    probes with `PlanConfig.per_step_cost`, else None) and the role's `model_config`."""

    reports: list[ProgramReport]
    spec: ChipSpec
    devices: list
    mesh: Any
    costs: dict[str, tuple[float, float] | None]
    model_config: Any


def plan_trainer_role(config: PlanConfig) -> RolePlan:
    """Compiles the trainer's RL step as `launch.plan` plans it (no printing)."""
    mesh, devices = _mesh(
        "trainer", config.trainer_topology, config.trainer_axes, config.trainer_axis_sizes
    )
    spec = device_spec(devices)
    optimizer = OptimizerConfig(learning_rate=1e-6, grad_accum_steps=config.grad_accum_steps)
    rows = config.prompts * config.samples
    kwargs = dict(
        rows=rows,
        prompt_len=config.prompt_len,
        completion_len=config.completion_len,
        optimizer=optimizer,
        loss=LossConfig(name=config.loss),
    )
    model_config = config.model_config("trainer")
    report, _ = plan_trainer(model_config, mesh, **kwargs)
    step_cost = None
    if config.per_step_cost:  # one micro-batch x 1 / 2 layers, times the micro-batches
        micro = dict(kwargs, rows=rows // config.grad_accum_steps)
        micro["optimizer"] = dataclasses.replace(optimizer, grad_accum_steps=1)

        def probe(c):
            r, _ = plan_trainer(c, mesh, **micro)
            return r.flops, r.bytes_accessed

        flops, bytes_ = probe_per_step(probe, model_config)
        step_cost = (flops * config.grad_accum_steps, bytes_ * config.grad_accum_steps)
    return RolePlan([report], spec, devices, mesh, {report.name: step_cost}, model_config)


def trainer_scores_dims(config: PlanConfig, model_config) -> tuple[int, tuple[int, ...]]:
    """(sequence, the model's dims) for `hand_count_lines`' look for `[T, T]` scores."""
    c = model_config
    dims = (c.hidden_size, c.intermediate_size, c.vocab_size, c.num_heads * c.head_dim,
            c.num_kv_heads * c.head_dim)  # fmt: skip
    return config.prompt_len + config.completion_len, dims


def _trainer(config: PlanConfig, problems: list[str]) -> list[ProgramReport]:
    role = plan_trainer_role(config)
    (report,), spec, devices, mesh = role.reports, role.spec, role.devices, role.mesh
    step_cost, rows = role.costs[report.name], config.prompts * config.samples
    title = (
        f"trainer: {config.model} on {_where(config.trainer_topology, spec, devices, mesh)}, "
        f"{rows} rollouts x {config.prompt_len}+{config.completion_len} tokens, "
        f"{config.grad_accum_steps} micro-batches, remat {config.remat_policy}"
    )
    print_table(title, [_row(report, spec, step_cost)])
    memory_fraction_note([report], spec, devices)
    xla_notes(report, spec)
    for line in hand_count_lines(report, spec, *trainer_scores_dims(config, role.model_config)):
        print(line)
    if report.error:
        print(f"  the compiler refused: {report.error}")
    if report.total_bytes > spec.hbm_bytes:
        fix = trainer_fix_layout(report, mesh, spec.hbm_bytes, rows, config.grad_accum_steps)
        lines = _config_lines(config, fix)
        ready = ready_config(config.model, lines)
        problems.append(
            f"trainer: the RL step needs {report.total_bytes / GiB:.2f} GiB per device, "
            f"{spec.name} has {spec.hbm_bytes / GiB:.0f} GiB; fix: {fix.text}\n"
            "  plan it with these lines (in your config, or as --gin_param='...'):\n"
            + "".join(f"    {line}\n" for line in lines)
            + (f"  or: python -m launch.plan --gin_file={ready}" if ready else "").rstrip()
        )
    return [report]


def plan_generator_role(config: PlanConfig) -> RolePlan:
    """Compiles the generator's prefill and decode step as `launch.plan` plans them (no
    printing)."""
    mesh, devices = _mesh(
        "generator", config.generator_topology, config.generator_axes, config.generator_axis_sizes
    )
    spec = device_spec(devices)
    model_config = config.model_config("generator")
    kwargs = dict(
        num_slots=config.slots,
        samples=config.samples,
        prompt_len=config.prompt_len,
        completion_len=config.completion_len,
        weights=config.generator_weights,
    )
    prefill, decode = plan_generator(model_config, mesh, **kwargs)
    costs: dict[str, tuple[float, float] | None] = {"prefill": None, "decode_step": None}
    if config.per_step_cost:
        probes = {}

        def probe(c):
            p, d = plan_generator(c, mesh, **kwargs)
            probes.setdefault(c.num_layers, (p, d))
            return p.flops, p.bytes_accessed

        costs["prefill"] = probe_per_step(probe, model_config)
        costs["decode_step"] = tuple(
            a + (model_config.num_layers - 1) * (b - a)
            for a, b in zip(
                (probes[1][1].flops, probes[1][1].bytes_accessed),
                (probes[2][1].flops, probes[2][1].bytes_accessed),
                strict=True,
            )
        )
    return RolePlan([prefill, decode], spec, devices, mesh, costs, model_config)


def _generator(config: PlanConfig, problems: list[str]) -> list[ProgramReport]:
    role = plan_generator_role(config)
    (prefill, decode), spec, devices, mesh = role.reports, role.spec, role.devices, role.mesh
    costs = role.costs
    title = (
        f"generator: {config.model} on "
        f"{_where(config.generator_topology, spec, devices, mesh)}, {config.slots} slots x "
        f"{config.prompt_len + config.completion_len} tokens, prefill "
        f"{max(config.slots // config.samples, 1)} prompts"
    )
    if config.generator_weights != "native":
        title += f", {config.generator_weights} weights"
    rows = [_row(r, spec, costs[r.name]) for r in (prefill, decode)]
    print_table(title, rows)
    memory_fraction_note([prefill, decode], spec, devices)
    copy = "per-layer copy of the scanned weights (`Engine(layer_layout=...)`)"
    if config.generator_weights != "native":
        copy = f"{config.generator_weights} copy of the weights, held beside them"
    if decode.resident_bytes:
        print(
            f"  the engine decodes on its own {copy}: {decode.resident_bytes / GiB:.2f} GiB "
            "more per device, in the totals"
        )
    for r in (prefill, decode):
        xla_notes(r, spec)
    for r in (prefill, decode):
        for line in hand_count_lines(r, spec):
            print(line)
    for r in (prefill, decode):
        if r.error:
            print(f"  the compiler refused {r.name}: {r.error}")
    worst = max((prefill, decode), key=lambda r: r.total_bytes)
    if worst.total_bytes > spec.hbm_bytes:
        problems.append(
            f"generator: {worst.name} needs {worst.total_bytes / GiB:.2f} GiB per device, "
            f"{spec.name} has {spec.hbm_bytes / GiB:.0f} GiB; "
            f"fix: {generator_fix(worst, config.slots, spec.hbm_bytes, mesh)}"
        )
    return [prefill, decode]


def _push(config: PlanConfig, problems: list[str]) -> list[ProgramReport]:
    source, devices = _mesh(
        "trainer", config.trainer_topology, config.trainer_axes, config.trainer_axis_sizes
    )
    target, _ = _mesh(
        "generator", config.generator_topology, config.generator_axes, config.generator_axis_sizes
    )
    spec = device_spec(devices)
    push = plan_weight_push(
        config.model_config("trainer"), source, config.model_config("generator"), target
    )
    title = (
        f"weight push: {config.model} from the trainer on "
        f"{_where(config.trainer_topology, spec, devices, source)} to the generator's "
        f"layout {dict(target.shape)}, {config.trainer_param_dtype} -> "
        f"{config.generator_param_dtype}"
    )
    print_table(title, [_row(push.report, spec, None)])
    memory_fraction_note([push.report], spec, devices)
    xla_notes(push.report, spec)
    print(
        f"  memory: the largest of the {push.chunks} chunk(s) weight_sync pushes one at a time "
        f"({push.peak_extra_bytes / GiB:.2f} GiB extra on a device); FLOPs / bytes: all of "
        f"them; then copied slice for slice to the generator: {push.moved_bytes / GiB:.2f} GiB"
        " in all"
    )
    if push.report.total_bytes > spec.hbm_bytes:
        problems.append(
            f"push: one chunk's cast and reshard need {push.report.total_bytes / GiB:.2f} GiB "
            f"per device, {spec.name} has {spec.hbm_bytes / GiB:.0f} GiB; fix: a smaller "
            "WeightSync chunk_bytes (a leaf larger than it is a chunk by itself: shard the "
            "trainer over more devices)"
        )
    return [push.report]


def serialize(reports: list[ProgramReport], config: PlanConfig, directory: str) -> list[str]:
    """Writes each compiled program to `directory/<program>.aot` (pickle of
    `serialize_executable.serialize`'s payload and trees, the argument shapes / dtypes and the
    plan's config), for `bench/gpu_check.py`; returns the paths."""
    from jax.experimental import serialize_executable

    os.makedirs(directory, exist_ok=True)
    paths = []
    for report in reports:
        if report.compiled is None:
            continue
        payload, in_tree, out_tree = serialize_executable.serialize(report.compiled)
        args = [(tuple(a.shape), str(a.dtype)) for a in jax.tree.leaves(report.compiled.in_avals)]
        path = os.path.join(directory, f"{report.name}.aot")
        with open(path, "wb") as f:
            pickle.dump(
                dict(
                    name=report.name,
                    payload=payload,
                    in_tree=in_tree,
                    out_tree=out_tree,
                    args=args,
                    flops=report.flops,
                    bytes_accessed=report.bytes_accessed,
                    config=dataclasses.asdict(config),
                ),
                f,
            )
        paths.append(path)
    return paths


@gin.configurable
def plan_main(config: PlanConfig = PlanConfig(), serialize_to: str = "") -> int:
    """Compiles and prints each role's programs; returns the exit status (1: does not fit).
    With `serialize_to`, writes the compiled programs there (`serialize`)."""
    problems: list[str] = []
    reports: list[ProgramReport] = []
    for role, plan in (("trainer", _trainer), ("generator", _generator), ("push", _push)):
        if role in config.roles:
            reports += plan(config, problems)
    if serialize_to:
        for path in serialize(reports, config, user_path(serialize_to)):
            print(f"wrote {path}")
    print()
    if problems:
        for line in problems:
            print(f"DOES NOT FIT: {line}")
        return 1
    print("verdict: fits")
    return 0


def plan_kwargs(gin_files: list[str], gin_params: list[str]) -> dict:
    """`plan_main`'s arguments from gin files and bindings (gin is left parsed); `config`
    always among them."""
    parse_gin(gin_files, gin_params)
    kwargs = resolve_bindings(plan_main, skip=())
    if "config" not in kwargs:  # `PlanConfig.x = ...` bindings without `plan_main.config`
        kwargs["config"] = build_config(PlanConfig, gin.get_bindings("PlanConfig"))
    return kwargs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gin_file", action="append", default=[])
    parser.add_argument("--gin_param", action="append", default=[])
    parser.add_argument(
        "--serialize_to",
        default="",
        type=user_path,
        help="write the compiled programs here (bench/gpu_check.py)",
    )
    args = parser.parse_args(argv)
    try:
        kwargs = plan_kwargs(args.gin_file, args.gin_param)
        if args.serialize_to:
            kwargs["serialize_to"] = args.serialize_to
        platforms.compile_only()
        # Backends start lazily (libtpu, the CUDA plugin): hold their "no driver" lines back.
        with platforms.without_plugin_noise():
            return plan_main(**kwargs)
    except (ConfigError, TopologyError) as err:
        print(f"config error: {without_gin_call_notes(err)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""Ahead-of-time plans: compile the trainer's RL step and the generator's prefill / decode for a
device mesh (typically a TPU topology described without TPUs, `jaxrl.infra.tpu`) from abstract
inputs, and read per-device memory and cost from the compiler.

Nothing is allocated: parameters, optimizer state, batches and KV caches are
`jax.ShapeDtypeStruct`s carrying the role's `NamedSharding`s, so an 8B-405B model plans on a
laptop. What a program needs on one device, from `compiled.memory_analysis()`:

    total = arguments + outputs - aliased (donated) + temporaries + generated code

Arguments are split into parts counted by hand from the shardings (`sharded_bytes`: each leaf's
`sharding.shard_shape(shape)` x itemsize): parameters, optimizer state, batch, KV cache; they sum
to the compiler's argument bytes (checked by the tests). `temp` holds activations, gradients and
the compiler's scratch.

FLOPs and bytes accessed are `compiled.cost_analysis()` per device. XLA counts the body of a
loop once (scanned layers, micro-batches, decode steps), so the raw figures are "one layer,
one micro-batch"; `PerStepCost` scales them to a whole step from two extra probe compiles with
1 and 2 unrolled layers (see `probe_per_step`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl.generation.engine import Engine
from jaxrl.generation.sampling import SamplingConfig
from jaxrl.infra import hlo_cost, platforms
from jaxrl.infra import sharding as ax
from jaxrl.models.config import ModelConfig
from jaxrl.models.transformer import Transformer, decode_attention_form
from jaxrl.plan import hand_count
from jaxrl.plan.fixes import (  # noqa: F401  (public here)
    TrainerFix,
    fmt_gib,
    generator_fix,
    trainer_fix,
    trainer_fix_layout,
)
from jaxrl.rl import RolloutBatch
from jaxrl.train.trainer import LossConfig, OptimizerConfig, Trainer

GiB = 1024**3


# The TPU allocator's smallest buffer: a scalar or a tiny array takes 512 bytes of HBM.
TPU_MIN_BUFFER = 512


def min_buffer_bytes(tree: Any) -> int:
    """The smallest buffer the allocator of `tree`'s devices gives a leaf: `TPU_MIN_BUFFER` on
    TPU; on GPU (and CPU) a buffer's bytes are its size (XLA:GPU's `memory_analysis()` counts a
    scalar as 4 bytes)."""
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        if sharding is not None:
            return TPU_MIN_BUFFER if next(iter(sharding.device_set)).platform == "tpu" else 0
    return TPU_MIN_BUFFER


def mesh_min_buffer(mesh) -> int:
    """`TPU_MIN_BUFFER` for a mesh of TPU devices, else 0 (see `min_buffer_bytes`)."""
    return TPU_MIN_BUFFER if mesh.devices.flat[0].platform == "tpu" else 0


def sharded_bytes(tree: Any, min_buffer: int | None = None) -> int:
    """Bytes one device holds of `tree` (ShapeDtypeStructs or arrays with NamedShardings).

    Each leaf contributes `max(prod(sharding.shard_shape(shape)) * itemsize, min_buffer)`
    (`min_buffer` by default from the devices' platform, `min_buffer_bytes`);
    shardings here split evenly (`param_shardings` checks it). Exact when each shard's two minor
    dimensions are multiples of the TPU tile (8 x 128 for 32-bit types), as real models' are;
    smaller odd shapes are padded by the compiler's layout and count more in `memory_analysis`.
    """
    if min_buffer is None:
        min_buffer = min_buffer_bytes(tree)
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = tuple(leaf.shape)
        sharding = getattr(leaf, "sharding", None)
        if sharding is not None:
            shape = sharding.shard_shape(shape)
        total += max(math.prod(shape) * np.dtype(leaf.dtype).itemsize, min_buffer)
    return total


@dataclasses.dataclass(frozen=True)
class ProgramReport:
    """One compiled program on one device: memory (bytes), cost, compile time.

    parts: hand-counted argument bytes by name (params, optimizer, batch, kv_cache, ...).
    flops / bytes_accessed: the compiler's cost analysis (loop bodies counted once).
    """

    name: str
    compile_seconds: float
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    code_bytes: int
    flops: float
    bytes_accessed: float
    parts: dict[str, int]
    error: str | None = None  # the compiler's out-of-memory message when it refused
    compiled: Any = dataclasses.field(default=None, repr=False, compare=False)
    # XLA's own memory estimates logged while compiling (`XlaMemoryNotes`), None if it logged
    # none.
    xla_notes: XlaMemoryNotes | None = None
    # The least work of the program (`jaxrl.plan.hand_count`): whole step, per device.
    hand: hand_count.HandCount | None = None
    # Bytes a device holds for the program outside its buffers: the stacked weights a GPU
    # engine's per-layer copy is made from (`EnginePrograms.engine_params`).
    resident_bytes: int = 0

    def whole_step_cost(self) -> tuple[float, float] | None:
        """(FLOPs, bytes) per device of the whole program as it runs: `jaxrl.infra.hlo_cost`
        over the optimized HLO, loops times their trip counts, Pallas kernels by their models
        (XLA's cost analysis counts loop bodies once and cannot look into kernels)."""
        if self.compiled is None:
            return None
        flops, bytes_, _ = hlo_cost.totals(hlo_cost.kernels(self.compiled.as_text()))
        return flops, bytes_

    @functools.cached_property
    def _arrays(self) -> list[tuple[str, int]]:
        """Every array the program's unfused computations produce, largest first (the HLO
        parsed once for `largest_buffers` and `square_buffers`)."""
        if self.compiled is None:
            return []
        return hlo_cost.largest_arrays(self.compiled.as_text(), count=None)

    def largest_buffers(self, count: int = 5) -> list[tuple[str, int]]:
        """The largest arrays the program's instructions produce outside fused computations
        (shape, bytes), largest first: where its temporaries go."""
        return self._arrays[:count]

    def largest_collectives(self, count: int = 3) -> list[tuple[str, str, int, int, str]]:
        """The program's largest collectives (`hlo_cost.largest_collectives`: opcode, shape,
        bytes, devices per group, the JAX operation's name), largest first."""
        if self.compiled is None:
            return []
        return hlo_cost.largest_collectives(self.compiled.as_text(), count)

    def square_buffers(self, length: int) -> list[tuple[str, int]]:
        """The arrays the program allocates with two trailing dims of `length` (attention
        scores `[..., T, T]` over a sequence of `length`), largest first."""
        return [(s, n) for s, n in self._arrays if hlo_cost.dims(s)[-2:] == [length, length]]

    @property
    def total_bytes(self) -> int:
        return (
            self.argument_bytes
            + self.output_bytes
            - self.alias_bytes
            + self.temp_bytes
            + self.code_bytes
            + self.resident_bytes
        )

    @property
    def other_argument_bytes(self) -> int:
        """Argument bytes the parts do not name (small index arrays, keys)."""
        return self.argument_bytes - sum(self.parts.values())


@dataclasses.dataclass(frozen=True)
class XlaMemoryNotes:
    """Memory estimates XLA:GPU logs while it compiles, before buffer assignment.

    remat_bytes / remat_limit_bytes: the rematerialization pass's "Can't reduce memory use below
    <limit> by rematerialization; only reduced to <remat>". The pass adds the program's outputs
    to the peak of its own schedule: where the outputs overwrite donated inputs (a train step's
    new weights and optimizer state), those bytes count twice. `launch.plan`'s Llama 3 70B step
    on h100:4x8: 105.34 GiB = 80.69 GiB peak + 24.65 GiB outputs, where the buffer assignment
    (`memory_analysis()`, the buffers the program allocates) is 73.14 GiB.
    io_bytes / io_limit_bytes: the GPU scheduler's "The byte size of input/output arguments
    (<io>) exceeds the base limit (<limit>)": the arguments and the outputs not aliased to them
    leave it no memory budget to schedule in.
    lines: the log lines themselves.
    """

    remat_bytes: int | None = None
    remat_limit_bytes: int | None = None
    io_bytes: int | None = None
    io_limit_bytes: int | None = None
    lines: tuple[str, ...] = ()


_REMAT = re.compile(
    r"Can't reduce memory use below [\d.]+\w+ \((\d+) bytes\) by rematerialization; only "
    r"reduced to [\d.]+\w+ \((\d+) bytes\)"
)
_IO = re.compile(r"byte size of input/output arguments \((\d+)\) exceeds the base limit \((\d+)\)")


def xla_memory_notes(lines: list[str]) -> tuple[XlaMemoryNotes | None, list[str]]:
    """Splits compiler log `lines` into XLA's memory estimates and the other lines."""
    fields: dict[str, int] = {}
    kept, rest = [], []
    for line in lines:
        if match := _REMAT.search(line):
            fields["remat_limit_bytes"], fields["remat_bytes"] = map(int, match.groups())
        elif match := _IO.search(line):
            fields["io_bytes"], fields["io_limit_bytes"] = map(int, match.groups())
        else:
            rest.append(line)
            continue
        kept.append(line.strip())
    return (XlaMemoryNotes(**fields, lines=tuple(kept)) if kept else None), rest


def compile_report(name: str, lowered, parts: dict[str, int]) -> tuple[ProgramReport, Any]:
    """Compiles `lowered` and reads its memory and cost analyses; returns (report, compiled).
    XLA's memory estimates logged while compiling go to the report (`XlaMemoryNotes`); the
    compiler's other log lines pass through to stderr."""
    start = time.perf_counter()
    log: list[str] = []
    try:
        with platforms.stderr_lines() as log:
            compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as err:
        platforms.write_stderr([x for x in log if not platforms.is_plugin_noise(x)])
        if "RESOURCE_EXHAUSTED" not in str(err):
            raise
        return _out_of_memory(name, str(err), parts, time.perf_counter() - start), None
    seconds = time.perf_counter() - start
    notes, rest = xla_memory_notes(log)
    platforms.write_stderr([x for x in rest if not platforms.is_plugin_noise(x)])
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis() or cost_from_hlo(compiled)
    if isinstance(cost, list):  # older JAX: one dict per program
        cost = cost[0] if cost else {}
    report = ProgramReport(
        name=name,
        compile_seconds=seconds,
        argument_bytes=int(memory.argument_size_in_bytes),
        output_bytes=int(memory.output_size_in_bytes),
        alias_bytes=int(memory.alias_size_in_bytes),
        temp_bytes=int(memory.temp_size_in_bytes),
        code_bytes=int(memory.generated_code_size_in_bytes),
        flops=float(cost.get("flops", 0.0)),
        bytes_accessed=float(cost.get("bytes accessed", 0.0)),
        parts=dict(parts),
        compiled=compiled,
        xla_notes=notes,
    )
    return report, compiled


def cost_from_hlo(compiled) -> dict[str, float]:
    """XLA's cost analysis (FLOPs, bytes accessed, per device) of `compiled`'s optimized HLO,
    run on the CPU client: for programs compiled for a GPU topology without a GPU, whose
    `cost_analysis()` is None. The analysis walks the HLO, so fusions (Triton GEMMs included)
    count their dots; loop bodies count once, as on TPU."""
    from jax._src.lib import _jax

    modules = compiled.runtime_executable().hlo_modules()
    client = jax.devices("cpu")[0].client
    total: dict[str, float] = {"flops": 0.0, "bytes accessed": 0.0}
    for module in modules:
        cost = _jax.hlo_module_cost_analysis(client, module)
        for key in total:
            total[key] += float(cost.get(key, 0.0))
    return total


_UNITS = {"K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}
_TEMPORARIES = re.compile(r"HLO temporaries \(([\d.]+)([KMGT])\)")


def _out_of_memory(name: str, message: str, parts: dict[str, int], seconds: float):
    """A report for a program the TPU compiler refused for lack of HBM: the arguments as counted
    by hand, the temporaries as the compiler's message states them (0 if it names none)."""
    match = _TEMPORARIES.search(message)
    temp = int(float(match.group(1)) * _UNITS[match.group(2)]) if match else 0
    first = next((line for line in message.splitlines() if "RESOURCE_EXHAUSTED" in line), "")
    return ProgramReport(
        name=name,
        compile_seconds=seconds,
        argument_bytes=sum(parts.values()),
        output_bytes=0,
        alias_bytes=0,
        temp_bytes=temp,
        code_bytes=0,
        flops=float("nan"),
        bytes_accessed=float("nan"),
        parts=dict(parts),
        error=first.strip(),
    )


# --- the trainer --------------------------------------------------------------------------------


def abstract_rollout_batch(rows: int, prompt_len: int, completion_len: int) -> RolloutBatch:
    """ShapeDtypeStructs of a `RolloutBatch` of `rows` rollouts."""
    s = jax.ShapeDtypeStruct
    b, p, t = rows, prompt_len, completion_len
    return RolloutBatch(
        prompt_ids_bp=s((b, p), jnp.int32),
        prompt_mask_bp=s((b, p), bool),
        completion_ids_bt=s((b, t), jnp.int32),
        completion_mask_bt=s((b, t), bool),
        completion_length_b=s((b,), jnp.int32),
        behaviour_logprobs_bt=s((b, t), jnp.float32),
        policy_version_b=s((b,), jnp.int32),
        reward_b=s((b,), jnp.float32),
        group_id_b=s((b,), jnp.int32),
        valid_b=s((b,), bool),
    )


def trainer_rules(mesh: jax.sharding.Mesh) -> ax.LogicalRules:
    """`TRAINER_RULES`, with the batch also split over a "dp" axis when the mesh has one
    (a mesh ("dp", "fsdp", "tp") replicates the weights over dp: plain data parallelism)."""
    if "dp" not in mesh.axis_names:
        return ax.TRAINER_RULES
    return tuple(
        (name, ("dp", "fsdp") if name == ax.ACT_BATCH else target)
        for name, target in ax.TRAINER_RULES
    )


def plan_trainer(
    model_config: ModelConfig,
    mesh: jax.sharding.Mesh,
    *,
    rows: int,
    prompt_len: int,
    completion_len: int,
    optimizer: OptimizerConfig,
    loss: LossConfig,
    rules: ax.LogicalRules | None = None,
) -> tuple[ProgramReport, Any]:
    """Compiles `Trainer.rl_step` for `rows` rollouts of `prompt_len + completion_len` tokens.

    Returns (report, compiled); report.parts: params, optimizer (incl. the step counter), batch.
    """
    rules = trainer_rules(mesh) if rules is None else rules
    trainer = Trainer(
        model_config,
        mesh,
        rules,
        optimizer.make(1000),
        grad_accum_steps=optimizer.grad_accum_steps,
        loss=loss,
    )
    batch = abstract_rollout_batch(rows, prompt_len, completion_len)
    state = trainer.abstract_state()
    batch_sharded = ax.attach_shardings(batch, ax.batch_shardings(batch, mesh, rules))
    floor = mesh_min_buffer(mesh)
    parts = {
        "params": sharded_bytes(state.params, floor),
        "optimizer": sharded_bytes(state.opt_state, floor) + sharded_bytes(state.step, floor),
        "batch": sharded_bytes(batch_sharded, floor),
    }
    report, compiled = compile_report("train_step", trainer.lower_rl_step(batch), parts)
    sizes = dict(mesh.shape)
    shards = sizes.get("dp", 1) * sizes.get("fsdp", 1)
    hand = hand_count.train_step(
        model_config,
        rollouts=rows / shards,
        prompt_len=prompt_len,
        completion_len=completion_len,
        micro_batches=optimizer.grad_accum_steps,
        tp=sizes.get("tp", 1),
        state_bytes=parts["params"] + parts["optimizer"],
    )
    return dataclasses.replace(report, hand=hand), compiled


# --- the generator ------------------------------------------------------------------------------


def abstract_params(model_config: ModelConfig, mesh, rules) -> tuple[nnx.GraphDef, dict]:
    """(graphdef, pure-dict params of ShapeDtypeStructs laid out by `rules` on `mesh`)."""
    graphdef, abstract = nnx.split(
        nnx.eval_shape(lambda: Transformer(model_config, rngs=nnx.Rngs(0)))
    )
    shardings = nnx.to_pure_dict(ax.param_shardings(abstract, mesh, rules))
    return graphdef, ax.attach_shardings(nnx.to_pure_dict(abstract), shardings)


def plan_generator(
    model_config: ModelConfig,
    mesh: jax.sharding.Mesh,
    *,
    num_slots: int,
    samples: int,
    prompt_len: int,
    completion_len: int,
    rules: ax.LogicalRules = ax.GENERATOR_RULES,
    span: int | None = None,
    weights: str = "native",
) -> tuple[ProgramReport, ProgramReport]:
    """Compiles the engine's prefill (`num_slots // samples` prompts, each copied into `samples`
    slots) and one decode step of all `num_slots` slots attending a cache prefix of `span`
    positions (default: the full cache, `prompt_len + completion_len`), on the engine's copy of
    the weights in format `weights` (`GeneratorConfig.weights`: 8-bit kernels and their scales
    are then the programs' parameters); parts: params (the copy the programs take), kv_cache
    (and the prompts for prefill)."""
    capacity = prompt_len + completion_len
    graphdef, params = abstract_params(model_config, mesh, rules)
    engine = Engine(
        graphdef,
        model_config,
        num_slots=num_slots,
        pad_id=model_config.pad_token_id or 0,
        eos_ids=model_config.eos_token_ids,
        max_total_len=capacity,
        steps_per_call=1,
        prompt_buckets=(prompt_len,),
        span_buckets=tuple(sorted({capacity, span or capacity})),
        mesh=mesh,
        rules=rules,
        compile_only=True,
        weights=weights,
    )
    floor = mesh_min_buffer(mesh)
    cache_bytes = sharded_bytes(engine.abstract_cache(), floor)
    copy = engine.programs.engine_params(params, abstract=True)
    common = {"params": sharded_bytes(copy, floor), "kv_cache": cache_bytes}
    prompts = max(num_slots // samples, 1)
    # Decode attention is traced in the target's form (this process's default backend may be
    # the CPU while the mesh is a TPU or GPU topology): on GPUs the in-place decode kernel.
    target = mesh.devices.flat[0].platform
    with decode_attention_form({"cpu": "host", "gpu": "pallas_gpu", "tpu": "pallas_tpu"}[target]):
        prefill, _ = compile_report(
            "prefill",
            engine.lower_prefill(params, prompts, prompt_len),
            common,
        )
        sampling = SamplingConfig(max_new_tokens=completion_len, ignore_eos=True)
        lowered = engine.lower_decode(params, sampling, span=span)
        decode, _ = compile_report("decode_step", lowered, common)
    sizes = dict(mesh.shape)
    tp, dp = sizes.get("tp", 1), sizes.get("dp", 1)
    quantized = engine.programs.weights != "native"
    cache = dict(capacity=capacity, cache_bytes=cache_bytes, tp=tp, quantized=quantized)
    hand = hand_count.prefill(model_config, prompts=prompts / dp, prompt_len=prompt_len, **cache)
    prefill = dataclasses.replace(prefill, hand=hand)
    hand = hand_count.decode_step(model_config, rows=num_slots / dp, span=span or capacity, **cache)
    # A GPU engine decodes on its own per-layer (and an 8-bit engine on its quantized) copy of
    # the weights it is given, held beside them.
    resident = sharded_bytes(params, floor) if engine.programs.unstack or quantized else 0
    prefill = dataclasses.replace(prefill, resident_bytes=resident)
    return prefill, dataclasses.replace(decode, hand=hand, resident_bytes=resident)


# --- the weight push -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PushPlan:
    """The weight push's compiled program (cast + reshard on the trainer mesh) and its routes.

    report: the jit of the push's largest chunk (memory as the library runs it: one chunk at a
      time), FLOPs and bytes scaled to the whole push by the bytes it moves;
    moved_bytes: the generator's copy of the weights, in all (what crosses to its devices);
    chunks / peak_extra_bytes: `WeightSync`'s pause-and-swap chunks and the most bytes one
    chunk adds on one device."""

    report: ProgramReport
    moved_bytes: int
    chunks: int
    peak_extra_bytes: int


def plan_weight_push(
    trainer_config: ModelConfig,
    trainer_mesh: jax.sharding.Mesh,
    generator_config: ModelConfig,
    generator_mesh: jax.sharding.Mesh,
    *,
    source_rules: ax.LogicalRules | None = None,
    target_rules: ax.LogicalRules = ax.GENERATOR_RULES,
) -> PushPlan:
    """Compiles the weight push from the trainer's layout to the generator's, as
    `jaxrl.sync.in_process.WeightSync` (transport "reshard", the GPU / TPU default) runs it: per
    chunk, one jit on the trainer devices casts the chunk's weights to the generator's dtype
    and reshards them to a layout whose blocks are generator blocks (a "shadow"); a
    slice-for-slice `device_put` then copies those blocks to the generator devices. The chunk
    compiled is the one with the largest per-device footprint; its FLOPs and bytes are scaled
    to all chunks by the bytes each moves. Rules: the trainer's (`trainer_rules`) and the
    generator's. Report parts: params (the trainer's weights the chunk's jit reads)."""
    from jaxrl.sync.in_process import WeightSync

    source_rules = trainer_rules(trainer_mesh) if source_rules is None else source_rules
    _, source = abstract_params(trainer_config, trainer_mesh, source_rules)
    _, target = abstract_params(generator_config, generator_mesh, target_rules)
    shardings = lambda tree: jax.tree.map(lambda x: x.sharding, tree)  # noqa: E731
    sync = WeightSync(
        shardings(source),
        shardings(target),
        generator_dtype=generator_config.param_dtype,
        transport="reshard",
    )
    plan = sync.plan(source)
    leaves = jax.tree.leaves(source)
    made = [r for r in plan.routes if r.resharded or r.cast]
    if not made:
        raise ValueError(
            "the weight push needs no cast or reshard (the generator's layout and dtype are "
            "the trainer's): it is a slice-for-slice copy, nothing to compile; drop 'push' "
            "from PlanConfig.roles"
        )
    chunk_of = {i: c for c, chunk in enumerate(plan.chunks) for i in chunk}
    by_chunk: dict[int, list] = {}
    for r in made:
        by_chunk.setdefault(chunk_of[r.index], []).append(r)
    biggest = max(by_chunk, key=lambda c: plan.chunk_extra_bytes[c])
    routes = by_chunk[biggest]
    dtypes = [r.dtype for r in routes]
    push = jax.jit(
        lambda xs: [x.astype(d) for x, d in zip(xs, dtypes, strict=True)],
        out_shardings=[r.source_sharding for r in routes],
    )
    inputs = [leaves[r.index] for r in routes]
    parts = {"params": sharded_bytes(inputs, mesh_min_buffer(trainer_mesh))}
    report, compiled = compile_report("weight_push", push.lower(inputs), parts)
    scale = sum(r.moved_bytes for r in made) / sum(r.moved_bytes for r in routes)
    report = dataclasses.replace(
        report, flops=report.flops * scale, bytes_accessed=report.bytes_accessed * scale
    )
    return PushPlan(report, plan.bytes_moved, len(plan.chunks), plan.peak_extra_bytes)


# --- per-step cost from probes -------------------------------------------------------------------


def extrapolate_layers(cost_1: float, cost_2: float, num_layers: int) -> float:
    """Cost of `num_layers` layers from programs with 1 and 2 (unrolled) layers:
    `c(L) = c(1) + (L - 1) (c(2) - c(1))`."""
    return cost_1 + (num_layers - 1) * (cost_2 - cost_1)


def probe_per_step(
    plan_fn: Callable[[ModelConfig], tuple[float, float]], model_config: ModelConfig
) -> tuple[float, float]:
    """(FLOPs, bytes) per device of a whole program, from `plan_fn(config)` -> (flops, bytes) on
    the model cut to 1 and 2 unrolled layers (no loop over layers, so nothing is counted once)."""
    one = plan_fn(model_config.replace(num_layers=1, scan_layers=False))
    two = plan_fn(model_config.replace(num_layers=2, scan_layers=False))
    return tuple(
        extrapolate_layers(a, b, model_config.num_layers) for a, b in zip(one, two, strict=True)
    )


def roofline_seconds(flops: float, bytes_accessed: float, peak_flops: float, bandwidth: float):
    """A program's time at its device's peaks: `max(FLOPs / peak, bytes / bandwidth)`."""
    return max(flops / peak_flops, bytes_accessed / bandwidth)

"""What makes a planned program fit (`jaxrl.plan.programs`, `launch.plan`): the trainer's mesh and
micro-batching, the generator's tensor parallelism or slots, estimated from a `ProgramReport`'s
parts. `jaxrl.plan.programs` re-exports these names."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

# A `jaxrl.plan.programs.ProgramReport` (not imported: planning imports this module).
ProgramReport = Any

GiB = 1024**3


def fmt_gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


@dataclasses.dataclass(frozen=True)
class TrainerFix:
    """The layout that makes a train step fit: `devices` in a mesh ('fsdp', 'tp') = (fsdp, tp),
    with `grad_accum_steps` micro-batches; `text` says it in words (None where activations
    still do not fit: then `text` names what else to change)."""

    text: str
    devices: int
    fsdp: int
    tp: int
    grad_accum_steps: int | None


def trainer_fix(report: ProgramReport, mesh, hbm: int, rows: int, micro_batches: int) -> str:
    """`trainer_fix_layout(...).text`."""
    return trainer_fix_layout(report, mesh, hbm, rows, micro_batches).text


def trainer_fix_layout(
    report: ProgramReport, mesh, hbm: int, rows: int, micro_batches: int
) -> TrainerFix:
    """The mesh change (and, if activations still do not fit, the micro-batching) that makes the
    train step fit `hbm` bytes per device; estimates from the report's parts.

    Model: params + optimizer + gradients (in temp) shard over fsdp x tp; the rest of temp
    (activations) scales with the rows of one micro-batch on one device; everything is planned
    within 90% of HBM.
    """
    sizes = dict(mesh.shape)
    n, tp = mesh.size, sizes.get("tp", 1)
    shard_now = sizes.get("fsdp", 1) * tp
    batch_now = sizes.get("fsdp", 1) * sizes.get("dp", 1)
    state = report.parts["params"] + report.parts["optimizer"]
    grads = report.parts["params"]
    state_total = (state + grads) * shard_now
    act = max(report.total_bytes - state - grads, 0)
    act_row = act * batch_now * micro_batches / rows  # per (row / device / micro-batch)
    budget = 0.9 * hbm
    devices = n
    while state_total / devices > budget / 2 and devices < 2**16:
        devices *= 2
    where = (
        f"shard with fsdp={devices // tp}: mesh axes ('fsdp', 'tp') = ({devices // tp}, {tp})"
        if devices == n
        else f"use at least {devices} devices with fsdp={devices // tp} (a larger slice or more "
        f"nodes: the sharded weights, gradients and Adam state take {fmt_gib(state_total)} in "
        "all)"
    )
    state_dev = state_total / devices
    split = devices // tp  # the batch is split over fsdp
    layout = dict(devices=devices, fsdp=devices // tp, tp=tp)
    for m in [k for k in range(micro_batches, rows + 1) if rows % k == 0]:
        if (rows // m) % split:
            continue
        act_dev = act_row * (rows // m // split)
        if state_dev + act_dev <= budget:
            accum = "" if m == micro_batches else f", and grad_accum_steps={m}"
            text = f"{where}{accum} (about {fmt_gib(state_dev + act_dev)} per device)"
            return TrainerFix(text, grad_accum_steps=m, **layout)
    text = (
        f"{where}; activations still do not fit: use the fused attention (attention_impl None, "
        "the GPU's or TPU's own: no [S, S] score matrices) or shorter sequences"
    )
    return TrainerFix(text, grad_accum_steps=None, **layout)


def generator_fix(program: ProgramReport, num_slots: int, hbm: int, mesh) -> str:
    """The change that makes the generator's largest `program` (prefill or decode) fit: more tp
    for the weights, fewer slots for the KV cache (the cache and the program's temporaries scale
    with the slots: the decode step's hold a working copy of the cache off GPU, the prefill's the
    prompts' fresh cache, one prompt per `samples` slots)."""
    params = program.parts["params"]
    per_slot = (program.parts["kv_cache"] + program.temp_bytes) / num_slots
    fixed = program.total_bytes - params - per_slot * num_slots
    budget = 0.9 * hbm
    tp = dict(mesh.shape).get("tp", 1)
    if params + fixed > budget / 2:
        return (
            f"the weights take {fmt_gib(params)} per device: raise tp above {tp} "
            "(mesh ('dp', 'tp')) or use a larger slice"
        )
    dp = dict(mesh.shape).get("dp", 1)
    fit = int((budget - params - fixed) // per_slot)
    slots = 2 ** int(math.log2(fit)) if fit >= 1 else 0
    slots = (slots // dp) * dp
    if slots < 1:
        return f"one slot per dp replica does not fit: raise tp above {tp}"
    return (
        f"lower num_slots to {slots} ({fmt_gib(per_slot)} of KV cache and {program.name} "
        "temporaries per slot per device)"
    )

"""The lines `launch.plan` prints under a role's table: the GPU memory share a program needs,
what XLA's own memory estimates mean for the verdict, and each program's whole-step cost beside
its hand count."""

from __future__ import annotations

from jaxrl.infra.chips import ChipSpec
from jaxrl.plan.programs import GiB, ProgramReport

GPU_DEFAULT_MEM_FRACTION = 0.75


def memory_fraction_note(reports: list[ProgramReport], spec: ChipSpec, devices) -> None:
    """On GPUs, names the XLA_PYTHON_CLIENT_MEM_FRACTION a program that fits needs when it is
    over JAX's default share (`GPU_DEFAULT_MEM_FRACTION`) of the memory."""
    if devices[0].platform != "gpu":
        return
    need = max(r.total_bytes for r in reports) / spec.hbm_bytes
    if GPU_DEFAULT_MEM_FRACTION < need <= 1:
        print(
            f"  note: {need:.0%} of the GPU's memory; JAX takes {GPU_DEFAULT_MEM_FRACTION:.0%} "
            f"by default: run with XLA_PYTHON_CLIENT_MEM_FRACTION={min(need + 0.03, 0.99):.2f}"
        )


def xla_notes(report: ProgramReport, spec: ChipSpec) -> None:
    """What XLA's memory lines logged while compiling `report`'s program mean for the verdict.

    The verdict reads the buffer assignment (`memory_analysis()`: the buffers the program
    allocates); XLA:GPU also logs estimates of its own made before that, which can disagree
    (`jaxrl.plan.programs.XlaMemoryNotes` says how they count)."""
    notes = report.xla_notes
    if notes is None:
        return
    total, fits = report.total_bytes, report.total_bytes <= spec.hbm_bytes
    if notes.remat_bytes is not None and abs(notes.remat_bytes - total) <= 0.01 * total:
        print(
            f"  XLA's rematerialization pass could not bring {report.name} under its limit of "
            f"{notes.remat_limit_bytes / GiB:.2f} GiB either (it reached "
            f"{notes.remat_bytes / GiB:.2f} GiB)."
        )
    elif notes.remat_bytes is not None:
        print(
            f"  XLA's rematerialization pass estimated {notes.remat_bytes / GiB:.2f} GiB for "
            f"{report.name} (over its limit of {notes.remat_limit_bytes / GiB:.2f} GiB); the "
            f"buffers the compiled program allocates total {total / GiB:.2f} GiB, and the "
            "verdict reads those. The pass adds the outputs "
            f"({report.output_bytes / GiB:.2f} GiB, {report.alias_bytes / GiB:.2f} GiB of them "
            "written over donated inputs) to the peak of its own schedule, before buffers "
            "are assigned."
        )
    if notes.io_bytes is not None:
        then = (
            "the program does not fit, as the table says"
            if not fits
            else "the buffer assignment fits all the same"
        )
        print(
            f"  XLA's GPU scheduler: the arguments and outputs of {report.name} take "
            f"{notes.io_bytes / GiB:.2f} GiB, over its limit of {notes.io_limit_bytes / GiB:.2f}"
            f" GiB, so it scheduled without a memory budget; {then}."
        )


def whole_step_figures(
    report: ProgramReport, spec: ChipSpec, sequence: int = 0, dims: tuple[int, ...] = ()
) -> dict | None:
    """The program's whole-step FLOPs and bytes per device as compiled (`whole_step_cost`: loops
    counted as they run, Pallas kernels by their models) and their ratios to its hand count
    (`jaxrl.plan.hand_count`); None without either. For the train step also the FLOPs-time and
    bytes-time at the device's peaks and the bound, and with `sequence` the buffers holding
    `[sequence, sequence]` attention scores (None: not looked for, where `sequence` is one of the
    model's `dims`, whose activations would look the same)."""
    cost = report.whole_step_cost() if report.hand is not None and not report.error else None
    if cost is None:
        return None
    flops, bytes_ = cost
    hand = report.hand
    out = dict(
        flops=flops, bytes=bytes_, bytes_ratio=bytes_ / hand.bytes, flops_ratio=flops / hand.flops
    )
    if report.name == "train_step":
        compute, memory = flops / spec.peak_flops, bytes_ / spec.hbm_bandwidth
        out |= dict(
            flops_s=compute,
            bytes_s=memory,
            bound="compute-bound" if compute >= memory else "bytes-bound",
            scores=None if not sequence or sequence in dims else report.square_buffers(sequence),
        )
    return out


def hand_count_lines(
    report: ProgramReport, spec: ChipSpec, sequence: int = 0, dims: tuple[int, ...] = ()
) -> list[str]:
    """`whole_step_figures` as lines: the compiled whole step beside its hand count, as ratios;
    for the train step also whether it is compute-bound at the device's peaks, its largest
    buffers and collectives, and whether any buffer holds `[sequence, sequence]` scores."""
    figures = whole_step_figures(report, spec, sequence, dims)
    if figures is None:
        return []
    flops, bytes_, hand = figures["flops"], figures["bytes"], report.hand
    lines = [
        f"  {report.name}: bytes {figures['bytes_ratio']:.2f}x, FLOPs "
        f"{figures['flops_ratio']:.2f}x the hand count (whole step per device: compiled "
        f"{bytes_:.3g} B, {flops:.3g} FLOP; hand {hand.bytes:.3g} B, {hand.flops:.3g} FLOP; "
        f"bytes: {hand.describe()})"
    ]
    if report.name == "train_step":
        lines.append(
            f"  {report.name}: FLOPs-time {figures['flops_s'] * 1e3:.4g} ms, bytes-time "
            f"{figures['bytes_s'] * 1e3:.4g} ms at the device's peaks: {figures['bound']}"
        )
        biggest = ", ".join(
            f"{shape} {size / GiB:.2f} GiB" for shape, size in report.largest_buffers()
        )
        lines.append(f"  {report.name}: largest buffers: {biggest}")
        collectives = ", ".join(
            f"{op} {shape} {size / GiB:.2f} GiB over {group or 'all'} devices ({_short(name)})"
            for op, shape, size, group, name in report.largest_collectives()
        )
        if collectives:
            lines.append(f"  {report.name}: largest collectives: {collectives}")
        square = figures["scores"]
        if sequence and square is None:
            lines.append(
                f"  {report.name}: [{sequence}, {sequence}] scores not looked for: the sequence "
                "length equals a dimension of the model's"
            )
        elif sequence:
            lines.append(
                f"  {report.name}: no buffer of [{sequence}, {sequence}] scores"
                if not square
                else f"  {report.name}: buffers of [{sequence}, {sequence}] scores: "
                + ", ".join(f"{shape} {size / GiB:.2f} GiB" for shape, size in square[:3])
            )
    return lines


def _short(op_name: str, parts: int = 3) -> str:
    """The last `parts` scopes of a JAX operation's name (where in the model it sits)."""
    return "/".join(op_name.split("/")[-parts:]) or "unnamed"

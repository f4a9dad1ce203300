"""A speed-up model for sync vs async RL: program times from compiled costs and a machine's
constants, checked against this machine's `bench.rl` rows (`bench/scale_validate.py`) and applied
to LlamaRL's 8B / 70B / 405B settings (`bench/scale_llamarl.py`).

Model. A machine is six constants (`Machine`): peak FLOP/s, memory bandwidth, the launch cost of
one kernel, the cost of one program call (dispatch and the host round trip), the cost of
first-touching one fresh page, and the cost of one collective by its devices per group. A
program runs its kernels one after another (XLA:CPU runs a program's thunks in order; on a GPU
the kernels of one stream do too), each at its own roofline:

    t(program) = t_call + sum_k n_k (max(F_k / peak, B_k / bandwidth) + t_launch) + P t_page
                 + sum over its collectives of t_coll(devices per group)

with F_k, B_k the dot FLOPs and bytes of kernel k and n_k how often it runs, loops included
(`jaxrl.infra.hlo_cost.kernels`: `cost_analysis()` counts a loop's body once), and P the pages of
the buffers the allocator maps fresh on every call (glibc `malloc` serves blocks of 32 MiB and more
by `mmap`: a program's temporaries above that are page-faulted and zeroed again at each call; found
by `getrusage` page-fault counts, 48.5k faults = the train step's 199 MB of temporaries, every
step). On SPMD devices the program is the per-device one and the constants are those of one device
working while its siblings work beside it (measured so: `bench.scale_validate`). One RL step:

    Tg = sum over the generator's calls of t(call) + t_host   Tt = t(train step)
    sync (colocated)  = Tg + Tt
    async (LlamaRL)   = max(Tg, Tt + Ts)                 Ts: the weight push

t_host: the generator's host work around its programs (`bench.engine_host`).

    python -m bench.scale_validate      # this machine: predicted vs measured, side by side
    python -m bench.scale_llamarl       # LlamaRL's table next to the model's predictions
"""

from __future__ import annotations

import dataclasses

MMAP_THRESHOLD = 32 * 1024**2  # glibc's largest dynamic mmap threshold (64-bit)
PAGE = 4096


@dataclasses.dataclass(frozen=True)
class Machine:
    """Constants of one device. peak_flops: FLOP/s of a large matmul; bandwidth: bytes/s of a
    streaming pass; launch_s: one kernel's fixed cost; call_s: one program call (dispatch, and
    the host round trip of its small outputs); page_s: first touch of one fresh 4 KiB page;
    collective_s: one collective of devices sharing one runtime (a rendezvous of their threads),
    by the devices per group it was measured with."""

    peak_flops: float
    bandwidth: float
    launch_s: float = 0.0
    call_s: float = 0.0
    page_s: float = 0.0
    collective_s: tuple[tuple[int, float], ...] = ()  # (devices per group, seconds of one)


def roofline(flops: float, bytes_: float, peak_flops: float, bandwidth: float) -> float:
    """Seconds of work bound by compute or by memory traffic, whichever is slower."""
    return max(flops / peak_flops, bytes_ / bandwidth)


def fresh_pages(temp_bytes: int, unaliased_output_bytes: int) -> int:
    """Pages first-touched at every call: the temporaries and the (not donated) outputs, each
    block only when the allocator maps it fresh (>= `MMAP_THRESHOLD`)."""
    return sum(b // PAGE for b in (temp_bytes, unaliased_output_bytes) if b >= MMAP_THRESHOLD)


@dataclasses.dataclass(frozen=True)
class ProgramCost:
    """A program's kernels as (dot FLOPs, bytes, executions) triples, and its fresh pages."""

    kernels: tuple[tuple[float, float, int], ...]
    pages: int = 0
    # (devices per group, executions) of its collectives (all-reduce, all-gather, ...), loops
    # included; devices per group 0: all the program's devices
    collectives: tuple[tuple[int, int], ...] = ()

    @property
    def flops(self) -> float:
        return sum(f * n for f, _, n in self.kernels)

    @property
    def bytes(self) -> float:
        return sum(b * n for _, b, n in self.kernels)

    @property
    def launches(self) -> int:
        return sum(n for *_, n in self.kernels)


def collective_seconds(cost: ProgramCost, m: Machine) -> float:
    """The collectives' rendezvous: each at the cost measured for the smallest group at least its
    size (the largest measured for a group of all devices, 0)."""
    table = dict(m.collective_s)
    if not table:
        return 0.0
    sizes = sorted(table)

    def one(group: int) -> float:
        return table[next((s for s in sizes if s >= group > 0), sizes[-1])]

    return sum(n * one(group) for group, n in cost.collectives)


def program_seconds(cost: ProgramCost, m: Machine) -> float:
    """t(program) of the module docstring."""
    kernels = sum(
        n * (roofline(f, b, m.peak_flops, m.bandwidth) + m.launch_s) for f, b, n in cost.kernels
    )
    return m.call_s + kernels + cost.pages * m.page_s + collective_seconds(cost, m)


@dataclasses.dataclass(frozen=True)
class StepPrediction:
    generate_s: float
    train_s: float
    sync_s: float = 0.0

    @property
    def sync_step_s(self) -> float:
        return self.generate_s + self.train_s

    @property
    def async_step_s(self) -> float:
        return max(self.generate_s, self.train_s + self.sync_s)

    @property
    def speedup(self) -> float:
        return self.sync_step_s / self.async_step_s

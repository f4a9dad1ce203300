"""XLA_FLAGS for JAX on the CPU (the simulated device count and a code-generation guard), and
the host allocator's settings for XLA:CPU's buffers (`keep_freed_memory`).

`CPU_SCHEDULER_FLAG` selects LLVM's "fast" pre-register-allocation scheduler for the kernels
XLA:CPU compiles. The default list scheduler took unbounded time on one kernel of the RL step
(a transposed copy with `cos` fused in, from the attention backward: chain_tiny at 44 tokens, on
an AVX-512 Xeon), so a run or test that reached it never finished compiling; with this flag it
compiles in seconds, and decode calls ran at the same speed (within 5%). It affects XLA:CPU
only, and is set for the CPU runs this project starts (`make`, tests, benchmarks, local
clusters, the demo, and any `python -m launch.<job>` on a machine without a GPU or TPU, through
`set_cpu_xla_flags` in `launch/__init__.py`).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import MutableMapping

from jaxrl.infra.platforms import accelerator_attached

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
CPU_SCHEDULER_FLAG = "--xla_backend_extra_options=-pre-RA-sched=fast"
# XLA:CPU (jaxlib 0.10) hands every f32 dot to YNNPACK (`__ynn_fusion`, with reductions). Its
# GEMM rounds more than XLA's own dot: SmolLM2-135M's fp32 logits are 4.8e-4 from a float64
# forward against 1.3e-4 for XLA's dot and torch (bench/gguf_parity.py). This keeps YNNPACK for
# reductions only. Not set by default (its speed is unmeasured on a quiet machine); the GGUF
# parity benchmark sets it.
CPU_EXACT_DOT_FLAG = "--xla_cpu_experimental_ynn_fusion_type=reduce"


def cpu_xla_flags(flags: str, devices: int | None = None) -> str:
    """`flags` (an XLA_FLAGS value) with `CPU_SCHEDULER_FLAG` (unless backend options are set
    already) and, with `devices`, `devices` simulated CPU devices (unless a count is set)."""
    out = flags.split()
    if devices is not None and not any(f.startswith(DEVICE_COUNT_FLAG) for f in out):
        out.append(f"{DEVICE_COUNT_FLAG}={devices}")
    if not any(f.startswith("--xla_backend_extra_options") for f in out):
        out.append(CPU_SCHEDULER_FLAG)
    return " ".join(out)


def cpu_only(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Whether JAX will run on the CPU, judged before it starts a backend (XLA reads XLA_FLAGS
    then): JAX_PLATFORMS names only cpu, or it is unset and no GPU or TPU is attached
    (`jaxrl.infra.platforms.accelerator_attached`; an installed plugin without its device, as
    the `test` extra's CUDA plugin on a CPU machine, runs nothing)."""
    platforms = environ.get("JAX_PLATFORMS", "").strip()
    if platforms:
        return {p.strip() for p in platforms.split(",")} == {"cpu"}
    return not accelerator_attached()


def add_xla_flag(flag: str, environ: MutableMapping[str, str] = os.environ) -> None:
    """Adds `flag` ("--name=value") to environ's XLA_FLAGS unless a value for its name is set
    there already. Call it before JAX starts a backend."""
    flags = environ.get("XLA_FLAGS", "").split()
    if not any(f.split("=")[0] == flag.split("=")[0] for f in flags):
        environ["XLA_FLAGS"] = " ".join([*flags, flag])


def set_cpu_xla_flags(environ: MutableMapping[str, str] = os.environ) -> None:
    """Adds `CPU_SCHEDULER_FLAG` to environ's XLA_FLAGS when JAX will run on the CPU (the
    user's own flags kept; a --xla_backend_extra_options of theirs wins). Call it before JAX
    starts a backend."""
    if cpu_only(environ):
        environ["XLA_FLAGS"] = cpu_xla_flags(environ.get("XLA_FLAGS", ""))


# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8


KEEP_FREED_MEMORY_ENV = "JAXRL_KEEP_FREED_MEMORY"  # "0": the launchers leave malloc as it is
# The same settings for a process that does not call `keep_freed_memory` (a peer library, an
# older tree in a benchmark): glibc reads GLIBC_TUNABLES when the process starts.
KEEP_FREED_GLIBC_TUNABLES = (
    "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=1000000000000:glibc.malloc.arena_max=1"
)


def allocator_env(environ: MutableMapping[str, str], allocator: str) -> MutableMapping[str, str]:
    """Sets environ's malloc settings for a child process: "keep" (keeps freed memory, through
    GLIBC_TUNABLES and JAXRL_KEEP_FREED_MEMORY=1) or "default" (glibc's own, and the launchers'
    setting off). Benchmarks use it to give every side the same allocator."""
    if allocator not in ("keep", "default"):
        raise ValueError(f"allocator={allocator!r}: expected 'keep' or 'default'.")
    environ.pop("GLIBC_TUNABLES", None)
    if allocator == "keep":
        environ["GLIBC_TUNABLES"] = KEEP_FREED_GLIBC_TUNABLES
    environ[KEEP_FREED_MEMORY_ENV] = "1" if allocator == "keep" else "0"
    return environ


def keep_freed_memory_wanted(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Whether the CPU launchers call `keep_freed_memory` (unless JAXRL_KEEP_FREED_MEMORY=0)."""
    return cpu_only(environ) and environ.get(KEEP_FREED_MEMORY_ENV, "1").strip() != "0"


def keep_freed_memory() -> bool:
    """Has glibc's malloc keep the memory a process frees for its next allocations, instead of
    handing it back to the kernel; returns whether it could (False off glibc).

    XLA:CPU allocates each program's temporary buffers per run and frees them after. Buffers
    over glibc's mmap threshold (at most 32 MB) are mapped fresh each time, and every page of
    them faults in zeroed: SmolLM2-135M's RL train step (32 rows x 192 positions) took 1.08
    million page faults and 4-6 s of kernel time per step at 8 rows, 61 s per step at 32 rows.
    With no mmap'd chunks (`M_MMAP_MAX` 0), no trimming of the heap, and one arena (allocations
    from XLA's threads go to the main heap, not to per-thread arenas that map large chunks
    anyway), a step reuses the last step's pages: 40 s at 32 rows, no page faults after the
    first step. The price is memory: the heap keeps its peak (the process's resident size at
    8 rows: 11.0 GB against 7.3 GB).

    Call it early, before JAX starts its backend (the arena limit applies to threads created
    after it). It changes the whole process's allocator, so the library never calls it on
    import: the CPU launchers do (`launch/__init__.py`; `JAXRL_KEEP_FREED_MEMORY=0` turns it
    off for a run short of memory), and a script may.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # A trim threshold of -1 is SIZE_MAX to glibc (its setter takes a size_t): never trimmed.
    settings = ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, -1), (_M_ARENA_MAX, 1))
    return all(mallopt(param, value) == 1 for param, value in settings)

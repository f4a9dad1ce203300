"""XLA_FLAGS for JAX on the CPU: the simulated device count and a code-generation guard.

`CPU_SCHEDULER_FLAG` selects LLVM's "fast" pre-register-allocation scheduler for the kernels
XLA:CPU compiles. The default list scheduler took unbounded time on one kernel of the RL step
(a transposed copy with `cos` fused in, from the attention backward: chain_tiny at 44 tokens, on
an AVX-512 Xeon), so a run or test that reached it never finished compiling; with this flag it
compiles in seconds, and decode calls ran at the same speed (within 5%). It affects XLA:CPU
only, and is set for the CPU runs this project starts (`make`, tests, benchmarks, local
clusters, the demo); add it to XLA_FLAGS for CPU runs started by hand.
"""

from __future__ import annotations

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
CPU_SCHEDULER_FLAG = "--xla_backend_extra_options=-pre-RA-sched=fast"


def cpu_xla_flags(flags: str, devices: int | None = None) -> str:
    """`flags` (an XLA_FLAGS value) with `CPU_SCHEDULER_FLAG` (unless backend options are set
    already) and, with `devices`, `devices` simulated CPU devices (unless a count is set)."""
    out = flags.split()
    if devices is not None and not any(f.startswith(DEVICE_COUNT_FLAG) for f in out):
        out.append(f"{DEVICE_COUNT_FLAG}={devices}")
    if not any(f.startswith("--xla_backend_extra_options") for f in out):
        out.append(CPU_SCHEDULER_FLAG)
    return " ".join(out)

"""XLA_FLAGS for JAX on the CPU: the simulated device count and a code-generation guard.

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

import glob
import importlib.util
import os
from collections.abc import MutableMapping

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
    then): JAX_PLATFORMS names only cpu, or it is unset and neither a GPU plugin for JAX
    (`jax_plugins`) nor a TPU (a Google PCI device, as JAX itself looks for one) is there."""
    platforms = environ.get("JAX_PLATFORMS", "").strip()
    if platforms:
        return {p.strip() for p in platforms.split(",")} == {"cpu"}
    return importlib.util.find_spec("jax_plugins") is None and not tpu_attached()


def tpu_attached() -> bool:
    """Whether this machine has a TPU: a PCI device of Google's vendor id, which is how JAX
    looks for one (`jax._src.hardware_utils`)."""
    for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
        try:
            with open(vendor) as f:
                if f.read().strip() == "0x1ae0":
                    return True
        except OSError:
            continue
    return False


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

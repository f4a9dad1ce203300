"""NVIDIA GPU systems for ahead-of-time compilation on a machine without GPUs.

`topology_devices("h100:1x8")` returns the `jax.Device`s of one 8-GPU H100 node described by
the CUDA PJRT plugin (`jax.experimental.topologies.get_topology_desc(platform="cuda", ...)`)
with no GPU attached: a mesh built from them lowers and compiles with XLA:GPU to sm_90a machine
code, and `memory_analysis()` reports per-device bytes. That needs the `jax-cuda12-plugin` /
`jax-cuda12-pjrt` wheels and a `ptxas` (the `nvidia-cuda-nvcc-cu12` wheel, else one on PATH),
all in the `test` extra; they are imported lazily, so the library works without them.

A topology name is `<system>:<nodes>x<gpus per node>` ("h100:1x8", "h200:2x8", "h200:1x1").

What deviceless XLA:GPU does differently from the TPU compiler, and what the planner does about
it (`jaxrl.plan.programs`):

- no compile-time out-of-memory: a program needing more than the device's memory compiles; the
  planner compares `memory_analysis()` with `SystemSpec.hbm_bytes` itself;
- `compiled.cost_analysis()` is None; XLA's cost analysis runs on the optimized HLO module on
  the CPU client instead (`planning.cost_from_hlo`);
- no autotuning: GEMM tilings are the compiler's heuristics;
- cuDNN fused attention would need the ~2 GB `nvidia-cudnn-cu12` wheel and does not serialize;
  the planned programs use the XLA attention path (`attention_impl="xla"`).

The device description (`target_config`) is a text `stream_executor.GpuTargetConfigProto`
written from `SYSTEMS`, a table of public hardware figures (NVIDIA datasheets and the CUDA
programming guide's per-compute-capability limits); fields newer than jaxlib's proto are
refused by it, so only fields it knows are written. Roofline peaks: dense BF16 FLOP/s and HBM
bandwidth per GPU.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import shutil

from jaxrl.infra import platforms
from jaxrl.infra.chips import ChipSpec, TopologyError

GiB = 1024**3
MiB = 1024**2


@dataclasses.dataclass(frozen=True)
class SystemSpec:
    """One NVIDIA GPU model: the roofline peaks (`chip`) and the device facts XLA:GPU reads.

    hbm_bytes (in `chip`): the memory nvidia-smi reports as total; sms: streaming
    multiprocessors; clock_ghz: boost clock; l2_bytes: L2 cache; compute_capability: (major,
    minor). Shared memory and register limits are the compute capability's (CUDA programming
    guide, "Technical Specifications per Compute Capability").
    """

    chip: ChipSpec
    description: str
    sms: int
    clock_ghz: float
    l2_bytes: int
    compute_capability: tuple[int, int]
    shared_memory_per_sm: int = 228 * 1024
    shared_memory_per_block_optin: int = 227 * 1024
    gpus_per_node: int = 8

    def target_config(self) -> str:
        """The text `GpuTargetConfigProto` for `get_topology_desc(target_config=...)`."""
        major, minor = self.compute_capability
        return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {self.shared_memory_per_sm}
  threads_per_core_limit: 2048
  core_count: {self.sms}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(self.chip.hbm_bandwidth)}
  l2_cache_size: {self.l2_bytes}
  clock_rate_ghz: {self.clock_ghz}
  device_memory_size: {self.chip.hbm_bytes}
  shared_memory_per_block_optin: {self.shared_memory_per_block_optin}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 patch: 0 }}
device_description_str: "{self.description}"
"""


# Datasheet peaks: dense BF16 tensor-core FLOP/s (no sparsity) and HBM bandwidth. Memory: the
# total nvidia-smi reports (H100 SXM 80 GB: 81559 MiB; H200 141 GB: 143771 MiB; B200 180 GB:
# 183359 MiB).
SYSTEMS: dict[str, SystemSpec] = {
    "h100": SystemSpec(
        ChipSpec("h100", 81559 * MiB, 989e12, 3.35e12),
        "NVIDIA H100 80GB HBM3",
        sms=132,
        clock_ghz=1.98,
        l2_bytes=50 * MiB,
        compute_capability=(9, 0),
    ),
    "h200": SystemSpec(
        ChipSpec("h200", 143771 * MiB, 989e12, 4.8e12),
        "NVIDIA H200",
        sms=132,
        clock_ghz=1.98,
        l2_bytes=50 * MiB,
        compute_capability=(9, 0),
    ),
    "b200": SystemSpec(
        ChipSpec("b200", 183359 * MiB, 2250e12, 8.0e12),
        "NVIDIA B200",
        sms=148,
        clock_ghz=1.965,
        l2_bytes=126 * MiB,
        compute_capability=(10, 0),
    ),
}

_TOPOLOGY = re.compile(r"^([a-z0-9]+):(\d+)x(\d+)$")


def is_gpu_topology(name: str) -> bool:
    """Whether `name` names one of `SYSTEMS` ('h100:1x8'), not a TPU slice."""
    return name.split(":", 1)[0] in SYSTEMS


def parse_topology(name: str) -> tuple[str, int, int]:
    """`"h200:2x8"` -> ("h200", 2 nodes, 8 GPUs a node)."""
    match = _TOPOLOGY.match(name)
    if not match or match.group(1) not in SYSTEMS:
        raise TopologyError(
            f"GPU topology {name!r} is not '<system>:<nodes>x<gpus per node>' with system in "
            f"{sorted(SYSTEMS)} (e.g. 'h100:1x8', 'h200:2x8', 'h200:1x1')"
        )
    system, nodes, gpus = match.group(1), int(match.group(2)), int(match.group(3))
    limit = SYSTEMS[system].gpus_per_node
    if nodes < 1 or not 1 <= gpus <= limit or (nodes > 1 and gpus != limit):
        raise TopologyError(
            f"GPU topology {name!r}: a node holds 1 to {limit} GPUs, and a multi-node topology "
            f"is whole nodes ('{system}:{nodes}x{limit}')"
        )
    return system, nodes, gpus


def topology_with(system: str, devices: int) -> str | None:
    """A topology of `devices` GPUs of `system`: one node, or whole nodes ("h100", 32 ->
    "h100:4x8"); None where there is none."""
    per_node = SYSTEMS[system].gpus_per_node
    if devices <= per_node:
        return f"{system}:1x{devices}"
    return None if devices % per_node else f"{system}:{devices // per_node}x{per_node}"


def ptxas_path() -> str:
    """The ptxas XLA:GPU will use: the `nvidia-cuda-nvcc-cu12` wheel's, else one on PATH."""
    spec = importlib.util.find_spec("nvidia")
    for root in spec.submodule_search_locations if spec else ():
        candidate = os.path.join(root, "cuda_nvcc", "bin", "ptxas")
        if os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which("ptxas")
    if found:
        return found
    raise TopologyError(
        "compiling for NVIDIA GPUs needs ptxas (XLA:GPU turns its PTX into machine code with "
        "it, and fails with 'No PTX compilation provider is available' without one): "
        "`pip install nvidia-cuda-nvcc-cu12==12.9.86` (in the test extra) or put a CUDA 12.9 "
        "toolkit's bin/ on PATH"
    )


def topology_devices(name: str) -> list:
    """The devices of GPU topology `name` (no GPU needed; needs the CUDA plugin and ptxas)."""
    system, nodes, gpus = parse_topology(name)
    ptxas_path()
    platforms.quiet_jax_start()
    try:
        from jax.experimental import topologies

        with platforms.without_plugin_noise():
            topology = topologies.get_topology_desc(
                platform="cuda",
                topology=f"1x{nodes}x{gpus}",
                target_config=SYSTEMS[system].target_config(),
            )
        return list(topology.devices)
    except Exception as err:  # the plugin missing surfaces as RuntimeError / ValueError
        text = str(err).strip().splitlines()[0] if str(err).strip() else repr(err)
        raise TopologyError(f"cannot describe GPU topology {name!r}: {text}. {_cause()}") from err


def _cause() -> str:
    """Why the CUDA plugin gave no topology, and the fix."""
    if importlib.util.find_spec("jax_plugins.xla_cuda12") is None:
        return (
            "Ahead-of-time GPU compilation needs the CUDA plugin: `pip install "
            "jax-cuda12-plugin==0.10.2 jax-cuda12-pjrt==0.10.2` (or `pip install -e '.[test]'`)."
        )
    import jax

    value = jax.config.jax_platforms  # what JAX started with, whatever the variable says now
    asked = f"JAX platforms {value!r}" if value else "JAX_PLATFORMS unset"
    return (
        f"The CUDA plugin is installed but did not register with JAX: with {asked} it checks "
        "for a CUDA runtime first ('Unable to load CUDA' above) and this machine has none. "
        "A deviceless compile needs no GPU: run it with JAX_PLATFORMS=cpu, set before JAX is "
        "imported (`launch.plan` and importing `jaxrl` set it where JAX_PLATFORMS is unset)."
    )


def device_spec(devices) -> ChipSpec:
    """The `ChipSpec` of one device of `devices` (all one GPU model)."""
    kind = devices[0].device_kind
    for spec in SYSTEMS.values():
        if spec.description == kind:
            return spec.chip
    raise TopologyError(f"no GPU figures for device kind {kind!r}")

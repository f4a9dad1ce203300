"""Which platform JAX runs on, settled before JAX starts, and JAX's start without the log lines
of accelerator plugins that have no accelerator to drive.

The `test` extra installs the CUDA plugin and libtpu (for `launch.plan`'s ahead-of-time
compiles). On a machine without a GPU or TPU they made every process that imports JAX print,
before its own first line, three "Could not find cuda drivers on your machine" lines (each after
an absl "All log messages before absl::InitializeLog()" warning) when JAX is imported, one more
when a backend starts, and, with JAX_PLATFORMS unset, a CUDA plugin traceback ("Unable to load
CUDA. Is it installed?") and libtpu's errors about TPU_WORKER_HOSTNAMES. None of it concerns a
CPU user. So, where no accelerator is attached (`accelerator_attached`):

- `default_to_cpu` sets JAX_PLATFORMS=cpu when it is unset: JAX then neither validates the CUDA
  plugin nor starts libtpu (the traceback and the TPU errors), and a deviceless compile for a GPU
  or TPU topology still works (the plugins register; only the CPU backend starts);
- `quiet_jax_start` imports JAX and registers its plugins with those lines held back.

`prepare` does both; importing `jaxrl` calls it, so the launchers and a user's script that
imports `jaxrl` before `jax` start quietly. On a machine with an accelerator nothing is set or
filtered: a GPU user still sees the driver's own errors. This module imports no JAX at module
level.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import os
import sys
import tempfile
from collections.abc import MutableMapping

# PCI vendor ids: Google (TPUs; how JAX itself looks for one), NVIDIA.
_TPU_VENDOR, _NVIDIA_VENDOR = "0x1ae0", "0x10de"
# Device nodes of an NVIDIA driver (also inside containers given GPUs) and of AMD's ROCm driver.
_GPU_NODES = ("/dev/nvidiactl", "/proc/driver/nvidia/version", "/dev/kfd")
# Lines the CUDA plugin's libraries log when no driver is there, and the absl preamble of each.
NOISE = ("Could not find cuda drivers", "All log messages before absl::InitializeLog()")


def _pci_vendors() -> set[str]:
    vendors = set()
    for path in glob.glob("/sys/bus/pci/devices/*/vendor"):
        try:
            with open(path) as f:
                vendors.add(f.read().strip())
        except OSError:
            continue
    return vendors


def tpu_attached() -> bool:
    """Whether this machine has a TPU: a PCI device of Google's vendor id, which is how JAX
    looks for one (`jax._src.hardware_utils`)."""
    return _TPU_VENDOR in _pci_vendors()


def gpu_attached() -> bool:
    """Whether this machine has an NVIDIA or AMD GPU: the driver's device nodes, or an NVIDIA
    PCI device."""
    return any(os.path.exists(p) for p in _GPU_NODES) or _NVIDIA_VENDOR in _pci_vendors()


@functools.cache
def accelerator_attached() -> bool:
    """Whether JAX could run on something other than the CPU here."""
    return tpu_attached() or gpu_attached()


def default_to_cpu(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Sets JAX_PLATFORMS=cpu when it is unset and no accelerator is attached; returns whether
    it did. JAX reads the variable when it is imported: where it is imported already and has
    started no backend, its `jax_platforms` option is set too."""
    if environ.get("JAX_PLATFORMS", "").strip() or accelerator_attached():
        return False
    environ["JAX_PLATFORMS"] = "cpu"
    if environ is os.environ and "jax" in sys.modules:
        import jax
        from jax._src import xla_bridge

        if not xla_bridge.backends_are_initialized() and not jax.config.jax_platforms:
            jax.config.update("jax_platforms", "cpu")
    return True


@contextlib.contextmanager
def stderr_lines():
    """Captures what is written to the process's stderr (file descriptor 2, where XLA's C++
    logging goes, below Python) inside the block; yields a list that holds those lines once the
    block ends. Nothing is written back: the caller decides."""
    sys.stderr.flush()
    fd = 2  # the process's stderr, whatever object sys.stderr is (a test's capture has no fd)
    saved = os.dup(fd)
    lines: list[str] = []
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), fd)
        try:
            yield lines
        finally:
            os.dup2(saved, fd)
            os.close(saved)
            held.seek(0)
            lines += held.read().decode(errors="replace").splitlines(keepends=True)


def write_stderr(lines) -> None:
    """Writes captured `lines` (from `stderr_lines`) back to stderr."""
    if lines:
        sys.stderr.write("".join(lines))
        sys.stderr.flush()


def is_plugin_noise(line: str) -> bool:
    """A CUDA plugin "no driver" line (or its absl preamble) on a machine without a GPU or TPU."""
    return any(n in line for n in NOISE) and not accelerator_attached()


@contextlib.contextmanager
def without_plugin_noise():
    """Holds back the CUDA plugin's "no driver" lines written to the process's stderr inside
    the block, and writes back every other line.

    The plugin's libraries log them with absl, straight to file descriptor 2, below Python
    (`stderr_lines`). A no-op where an accelerator is attached (there the lines would be real
    errors).
    """
    if accelerator_attached():
        yield
        return
    lines: list[str] = []
    try:
        with stderr_lines() as lines:
            yield
    finally:
        write_stderr([x for x in lines if not is_plugin_noise(x)])


def quiet_jax_start() -> None:
    """Imports JAX and registers its PJRT plugins (the CUDA plugin's libraries load then)
    inside `without_plugin_noise`. Starts no backend: XLA_FLAGS set after this still count.
    A no-op once JAX is imported, so call it before anything imports JAX."""
    if "jax" in sys.modules:
        return
    with without_plugin_noise():
        import jax  # noqa: F401
        from jax._src import xla_bridge

        register = getattr(xla_bridge, "_discover_and_register_pjrt_plugins", None)
        if register is not None:  # a private function: other JAX versions start them lazily
            register()


def compile_only() -> None:
    """For a process that only compiles for targets that are not attached (`launch.plan`):
    JAX runs on the CPU unless JAX_PLATFORMS says otherwise, also where an accelerator is
    attached (a GPU backend would take most of the GPU's memory for nothing). Call it before
    a backend starts."""
    if os.environ.get("JAX_PLATFORMS", "").strip():
        return
    os.environ["JAX_PLATFORMS"] = "cpu"
    if "jax" in sys.modules:  # imported already: JAX read the variable then
        import jax

        jax.config.update("jax_platforms", "cpu")


def prepare() -> None:
    """`default_to_cpu`, then `quiet_jax_start`."""
    default_to_cpu()
    quiet_jax_start()

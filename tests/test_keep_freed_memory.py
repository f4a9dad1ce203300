"""`jaxrl.infra.xla_cpu.keep_freed_memory`: after it, a large buffer freed and allocated again
reuses the process's pages (no fresh page faults), where glibc's default maps it anew; and the
CPU launchers set it unless JAXRL_KEEP_FREED_MEMORY=0. Each case runs in its own process: the
setting is process-wide."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SNIPPET = """
import ctypes, resource, sys
if sys.argv[1] == "launch":
    import launch  # noqa: F401  (sets it on a CPU-only machine)
elif sys.argv[1] == "keep":
    from jaxrl.infra.xla_cpu import keep_freed_memory
    assert keep_freed_memory()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
size = 256 * 2**20
def touch():  # allocated and written through, as XLA:CPU does with a temporary buffer
    p = libc.malloc(size)
    ctypes.memset(p, 1, size)
    return p
libc.free(touch())
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
libc.free(touch())
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str, **extra_env) -> int:
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu", **extra_env)
    out = subprocess.run(
        [sys.executable, "-c", _SNIPPET, mode], env=env, cwd=REPO, capture_output=True,
        text=True, check=True,
    )  # fmt: skip
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_freed_buffer_is_reused_without_page_faults():
    pages = 256 * 2**20 // os.sysconf("SC_PAGE_SIZE")
    assert _faults("default") > pages // 2  # mapped anew: every page faults in again
    assert _faults("keep") < pages // 50
    assert _faults("launch") < pages // 50
    assert _faults("launch", JAXRL_KEEP_FREED_MEMORY="0") > pages // 2  # the opt-out

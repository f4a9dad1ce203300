"""A module-scoped fixture that shares compiled programs between in-process launches.

Every launch builds its own jitted functions (new closures), so JAX's in-memory cache misses
and each launch compiles the same programs again (~12 s of a tiny RL launch on 2 cores). JAX's
disk cache is keyed by the program, not the Python function: with it on, the second launch
loads what the first compiled. A cached executable is the same machine code, so results are
unchanged. One directory serves the whole run (tests/conftest.py; the subprocesses' cache too,
so modules and launches of the same tiny configs share their programs); the cache is on only
while a module that asks for it runs.
"""

from __future__ import annotations

import jax
import pytest
from jax.experimental.compilation_cache import compilation_cache

_SETTINGS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")


@pytest.fixture(scope="session")
def jax_cache_dir(xla_cache):
    return xla_cache


@pytest.fixture(scope="module")
def jax_disk_cache(jax_cache_dir):
    before = {name: getattr(jax.config, name) for name in _SETTINGS}
    jax.config.update("jax_compilation_cache_dir", jax_cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    compilation_cache.reset_cache()  # JAX decides once whether to use the cache: ask again
    try:
        yield
    finally:
        for name, value in before.items():
            jax.config.update(name, value)
        compilation_cache.reset_cache()

"""Test-wide setup: 8 simulated CPU devices so sharded code runs on any machine.

The device count must be fixed before JAX initialises its backend. The Makefile exports
XLA_FLAGS for the whole pytest process; for a bare `pytest` we set the flag here and also use
`jax_num_cpu_devices`, which works as long as no backend was created yet (importing jax alone
does not create one).
"""

import os

# Before `jaxrl` is imported: importing it imports JAX, which reads JAX_PLATFORMS then.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from procs import OPT_LEVEL_FLAG  # noqa: E402

from jaxrl.infra.xla_cpu import add_xla_flag, cpu_xla_flags  # noqa: E402

# 8 devices unless a count is set, and the CPU code-generation guard (jaxrl/infra/xla_cpu.py);
# subprocesses the tests start inherit both.
os.environ["XLA_FLAGS"] = cpu_xla_flags(os.environ.get("XLA_FLAGS", ""), devices=8)
# LLVM's optimisation level for the machine code XLA:CPU compiles (the HLO passes are
# unchanged): 0 in the tests, whose tiny programs spend more time compiling than running, which
# cuts the suite's time by about a third. Every test compares runs made under the same flags (a
# resumed run with its reference, several processes with one), or with a tolerance against a
# reference; none measures speed. Set another level in XLA_FLAGS to run the suite under it.
add_xla_flag(OPT_LEVEL_FLAG)

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

NUM_TEST_DEVICES = 8
assert len(jax.devices()) == NUM_TEST_DEVICES, (
    f"tests expect {NUM_TEST_DEVICES} CPU devices, JAX sees {len(jax.devices())}: "
    "something initialised the JAX backend before tests/conftest.py ran; run the suite with "
    "XLA_FLAGS=--xla_force_host_platform_device_count=8 (as `make test` does)."
)

# One persistent XLA compilation cache for the whole run, shared by the subprocesses the tests
# start (launchers killed and resumed, multi-process runs, README commands) and by the pytest
# workers: a program compiled once is loaded, not compiled, by every later process. A cached
# executable is the same machine code, so no result changes, only the seconds. The process that
# creates the directory (the only one, or pytest-xdist's controller) removes it at exit; workers
# and subprocesses inherit it through the environment.
if "JAXRL_TEST_XLA_CACHE" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["JAXRL_TEST_XLA_CACHE"] = tempfile.mkdtemp(prefix="jaxrl-test-xla-cache-")
    atexit.register(shutil.rmtree, os.environ["JAXRL_TEST_XLA_CACHE"], ignore_errors=True)
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ["JAXRL_TEST_XLA_CACHE"]
# The benchmarks the tests run (their smoke versions) write their results in that directory too,
# removed with it, not into bench/results/ (which holds the measurements the docs cite).
os.environ.setdefault(
    "JAXRL_BENCH_RESULTS_DIR", os.path.join(os.environ["JAXRL_TEST_XLA_CACHE"], "bench-results")
)
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"


@pytest.fixture(scope="session")
def xla_cache() -> str:
    """The run's shared XLA compilation cache directory (above), for launches that set it
    explicitly (`tests/procs.launch_env`)."""
    return os.environ["JAXRL_TEST_XLA_CACHE"]


# Modules whose tests run whole launches end to end (killed and resumed runs, several processes,
# the README's commands), longest first: collected before the rest, so that pytest-xdist's
# workers (`make test`: --dist loadfile --no-loadscope-reorder, which keeps this order) start
# them early and the short modules fill in at the end. Only the order changes; within a module
# it is the file's.
HEAVY_FIRST = (
    "test_async_loop.py",
    "test_roles.py",
    "test_readme_commands.py",
    "test_rl_loop.py",
    "test_async_bench.py",
    "test_distributed_rl.py",
    "test_multiturn_modes.py",
    "test_msd_pipeline.py",
    "test_streaming_loop.py",
    "test_examples.py",
    "test_lora_async.py",
    "test_generation_engine.py",
    "test_bench_smoke.py",
    "test_rl_streaming_bench.py",
    "test_moe.py",
    "test_weight_sync_property.py",
    "test_doc_snippets.py",
    "test_msd_step.py",
    "test_bench_sync.py",
)


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))

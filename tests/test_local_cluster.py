"""`python -m launch.local_cluster`: per-process environment and XLA flags, output prefixed by
process id, and when one process fails the others are stopped (even one that ignores SIGTERM,
as JAX processes do) and its exit status is the launcher's. Commands here are tiny Python
snippets, so no JAX job is started."""

import io
import os
import subprocess
import sys
import threading
import time

from test_distributed_weight_sync import REPO

from jaxrl.infra.distributed import DistributedConfig
from jaxrl.infra.xla_cpu import CPU_SCHEDULER_FLAG, set_cpu_xla_flags
from launch import local_cluster


def _launch(
    snippet: str, *flags: str, timeout_s: float = 30, env: dict | None = None
) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "launch.local_cluster", *flags, "--"]
    command += [sys.executable, "-c", snippet]
    return subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
    )


def test_process_env_sets_the_job_and_keeps_other_xla_flags():
    config = DistributedConfig("127.0.0.1:9", 2, 1, transfer_address="127.0.0.1:10")
    base = {"XLA_FLAGS": "--xla_cpu_foo=1 --xla_force_host_platform_device_count=8", "A": "b"}
    env = local_cluster.process_env(base, config, devices_per_process=3)
    assert env["XLA_FLAGS"] == (
        "--xla_cpu_foo=1 --xla_force_host_platform_device_count=3 " + CPU_SCHEDULER_FLAG
    )
    assert env["A"] == "b" and env["JAX_PLATFORMS"] == "cpu"
    assert DistributedConfig.from_env(env) == config


def test_launchers_add_the_cpu_scheduler_flag_on_cpu_only():
    """Regression: `python -m launch.rl` left the flag to the user (the config headers omit it)."""
    env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    set_cpu_xla_flags(env)
    assert env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=4 " + CPU_SCHEDULER_FLAG
    theirs = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_backend_extra_options=-x"}
    set_cpu_xla_flags(theirs)
    assert theirs["XLA_FLAGS"] == "--xla_backend_extra_options=-x"
    gpu = {"JAX_PLATFORMS": "cuda"}
    set_cpu_xla_flags(gpu)
    assert "XLA_FLAGS" not in gpu
    # Importing the `launch` package sets it, before a launcher's JAX starts its backend.
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
    snippet = "import os, launch; print(os.environ['XLA_FLAGS'])"
    result = subprocess.run(
        [sys.executable, "-c", snippet], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert result.stdout.split() == [CPU_SCHEDULER_FLAG], result.stderr


def test_outputs_are_prefixed_and_each_process_gets_its_id():
    snippet = (
        "import os; e = os.environ; "
        "print('id', e['JAXRL_PROCESS_ID'], 'of', e['JAXRL_NUM_PROCESSES'], e['XLA_FLAGS'], "
        "e['JAXRL_COORDINATOR_ADDRESS'].startswith('127.0.0.1:'))"
    )
    result = _launch(snippet, "--num_processes", "3", "--devices_per_process", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    lines = sorted(result.stdout.splitlines())
    assert len(lines) == 3, result.stdout
    for i, line in enumerate(lines):
        words = line.split()
        assert words[:5] == [f"[{i}]", "id", str(i), "of", "3"] and words[-1] == "True", line
        # Its own device count; the suite's other flags (tests/conftest.py) are passed on.
        ours = [f for f in os.environ["XLA_FLAGS"].split() if "device_count" not in f]
        flags = {"--xla_force_host_platform_device_count=2", CPU_SCHEDULER_FLAG, *ours}
        assert set(words[5:-1]) == flags, line


def test_gloo_connection_lines_are_dropped_unless_a_peer_is_missing():
    """Regression: a roles run printed 24 of these, one per rank of each gloo communicator."""
    gloo = "[Gloo] Rank {} is connected to {} peer ranks. "
    gloo += "Expected number of connected peer ranks is : 3\n"
    text = gloo.format(0, 3) + "step 1\n" + gloo.format(1, 3) + gloo.format(2, 2) + "end"
    out = io.StringIO()
    local_cluster._pump(1, io.StringIO(text), threading.Lock(), out)
    assert out.getvalue() == "[1] step 1\n[1] " + gloo.format(2, 2) + "[1] end\n"


def test_a_failing_process_stops_the_others_and_sets_the_exit_status(tmp_path):
    # Process 1 fails only once process 0 has printed and is sleeping (it leaves a marker file
    # then), so the launcher must stop a process that is really running and ignores SIGTERM.
    snippet = (
        "import os, pathlib, signal, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)  # like JAX's preemption handler\n"
        "marker = pathlib.Path(os.environ['TEST_MARKER'])\n"
        "if os.environ['JAXRL_PROCESS_ID'] == '1':\n"
        "    deadline = time.monotonic() + 20\n"
        "    while not marker.exists() and time.monotonic() < deadline:\n"
        "        time.sleep(0.01)\n"
        "    print('failing', flush=True); sys.exit(3)\n"
        "print('sleeping', flush=True); marker.touch(); time.sleep(60)\n"
    )
    env = dict(os.environ, TEST_MARKER=str(tmp_path / "process_0_sleeps"))
    start = time.monotonic()
    result = _launch(
        snippet, "--num_processes", "2", "--devices_per_process", "1", "--grace_s", "1", env=env
    )
    assert result.returncode == 3, result.stdout + result.stderr
    assert "[1] failing" in result.stdout and "[0] sleeping" in result.stdout
    assert "[local_cluster] process 1 exited with status 3; stopping the others" in result.stdout
    assert time.monotonic() - start < 15


def test_timeout_stops_everything():
    snippet = "import time; time.sleep(60)"
    flags = ("--num_processes", "2", "--devices_per_process", "1", "--timeout_s", "1")
    result = _launch(snippet, *flags)
    assert result.returncode == local_cluster.EXIT_TIMEOUT
    assert "timed out after 1 s" in result.stdout


def test_bad_flags():
    result = _launch("pass", "--num_processes", "0", "--devices_per_process", "1")
    assert result.returncode == 2 and "must both be >= 1" in result.stderr


def test_a_launcher_starts_jax_without_plugin_noise_on_a_cpu_machine():
    """Regression: with the `test` extra's CUDA plugin and libtpu installed and JAX_PLATFORMS
    unset, every launcher printed about 25 lines before its own (three "Could not find cuda
    drivers" pairs when importing JAX, a CUDA plugin traceback and libtpu errors when starting a
    backend). Importing a launcher settles the platform (cpu) and holds those lines back; the
    flag and allocator settings of CPU runs still apply."""
    from jaxrl.infra.platforms import accelerator_attached

    if accelerator_attached():
        return  # a GPU user sees the driver's lines: they are real there
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    snippet = (
        "import os, launch.eval, jax; "
        "print(jax.devices()[0].platform, os.environ['JAX_PLATFORMS'], os.environ['XLA_FLAGS'])"
    )
    result = subprocess.run(
        [sys.executable, "-c", snippet], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["cpu", "cpu", CPU_SCHEDULER_FLAG], result.stdout
    for noise in ("cuda drivers", "absl::InitializeLog", "plugin configuration", "TPU_WORKER"):
        assert noise not in result.stderr, result.stderr

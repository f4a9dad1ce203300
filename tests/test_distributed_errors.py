"""Multi-process failures end with a clear error and a non-zero exit, quickly (every JAX timeout
here is at most 10 s): meshes that the processes' devices cannot hold, fewer processes than
`num_processes`, an unreachable coordinator, and a process that dies (killed, or by an
exception) while the others wait for it in a collective.

Run as a script, this file is the worker each process executes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from test_distributed_weight_sync import REPO, run_cluster

from jaxrl.infra.distributed import DistributedConfig, free_port
from launch.local_cluster import process_env

HARD_TIMEOUT_S = 40  # never reached: the point is that JAX's own timeouts (<= 10 s) end it


MARKER_ENV = "TEST_COLLECTIVE_MARKER"  # process 0 creates it on its way into the collective


def _spawn(mode: str, process_id: int, num_processes: int, coordinator: str, marker="", **timeouts):
    config = DistributedConfig(
        coordinator_address=coordinator,
        num_processes=num_processes,
        process_id=process_id,
        transfer_address="off",
        **timeouts,
    )
    base = dict(os.environ, **{MARKER_ENV: str(marker)})
    return subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), mode],
        cwd=REPO,
        env=process_env(base, config, devices_per_process=2),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _finish(proc) -> tuple[int, str]:
    output, _ = proc.communicate(timeout=HARD_TIMEOUT_S)
    return proc.returncode, output


def test_free_port_stays_out_of_the_ephemeral_range(tmp_path, monkeypatch):
    """The transfer server binds its port late; a port from the kernel's ephemeral range could
    by then be the local port of an outgoing gloo or gRPC connection ("bind: Address already in
    use"). free_port hands out ports below the range, never twice, and each can be bound."""
    import socket

    from jaxrl.infra import distributed

    low, high = distributed._ephemeral_range()
    ports = [free_port() for _ in range(20)]
    assert len(set(ports)) == 20, ports
    assert all(not low <= p <= high for p in ports), (low, high, ports)
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))
    # A range that leaves no room outside it: the kernel's choice, still never twice.
    (tmp_path / "range").write_text("1024\t65535\n")
    monkeypatch.setattr(distributed, "_EPHEMERAL_RANGE_FILE", str(tmp_path / "range"))
    assert distributed._ephemeral_range() == (1024, 65535)
    more = [free_port() for _ in range(5)]
    assert len(set(more + ports)) == 25 and all(1024 <= p <= 65535 for p in more)


def test_meshes_larger_than_the_job_name_the_process_layout():
    result = run_cluster(["layout"], script=__file__, devices_per_process=2, timeout_s=60)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-4000:]
    assert "] jaxrl.infra.distributed.ProcessLayoutError: the generator mesh" in output, output
    assert "the generator mesh {'dp': 2, 'tp': 2} uses devices [4, 8)" in output
    assert "2 process(es) x 2 local devices = 4 devices" in output
    assert "--num_processes 4 --devices_per_process 2" in output


def test_fewer_processes_than_num_processes():
    start = time.monotonic()
    proc = _spawn("init", 0, 2, f"127.0.0.1:{free_port()}", initialization_timeout_s=3)
    code, output = _finish(proc)
    assert code == 1, output[-4000:]
    assert "waited 3 s for all 2 processes to join" in output, output[-4000:]
    assert "start exactly num_processes processes" in output
    assert time.monotonic() - start < 20


def test_unreachable_coordinator():
    start = time.monotonic()
    address = f"127.0.0.1:{free_port()}"  # nobody serves it
    proc = _spawn("init", 1, 2, address, initialization_timeout_s=2)
    code, output = _finish(proc)
    assert code == 1, output[-4000:]
    assert "CoordinatorUnreachableError: process 1 could not reach the coordinator at" in output
    assert address in output and "check that process 0 is running" in output
    assert time.monotonic() - start < 20


def _run_pair(mode: str, tmp_path) -> list[tuple[int, str, float]]:
    """Both processes of a 2-process job; (exit code, output, seconds) per process."""
    coordinator = f"127.0.0.1:{free_port()}"
    timeouts = {"initialization_timeout_s": 10, "heartbeat_timeout_s": 2}
    marker = tmp_path / "in_collective"
    start = time.monotonic()
    procs = [_spawn(mode, i, 2, coordinator, marker, **timeouts) for i in range(2)]
    results = []
    for proc in procs:
        code, output = _finish(proc)
        results.append((code, output, time.monotonic() - start))
    return results


def test_killed_process_stops_the_others(tmp_path):
    (code, output, seconds), (victim_code, _, _) = _run_pair("die", tmp_path)
    assert victim_code == -9
    # The coordinator notices the missing heartbeats and JAX aborts the survivor (SIGABRT).
    assert code != 0 and "waiting in a collective" in output, output[-4000:]
    assert "survived" not in output
    assert seconds < 25, seconds


def test_exception_in_one_process_stops_the_others(tmp_path):
    (code, output, seconds), (victim_code, victim_output, _) = _run_pair("raise", tmp_path)
    assert victim_code == 1, victim_output[-4000:]
    assert "RuntimeError: boom in process 1" in victim_output
    assert "process 1 failed; exiting now" in victim_output
    assert code != 0 and "waiting in a collective" in output, output[-4000:]
    assert "survived" not in output
    assert seconds < 25, seconds


def _worker(mode: str) -> None:
    from jaxrl.infra.distributed import check_mesh_fits, initialize_from_env

    info = initialize_from_env()
    if mode == "init":
        return
    if mode == "layout":
        from jaxrl.infra.mesh import MeshConfig

        check_mesh_fits(
            {
                "trainer": MeshConfig(("fsdp", "tp"), (2, 2), first_device=0, num_devices=4),
                "generator": MeshConfig(("dp", "tp"), (2, 2), first_device=4, num_devices=4),
            }
        )
        return
    from jax.experimental import multihost_utils

    marker = Path(os.environ[MARKER_ENV])
    if info.process_index == 1:
        deadline = time.monotonic() + 20  # fail in process 1 only once process 0 waits for it
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        if mode == "die":
            os.kill(os.getpid(), 9)
        raise RuntimeError("boom in process 1")
    print("waiting in a collective", flush=True)
    marker.touch()
    multihost_utils.sync_global_devices("never completes")
    print("survived", flush=True)


if __name__ == "__main__":
    _worker(sys.argv[1])

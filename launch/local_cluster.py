"""Try multi-host on one machine: N local processes of one command, as one JAX job on CPUs.

    python -m launch.local_cluster --num_processes 2 --devices_per_process 4 -- \\
        python -m launch.rl --gin_file=configs/rl/arith_tiny.gin --workdir=runs/arith_2proc

Each process gets the `JAXRL_*` variables that `jaxrl.infra.distributed.initialize_from_env()`
reads (a free coordinator port on 127.0.0.1, the process count, its process id, its own
transfer-server port, the timeouts), `JAX_PLATFORMS=cpu` (unless set) and `XLA_FLAGS` with
`--xla_force_host_platform_device_count=M` (other XLA flags kept), so the job has N x M CPU
devices, and `PJRT_NPROC` (unless set) for the thread pool a one-process run of all N x M
devices gets, so each program computes the same bits as there; collectives between processes
go over gloo (TCP). The command must call
`initialize_from_env()` before it touches a device, as the launchers do.

Output lines are prefixed with the process id (`[1] ...`). When a process exits non-zero, the
others are stopped (SIGTERM, then SIGKILL after `--grace_s`: JAX's preemption service catches
SIGTERM, so SIGTERM alone does not end a JAX process) and this launcher exits with the failed
process's status (128 + N for a signal N). `--timeout_s` stops everything and exits 124.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from jaxrl.infra.distributed import DistributedConfig, free_port
from jaxrl.infra.xla_cpu import DEVICE_COUNT_FLAG, cpu_xla_flags

EXIT_TIMEOUT = 124
_DEVICE_COUNT_RE = re.compile(re.escape(DEVICE_COUNT_FLAG) + r"=\S*")


def process_env(
    base: dict[str, str], config: DistributedConfig, devices_per_process: int
) -> dict[str, str]:
    """`base` plus the variables one local process needs."""
    env = dict(base)
    env.update(config.to_env())
    flags = _DEVICE_COUNT_RE.sub("", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = cpu_xla_flags(flags, devices=devices_per_process)
    env.setdefault("JAX_PLATFORMS", "cpu")
    # XLA:CPU sizes a process's thread pool max(cores, its devices), and some kernels split
    # their work (and their float sums) by the pool's size: on a host with fewer cores than
    # the job's devices, a process of M devices would compute other bits than one process of
    # all N x M devices. Every process gets the one-process job's pool, so a program computes
    # the same bits in either (a role-split job equals its one-process run, bit for bit).
    env.setdefault(
        "PJRT_NPROC",
        str(max(len(os.sched_getaffinity(0)), config.num_processes * devices_per_process)),
    )
    env["PYTHONUNBUFFERED"] = "1"
    return env


# Gloo (XLA:CPU's cross-process collectives) prints this to stdout for every communicator it
# sets up, each rank of each device group: 24 lines in configs/rl/arith_tiny_roles.gin's run.
# Only a group with a peer missing says anything worth reading.
_GLOO_CONNECTED = re.compile(
    r"\[Gloo\] Rank \d+ is connected to (\d+) peer ranks\. "
    r"Expected number of connected peer ranks is : (\d+)\s*"
)


def _pump(index: int, stream, lock: threading.Lock, out) -> None:
    for line in iter(stream.readline, ""):
        gloo = _GLOO_CONNECTED.fullmatch(line)
        if gloo and gloo.group(1) == gloo.group(2):
            continue
        with lock:
            out.write(f"[{index}] {line}" if line.endswith("\n") else f"[{index}] {line}\n")
            out.flush()
    stream.close()


def _status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _stop(procs: Sequence[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM to each still-running process group we started, SIGKILL after `grace_s`."""
    running = [p for p in procs if p.poll() is None]
    for proc in running:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(p.poll() is None for p in running):
        time.sleep(0.05)
    for proc in running:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()


def run(
    command: Sequence[str],
    num_processes: int,
    devices_per_process: int,
    *,
    timeout_s: float | None = None,
    grace_s: float = 2.0,
    initialization_timeout_s: int = 60,
    heartbeat_timeout_s: int = 10,
    shutdown_timeout_s: int = 60,
    out=None,
) -> int:
    """Runs `command` as `num_processes` processes; returns the job's exit status."""
    if num_processes < 1 or devices_per_process < 1:
        raise ValueError(
            f"--num_processes={num_processes} and --devices_per_process={devices_per_process} "
            "must both be >= 1."
        )
    if not command:
        raise ValueError("no command given; put it after `--`.")
    out = sys.stdout if out is None else out
    coordinator = f"127.0.0.1:{free_port()}"
    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    for index in range(num_processes):
        config = DistributedConfig(
            coordinator_address=coordinator,
            num_processes=num_processes,
            process_id=index,
            initialization_timeout_s=initialization_timeout_s,
            heartbeat_timeout_s=heartbeat_timeout_s,
            shutdown_timeout_s=shutdown_timeout_s,
            transfer_address=f"127.0.0.1:{free_port()}",
        )
        proc = subprocess.Popen(
            list(command),
            env=process_env(dict(os.environ), config, devices_per_process),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            errors="replace",
            start_new_session=True,  # its own process group: stopping it stops its children
        )
        procs.append(proc)
        pump = threading.Thread(target=_pump, args=(index, proc.stdout, lock, out), daemon=True)
        pump.start()
        pumps.append(pump)
    status = 0
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                index, code = failed[0]
                status = _status(code)
                with lock:
                    out.write(
                        f"[local_cluster] process {index} exited with status {status}; "
                        "stopping the others\n"
                    )
                    out.flush()
                break
            if all(c == 0 for c in codes):
                break
            if deadline is not None and time.monotonic() > deadline:
                status = EXIT_TIMEOUT
                with lock:
                    out.write(f"[local_cluster] timed out after {timeout_s:g} s; stopping all\n")
                    out.flush()
                break
            time.sleep(0.05)
    except KeyboardInterrupt:
        status = 130
    finally:
        _stop(procs, grace_s)
        for pump in pumps:
            pump.join(timeout=5)
    return status


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, command = argv[:split], argv[split + 1 :]
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        usage="python -m launch.local_cluster --num_processes N --devices_per_process M -- CMD",
    )
    parser.add_argument("--num_processes", type=int, required=True)
    parser.add_argument("--devices_per_process", type=int, required=True)
    parser.add_argument("--timeout_s", type=float, default=None, help="stop all after this")
    parser.add_argument("--grace_s", type=float, default=2.0, help="SIGTERM -> SIGKILL wait")
    parser.add_argument("--initialization_timeout_s", type=int, default=60)
    parser.add_argument("--heartbeat_timeout_s", type=int, default=10)
    parser.add_argument("--shutdown_timeout_s", type=int, default=60)
    args = parser.parse_args(argv)
    try:
        return run(
            command,
            args.num_processes,
            args.devices_per_process,
            timeout_s=args.timeout_s,
            grace_s=args.grace_s,
            initialization_timeout_s=args.initialization_timeout_s,
            heartbeat_timeout_s=args.heartbeat_timeout_s,
            shutdown_timeout_s=args.shutdown_timeout_s,
        )
    except ValueError as err:
        parser.error(str(err))


if __name__ == "__main__":
    sys.exit(main())

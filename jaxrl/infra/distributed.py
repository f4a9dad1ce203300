"""Multi-process runs: `jax.distributed` set-up, its failure modes, and output on process 0 only.

JAX is multi-controller: every process runs the same program and drives its own local devices,
and `jax.devices()` lists the devices of all processes (sorted by process, then id), so a
`MeshConfig` slice such as devices [0, 4) of a 2 x 4 job is process 0's devices and [4, 8) process
1's. `initialize(DistributedConfig)` must run before anything touches a device (`jax.devices()`,
a jit, `jax.process_index()`); launchers call `initialize_from_argv()` first thing.

Where the settings come from, first match wins: explicit fields (or launcher flags such as
`--coordinator_address=host:port --num_processes=2 --process_id=1`); the `JAXRL_*` environment
variables (`DistributedConfig.from_env`, set by `python -m launch.local_cluster`); otherwise
`jax.distributed.initialize` auto-detects SLURM, Open MPI and Cloud TPU (it reads their
environment). Nothing of the sort: a plain single-process run, and `initialize` does nothing.

What JAX 0.10.2 does on CPU, and what this module adds (each checked with local processes):

- CPU collectives across processes run over gloo (TCP): `jax_cpu_collectives_implementation`
  is "gloo" by default in 0.10.2 (older releases had no default); `initialize` sets it anyway,
  before the backend starts, so that a job does not depend on the release's default.
- A process that dies (killed, or aborted by a C++ error) is noticed by the coordination service
  after `heartbeat_timeout_s`; every other process is then aborted by JAX (SIGABRT, exit 134),
  whatever it is doing: sleeping, in a collective or at a barrier. When process 0 (which hosts the
  coordinator) dies, the others abort within a second or two (their connection closes).
- A Python exception is different: the process exits "cleanly" through JAX's atexit hook, which
  waits up to `shutdown_timeout_s` (JAX default 300 s) at the shutdown barrier for the others,
  which meanwhile may wait in a collective for it. With `fail_fast` (default) an uncaught
  exception prints its traceback and leaves at once (`os._exit(1)`), so the others abort after
  `heartbeat_timeout_s`, not after minutes.
- SIGTERM does not stop a JAX process: the preemption service catches it (a preemption notice)
  and the process runs on. Launchers that stop processes (launch.local_cluster) use SIGKILL after
  a short grace period.
- An unreachable coordinator, or fewer processes than `num_processes`, ends in a C++ abort
  ("Deadline Exceeded") with no Python error to catch. So `initialize` first waits (up to
  `initialization_timeout_s`) until the coordinator's port accepts connections and raises
  `CoordinatorUnreachableError` naming the address if it never does; and a watchdog prints which
  process waited for how many others, and exits with status 1, when the processes have not all
  joined by the timeout.
- Cross-process `jax.device_put` (weight sync, `jaxrl.sync.cross_process`) needs a transfer server
  per process: `jax_cross_host_transfer_socket_address` set to a concrete `host:port` before the
  backend starts (port 0 hangs the receiver: the server publishes the port it was given). The
  default picks a free port on the interface that routes to the coordinator, below the kernel's
  ephemeral range (the server binds late, and a port from that range may by then be the local
  port of an outgoing gloo or gRPC connection: "bind: Address already in use").

Output: `jaxrl.infra.metrics` writes metrics.jsonl / TensorBoard and shows the progress bar on
process 0 only, and `Checkpointer` lets process 0 clean up and write the JSON state; `initialize`
also raises the root logger's level to WARNING on the other processes (`log_all_processes`).

JAX is imported inside the functions, so that `launch.local_cluster` (which only needs the
config and its environment variables) starts without it.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import random
import socket
import sys
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, NoReturn

from jaxrl.infra.errors import UserError

if TYPE_CHECKING:
    from jaxrl.infra.mesh import MeshConfig

logger = logging.getLogger(__name__)

ENV_VARS = {
    "coordinator_address": "JAXRL_COORDINATOR_ADDRESS",
    "num_processes": "JAXRL_NUM_PROCESSES",
    "process_id": "JAXRL_PROCESS_ID",
    "local_device_ids": "JAXRL_LOCAL_DEVICE_IDS",
    "initialization_timeout_s": "JAXRL_INITIALIZATION_TIMEOUT_S",
    "heartbeat_timeout_s": "JAXRL_HEARTBEAT_TIMEOUT_S",
    "shutdown_timeout_s": "JAXRL_SHUTDOWN_TIMEOUT_S",
    "transfer_address": "JAXRL_TRANSFER_ADDRESS",
}
TRANSFER_OFF = "off"
EXIT_INIT_TIMEOUT = 1


class DistributedError(RuntimeError):
    """A multi-process set-up or synchronisation failure; the message names the fix."""


class CoordinatorUnreachableError(DistributedError):
    """A process could not connect to the coordinator (process 0) in time."""


class ProcessLayoutError(UserError, ValueError):
    """The processes and their devices do not fit the mesh configs."""

    kind = "process layout error"


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """How this process joins a multi-process job.

    Attributes:
      coordinator_address: "host:port" of process 0, which serves the coordinator there. None:
        auto-detected (SLURM / Open MPI / TPU), or a single-process run.
      num_processes: processes in the job (None: auto-detected; 1: single process).
      process_id: this process, in [0, num_processes).
      local_device_ids: restricts this process to these local devices (GPU: one process per
        GPU); None: all local devices (on SLURM / Open MPI GPU jobs JAX picks one per process).
      initialization_timeout_s: how long to wait for the coordinator and all processes.
      heartbeat_timeout_s: a process silent this long is declared dead; the others then abort.
      shutdown_timeout_s: how long a finished process waits at exit for the others to finish.
      transfer_address: "host:port" of this process's transfer server (cross-process
        `device_put`); None picks a free port on the interface that reaches the coordinator
        (on the host name's address when the coordinator is auto-detected: set it when that
        resolves to a loopback address); "off" starts none.
      fail_fast: an uncaught exception ends the process at once, so the others notice within
        `heartbeat_timeout_s` instead of waiting at barriers (module docstring).
      log_all_processes: keep INFO logging on every process (default: process 0 only).
    """

    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    local_device_ids: tuple[int, ...] | None = None
    initialization_timeout_s: int = 300
    heartbeat_timeout_s: int = 100
    shutdown_timeout_s: int = 300
    transfer_address: str | None = None
    fail_fast: bool = True
    log_all_processes: bool = False

    def validate(self) -> None:
        if self.num_processes is not None and self.num_processes < 1:
            raise ValueError(f"num_processes={self.num_processes} must be >= 1.")
        if self.process_id is not None:
            if self.process_id < 0:
                raise ValueError(f"process_id={self.process_id} must be >= 0.")
            if self.num_processes is not None and self.process_id >= self.num_processes:
                raise ValueError(
                    f"process_id={self.process_id} with num_processes={self.num_processes}: "
                    f"process ids run from 0 to {self.num_processes - 1}."
                )
        for name in ("initialization_timeout_s", "heartbeat_timeout_s", "shutdown_timeout_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1 second.")
        for name in ("coordinator_address", "transfer_address"):
            value = getattr(self, name)
            if value is not None and value != TRANSFER_OFF:
                _split_address(value, name)
        if self.coordinator_address is not None and self.num_processes not in (None, 1):
            if self.process_id is None:
                raise ValueError(
                    f"coordinator_address and num_processes={self.num_processes} are set but "
                    "process_id is not; give each process its id (0 runs the coordinator)."
                )

    @property
    def single_process(self) -> bool:
        """True when nothing asks for (or detects) more than one process."""
        if self.num_processes == 1:
            return True
        explicit = self.coordinator_address is not None or self.num_processes is not None
        return not explicit and not cluster_detected()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides) -> DistributedConfig:
        """The config the `JAXRL_*` variables describe (unset ones keep their defaults)."""
        env = os.environ if environ is None else environ
        values: dict = {}
        for field in dataclasses.fields(cls):
            name = ENV_VARS.get(field.name)
            raw = env.get(name, "").strip() if name else ""
            if not raw:
                continue
            try:
                if field.name == "local_device_ids":
                    values[field.name] = tuple(int(i) for i in raw.split(","))
                elif field.name.endswith("_s") or field.name in ("num_processes", "process_id"):
                    values[field.name] = int(raw)
                else:
                    values[field.name] = raw
            except ValueError:
                raise ValueError(f"{name}={raw!r} is not a valid {field.name}.") from None
        values.update(overrides)
        config = cls(**values)
        config.validate()
        return config

    def to_env(self) -> dict[str, str]:
        """The `JAXRL_*` variables that make `from_env` return this config."""
        env = {}
        for field, name in ENV_VARS.items():
            value = getattr(self, field)
            if value is None:
                continue
            env[name] = ",".join(map(str, value)) if field == "local_device_ids" else str(value)
        return env


@dataclasses.dataclass(frozen=True)
class ProcessInfo:
    """This process's place in the job (what `initialize` set up)."""

    process_index: int
    process_count: int
    coordinator_address: str | None
    transfer_address: str | None

    @property
    def is_main(self) -> bool:
        return self.process_index == 0


def cluster_detected() -> bool:
    """Whether `jax.distributed.initialize()` would find a SLURM / Open MPI / TPU pod job."""
    from jax._src.clusters import ClusterEnv  # the detection jax.distributed itself runs

    for env in ClusterEnv._cluster_types:
        try:
            if not env.opt_in_only_method and env.is_env_present():
                return True
        except Exception:  # a detector probing an environment it cannot reach
            continue
    return False


def _split_address(address: str, what: str = "address") -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what}={address!r}: expected 'host:port' with a port in 1..65535.")
    return host.strip("[]"), int(port)


def _local_host_facing(host: str | None) -> str:
    """The IP of this machine's interface that routes to `host` (no packet is sent)."""
    if host is None:
        return socket.gethostbyname(socket.gethostname())
    if host in ("localhost", "::1") or host.startswith("127."):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))
            return probe.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


_EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
_handed_out: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (Linux; IANA's elsewhere)."""
    try:
        with open(_EPHEMERAL_RANGE_FILE) as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 49152, 65535


_PORTS = random.SystemRandom()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on now, outside the kernel's ephemeral range.

    A port is chosen now and bound later (the transfer server binds on the first cross-process
    transfer, after gloo and gRPC have opened many connections). A port from the ephemeral range
    (what binding port 0 returns) can meanwhile become the local port of one of those outgoing
    connections, and the bind fails with "Address already in use". Ports below the range are
    never handed out to outgoing connections, so only another listener can take them. Ports
    already returned by this process are not returned again. The draw is from the OS's entropy,
    not the `random` module, so processes that seed `random` alike (test workers side by side)
    do not draw the same ports.
    """
    low, high = _ephemeral_range()
    candidates = [(10_000, low)] if low > 11_000 else []
    if high < 64_000:
        candidates.append((high + 1, 65_536))
    for start, stop in candidates:
        for _ in range(64):
            port = _PORTS.randrange(start, stop)
            if port in _handed_out:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                try:
                    sock.bind((host, port))
                except OSError:
                    continue
            _handed_out.add(port)
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # no room outside the range
        sock.bind((host, 0))
        port = sock.getsockname()[1]
    _handed_out.add(port)
    return port


def wait_for_coordinator(address: str, timeout_s: float, process_id: int | None = None) -> None:
    """Blocks until `address` accepts TCP connections; raises CoordinatorUnreachableError."""
    host, port = _split_address(address, "coordinator_address")
    deadline = time.monotonic() + timeout_s
    last_error: OSError | None = None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError as err:
            last_error = err
            time.sleep(0.1)
    raise CoordinatorUnreachableError(
        f"process {process_id} could not reach the coordinator at {address} within "
        f"{timeout_s:g} s ({last_error}). Process 0 serves it: check that process 0 is running "
        "and was given the same coordinator address, that the host name resolves from here, and "
        "that no firewall blocks the port (DistributedConfig.coordinator_address / "
        f"{ENV_VARS['coordinator_address']})."
    )


def _check_port_free(address: str) -> None:
    host, port = _split_address(address, "coordinator_address")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("" if not host.startswith("127.") else host, port))
        except OSError as err:
            raise DistributedError(
                f"process 0 cannot serve the coordinator on port {port} ({err}): another "
                "program (or an earlier run that is still alive) holds it; choose a free port."
            ) from err


def _start_watchdog(config: DistributedConfig) -> threading.Timer:
    """Exits with a clear message when the processes have not all joined in time."""

    def expire():
        print(
            f"jaxrl.distributed: process {config.process_id} waited "
            f"{config.initialization_timeout_s} s for all {config.num_processes} processes to "
            f"join the coordinator at {config.coordinator_address}; some never did. The "
            "process count does not match the processes started: start exactly num_processes "
            "processes, each with its own process_id in [0, num_processes) and the same "
            "coordinator address (python -m launch.local_cluster does this on one machine).",
            file=sys.stderr,
            flush=True,
        )
        os._exit(EXIT_INIT_TIMEOUT)

    timer = threading.Timer(config.initialization_timeout_s, expire)
    timer.daemon = True
    timer.start()
    return timer


def _install_fail_fast(process_id: int) -> None:
    global _FAIL_FAST
    _FAIL_FAST = True

    def hook(kind, value, tb):
        traceback.print_exception(kind, value, tb)
        print(
            f"jaxrl.distributed: process {process_id} failed; exiting now so that the other "
            "processes stop too (after the heartbeat timeout).",
            file=sys.stderr,
            flush=True,
        )
        sys.stdout.flush()
        os._exit(1)

    sys.excepthook = hook


_INFO: ProcessInfo | None = None
_FAIL_FAST = False  # `_install_fail_fast` ran


def exit_with(message: str) -> NoReturn:
    """Ends the process with `message` on stderr and status 1: SystemExit, or in a multi-process
    job that fails fast `os._exit` at once, since a clean exit would wait at JAX's shutdown
    barrier for the other processes (module docstring)."""
    if _FAIL_FAST and _INFO is not None and _INFO.process_count > 1:
        print(message, file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)
    raise SystemExit(message)


def initialize(config: DistributedConfig | None = None) -> ProcessInfo:
    """Joins the job `config` describes (default: `DistributedConfig.from_env()`).

    Call it once, before anything touches a device. A single-process config does nothing but
    return ProcessInfo(0, 1, None, None). Once a job is joined, later calls return its info.
    """
    global _INFO
    if _INFO is not None:
        return _INFO
    import jax

    config = DistributedConfig.from_env() if config is None else config
    config.validate()
    if config.single_process:
        return ProcessInfo(0, 1, None, None)
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        raise DistributedError(
            "jaxrl.infra.distributed.initialize ran after JAX had started its backend "
            "(something called jax.devices(), jax.process_index(), a jit or device_put "
            "first); call it first thing in the launcher."
        )
    coordinator = config.coordinator_address
    if coordinator is None and not cluster_detected():
        raise DistributedError(
            f"num_processes={config.num_processes} but no coordinator_address, and no SLURM / "
            "Open MPI / TPU environment to detect one from; set it (process 0's host:port, "
            f"{ENV_VARS['coordinator_address']}) or run under python -m launch.local_cluster."
        )
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    coordinator_host = _split_address(coordinator)[0] if coordinator else None
    transfer = config.transfer_address
    if transfer is None:
        host = _local_host_facing(coordinator_host)
        transfer = f"{host}:{free_port(host)}"
    if transfer != TRANSFER_OFF:
        jax.config.update("jax_cross_host_transfer_socket_address", transfer)
    watchdog = None
    if coordinator is not None and config.num_processes is not None:
        if config.process_id == 0:
            _check_port_free(coordinator)
        else:
            wait_for_coordinator(coordinator, config.initialization_timeout_s, config.process_id)
        watchdog = _start_watchdog(config)
    try:
        jax.distributed.initialize(
            coordinator_address=coordinator,
            num_processes=config.num_processes,
            process_id=config.process_id,
            local_device_ids=config.local_device_ids,
            # JAX's own deadline a little later, so that the watchdog's message comes first.
            initialization_timeout=config.initialization_timeout_s + 5,
            heartbeat_timeout_seconds=config.heartbeat_timeout_s,
            shutdown_timeout_seconds=config.shutdown_timeout_s,
        )
    finally:
        if watchdog is not None:
            watchdog.cancel()
    from jax._src import distributed as jax_distributed

    state = jax_distributed.global_state
    _INFO = ProcessInfo(
        process_index=state.process_id,
        process_count=state.num_processes,
        coordinator_address=state.coordinator_address,
        transfer_address=None if transfer == TRANSFER_OFF else transfer,
    )
    if config.fail_fast:
        _install_fail_fast(_INFO.process_index)
    if not config.log_all_processes and _INFO.process_index != 0:
        logging.getLogger().setLevel(logging.WARNING)
    logger.info(
        "process %d of %d joined the coordinator at %s (transfer server %s)",
        _INFO.process_index,
        _INFO.process_count,
        _INFO.coordinator_address,
        _INFO.transfer_address,
    )
    return _INFO


def initialize_from_env(**overrides) -> ProcessInfo:
    """`initialize(DistributedConfig.from_env(**overrides))`."""
    return initialize(DistributedConfig.from_env(**overrides))


def parse_distributed_flags(argv: Sequence[str]) -> tuple[dict, list[str]]:
    """Takes `--coordinator_address`, `--num_processes`, `--process_id`, `--local_device_ids`
    (comma-separated), the `--*_timeout_s` and `--transfer_address` out of `argv`; returns
    (DistributedConfig overrides, the other arguments)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for field in dataclasses.fields(DistributedConfig):
        if field.name not in ENV_VARS:
            continue
        kind = int if field.name.endswith("_s") or field.name.endswith("_processes") else str
        kind = int if field.name == "process_id" else kind
        parser.add_argument(f"--{field.name}", type=kind, default=None)
    known, rest = parser.parse_known_args(list(argv))
    overrides = {k: v for k, v in vars(known).items() if v is not None}
    if "local_device_ids" in overrides:
        overrides["local_device_ids"] = tuple(
            int(i) for i in overrides["local_device_ids"].split(",")
        )
    return overrides, rest


def initialize_from_argv(argv: Sequence[str] | None = None) -> list[str]:
    """The launchers' first line: joins the job that the distributed flags in `argv` (default
    `sys.argv[1:]`), then the `JAXRL_*` variables, then SLURM / Open MPI / TPU describe, or none;
    returns `argv` without the distributed flags, for the launcher's own parser.

        if __name__ == "__main__":
            launch(rl_main, initialize_from_argv(), description=...)
    """
    overrides, rest = parse_distributed_flags(sys.argv[1:] if argv is None else argv)
    initialize(DistributedConfig.from_env(**overrides))
    return rest


def is_main_process() -> bool:
    """Process 0: the one that logs, writes metrics and checkpoint metadata."""
    import jax

    return jax.process_index() == 0


def barrier(name: str, timeout_s: float = 300.0, processes: Sequence[int] | None = None) -> None:
    """Waits until every process (or every one of `processes`) reaches `barrier(name)`: a
    coordination-service barrier, no device work, so it cannot deadlock with device transfers
    still in flight (a device collective such as `multihost_utils.sync_global_devices` can).
    Names must be unique."""
    import jax

    if jax.process_count() == 1 or (processes is not None and len(set(processes)) == 1):
        return
    from jax._src import distributed as jax_distributed

    ids = None if processes is None else sorted(set(processes))
    try:
        jax_distributed.global_state.client.wait_at_barrier(
            name, int(timeout_s * 1000), process_ids=ids
        )
    except jax.errors.JaxRuntimeError as err:
        raise DistributedError(
            f"process {jax.process_index()}: not every process reached barrier {name!r} within "
            f"{timeout_s:g} s; another process died or is stuck (see its log). {err}"
        ) from err


def _devices_needed(config: MeshConfig, num_devices: int) -> tuple[int, str]:
    """The device count the mesh needs to exist, and the range it asks for."""
    if config.device_indices is not None:
        return max(config.device_indices) + 1, f"device indices {list(config.device_indices)}"
    if config.num_devices != -1:
        count = config.num_devices
    elif -1 not in config.axis_sizes:
        count = math.prod(config.axis_sizes)
    else:
        count = max(num_devices - config.first_device, math.prod(s for s in config.axis_sizes))
    last = config.first_device + count
    return last, f"devices [{config.first_device}, {last})"


def check_mesh_fits(meshes: Mapping[str, MeshConfig]) -> None:
    """Raises ProcessLayoutError when the job's processes x devices cannot hold the meshes.

    `meshes` maps a role ("trainer", "generator") to its MeshConfig. The message names the
    processes, their devices and the `launch.local_cluster` flags that would fit.
    """
    import jax

    devices = jax.devices()
    processes = jax.process_count()
    local = jax.local_device_count()
    problems, most = [], 0
    for role, config in meshes.items():
        config.validate()
        needed, where = _devices_needed(config, len(devices))
        most = max(most, needed)
        if needed > len(devices):
            axes = dict(zip(config.axis_names, config.axis_sizes, strict=True))
            problems.append(f"the {role} mesh {axes} uses {where}")
    if problems:
        fit = math.ceil(most / local) if most else processes
        simulate = ""
        if jax.default_backend() == "cpu" and processes == 1:
            # The usual case on a laptop: the configs assume 8 simulated CPU devices.
            simulate = (
                f"On a CPU, one process can simulate {most} devices: set "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={most} before Python starts "
                f"(e.g. `export XLA_FLAGS=--xla_force_host_platform_device_count={most}`). "
                "Otherwise: "
            )
        raise ProcessLayoutError(
            f"{'; '.join(problems)}, but this job has {processes} process(es) x {local} local "
            f"devices = {len(devices)} devices. {simulate}Start {fit} processes "
            f"(on one machine: python -m launch.local_cluster --num_processes {fit} "
            f"--devices_per_process {local} -- ...), give each process more devices, or shrink "
            "the meshes."
        )

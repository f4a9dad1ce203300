"""Fault injection for resume tests: kill the process at an exact point, not after a timer.

Set `JAXRL_FAULT` to one of
  `kill_at_step=N`   SIGKILL right after optimizer step N completes (before any save of step N);
  `kill_in_save=N`   SIGKILL inside the checkpoint save of step N, once its temporary directory
                     exists and before it is committed;
  `sigterm_at_step=N` SIGTERM to itself right after step N (the graceful stop of
                     `jaxrl.infra.preemption`: the run saves a later step and exits 0);
  `sigint_at_step=N` SIGINT (Ctrl-C) to itself right after step N (the same graceful stop);
  `kill_at_batch=N`  SIGKILL right after a generator process of a role-split job
                     (`jaxrl.loop.roles`) sent batch N to the trainer.
A SIGKILL is announced first on stdout (`jaxrl.faults: SIGKILL ... at unix time T`), so a test
can time how long the rest of the job takes to stop.
A suffix `@P` limits the fault to process P of a multi-process job (`JAXRL_PROCESS_ID`, as set
by `launch.local_cluster`), e.g. `kill_at_step=3@1`: one process of the job dies, the others
are then stopped by the job's failure handling. Unset (the default), every hook is a no-op.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

ENV_VAR = "JAXRL_FAULT"
KINDS = ("kill_at_step", "kill_in_save", "sigterm_at_step", "sigint_at_step", "kill_at_batch")


def _fault() -> tuple[str, int] | None:
    spec = os.environ.get(ENV_VAR, "").strip()
    if not spec:
        return None
    fault, _, process = spec.partition("@")
    kind, _, step = fault.partition("=")
    if kind not in KINDS or not step.isdigit() or (process and not process.isdigit()):
        raise ValueError(
            f"{ENV_VAR}={spec!r}; expected one of {', '.join(k + '=N' for k in KINDS)}, "
            "optionally followed by @P (only process P)"
        )
    if process and int(process) != int(os.environ.get("JAXRL_PROCESS_ID", "0")):
        return None
    return kind, int(step)


def _kill() -> None:
    process = os.environ.get("JAXRL_PROCESS_ID", "0")
    print(f"jaxrl.faults: SIGKILL to process {process} at unix time {time.time():.3f}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def after_batch(batch_index: int) -> None:
    """Called by a role-split job's generator after it sent batch `batch_index`."""
    if _fault() == ("kill_at_batch", batch_index):
        _kill()


def after_step(step: int, wait_for_saves=None) -> None:
    """Called by training loops after step `step` (1-based count of updates) completes.

    `wait_for_saves` (e.g. `Checkpointer.wait_until_finished`) runs before the kill, so the
    fault lands *between* saves: the previous save is committed, the current step is not.
    """
    if _fault() == ("kill_at_step", step):
        if wait_for_saves is not None:
            wait_for_saves()
        _kill()
    if _fault() == ("sigterm_at_step", step):
        os.kill(os.getpid(), signal.SIGTERM)
    if _fault() == ("sigint_at_step", step):
        os.kill(os.getpid(), signal.SIGINT)


def wants_kill_in_save(step: int) -> bool:
    return _fault() == ("kill_in_save", step)


def kill_when_exists(path: Path, timeout_s: float = 60.0) -> None:
    """Waits until `path` exists (the save's temporary directory), then kills the process."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"fault injection: {path} never appeared")
        time.sleep(0.005)
    _kill()

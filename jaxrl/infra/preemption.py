"""A graceful stop on SIGTERM (preemption, `kill`, a scheduler's time limit): finish the current
step, save a checkpoint of it, exit 0. Rerunning the same command resumes from that checkpoint.

Training loops (`jaxrl.run_io.RunIO`, `msd_jax.train.run_training`) call `install()` once, force
the save of a step when `requested()`, wait until that save is committed, and call `stop()`, which
raises `StopRequested`; `jaxrl.infra.config.launch` turns it into a message
and exit status 0. A SIGTERM that lands after a step's save decision stops the run after the next
step, so the checkpoint always holds a whole step. A second SIGTERM is not special (the first one
is being honoured); SIGKILL cannot be caught, and the run then resumes from its last checkpoint.

Single process only: in a `jax.distributed` job JAX's preemption service owns SIGTERM (it treats it
as a preemption notice), so there `install()` leaves the signal alone.
"""

from __future__ import annotations

import signal
import threading

_requested = threading.Event()
_installed = False


class StopRequested(Exception):  # noqa: N818  (not an error: the run stopped as asked)
    """Raised after the checkpoint of the step the run stopped at is committed."""


def _handler(signum, frame) -> None:
    del frame
    if not _requested.is_set():
        print(
            f"[jaxrl] {signal.Signals(signum).name} received: finishing this step, saving a "
            "checkpoint, then exiting",
            flush=True,
        )
    _requested.set()


def install() -> None:
    """Installs the SIGTERM handler (main thread of a single-process job; else a no-op)."""
    global _installed
    if _installed or threading.current_thread() is not threading.main_thread():
        return
    import jax

    if jax.process_count() > 1:
        return
    signal.signal(signal.SIGTERM, _handler)
    _installed = True


def requested() -> bool:
    return _requested.is_set()


def stop(step: int, where: str) -> None:
    """Raises StopRequested for a run stopped after `step`, whose save is committed in `where`."""
    raise StopRequested(
        f"stopped by SIGTERM after step {step}; its checkpoint is in {where}. Rerun the same "
        "command to resume."
    )

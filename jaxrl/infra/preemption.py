"""A graceful stop on SIGTERM (preemption, `kill`, a scheduler's time limit) or SIGINT (Ctrl-C):
finish the current step, save a checkpoint of it, exit 0. Rerunning the same command resumes
from that checkpoint.

Training loops (`jaxrl.infra.run_io.RunIO`, which `msd_jax.train.run_training` uses too) call
`install()` when they start (and `uninstall()` when they end: the previous handlers come back),
force the save of a step when `requested()`, wait until that save is committed, and call
`stop()`, which raises `StopRequested`; `jaxrl.infra.launcher.launch` turns it into a message and
exit status 0. A signal that lands after a step's save decision stops the run after the next
step, so the checkpoint always holds a whole step. A second SIGTERM is not special (the first
one is being honoured); a second Ctrl-C stops at once without saving (KeyboardInterrupt), for a
user who will not wait; SIGKILL cannot be caught, and the run then resumes from its last
checkpoint.

Single process only: in a `jax.distributed` job JAX's preemption service owns SIGTERM (it treats it
as a preemption notice), so there `install()` leaves the signals alone.
"""

from __future__ import annotations

import signal
import threading

SIGNALS = (signal.SIGTERM, signal.SIGINT)

_requested = threading.Event()
_signal_name = "SIGTERM"
_depth = 0  # nested installs (the SFT stage inside an RL run): the outermost one restores
_previous: dict[int, object] = {}


class StopRequested(Exception):  # noqa: N818  (not an error: the run stopped as asked)
    """Raised after the checkpoint of the step the run stopped at is committed."""


def _handler(signum, frame) -> None:
    del frame
    global _signal_name
    if _requested.is_set():
        if signum == signal.SIGINT:  # Ctrl-C twice: the user will not wait for the save
            raise KeyboardInterrupt("second Ctrl-C: stopped without saving this step")
        return
    _signal_name = signal.Signals(signum).name
    again = " (Ctrl-C again to stop at once, without saving)" if signum == signal.SIGINT else ""
    print(
        f"[jaxrl] {_signal_name} received: finishing this step, saving a checkpoint, then "
        f"exiting{again}",
        flush=True,
    )
    _requested.set()


def install() -> None:
    """Installs the SIGTERM and SIGINT handlers (main thread of a single-process job; else a
    no-op). Calls nest: only the outermost one installs, its `uninstall()` restores."""
    global _depth
    if threading.current_thread() is not threading.main_thread():
        return
    import jax

    if jax.process_count() > 1:
        return
    if _depth == 0:
        _previous.update({s: signal.signal(s, _handler) for s in SIGNALS})
    _depth += 1


def uninstall() -> None:
    """Undoes one `install()`; the outermost restores the handlers found before it and forgets a
    stop request (a later run in the same process, e.g. a test, starts clean)."""
    global _depth
    if _depth == 0 or threading.current_thread() is not threading.main_thread():
        return
    _depth -= 1
    if _depth == 0:
        for s, previous in _previous.items():
            signal.signal(s, previous)
        _previous.clear()
        _requested.clear()


def requested() -> bool:
    return _requested.is_set()


def stop(step: int, where: str) -> None:
    """Raises StopRequested for a run stopped after `step`, whose save is committed in `where`."""
    raise StopRequested(
        f"stopped by {_signal_name} after step {step}; its checkpoint is in {where}. Rerun the "
        "same command to resume."
    )

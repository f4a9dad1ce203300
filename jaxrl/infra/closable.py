"""Waiting that can be called off: what the rollout queues and the generator's weight store share.

A thread that waits on another (the trainer for rollouts, the generator for weights) must learn of
the other's failure instead of waiting forever: `close(error)` on a queue or store wakes every
waiter, which raises `QueueClosed` carrying the failing side's error (None: a normal shutdown).
`wait_until` is one bounded wait on a condition, raising TimeoutError that names what it waited
for.
"""

from __future__ import annotations

import threading
import time


class QueueClosed(RuntimeError):
    """The queue was closed: by the other side's failure (`error`) or a normal shutdown."""

    def __init__(self, error: BaseException | None = None):
        super().__init__("rollout queue closed" + (f" after {error!r}" if error else ""))
        self.error = error


def wait_until(cond: threading.Condition, deadline: float | None, what: str) -> None:
    """One `cond.wait` (held by the caller) until `deadline` (time.monotonic; None: forever);
    raises TimeoutError naming `what` once the deadline has passed."""
    if deadline is None:
        cond.wait()
        return
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError(f"timed out waiting for {what}")
    cond.wait(remaining)


def unwrap(fn, *args):
    """Calls `fn`; a queue or weight store closed by the other thread's failure raises that
    thread's original exception here (its traceback intact, a note added where it was raised)."""
    try:
        return fn(*args)
    except QueueClosed as closed:
        error = closed.error
    # Raised outside the except block, so the original error is not chained to QueueClosed.
    raise error if error is not None else RuntimeError("the generator thread stopped")

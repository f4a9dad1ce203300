"""GeneratorWeights, the generator's double buffer: versions become visible only once pushed,
the version in use is never freed under the generator, and at most two copies are ever held."""

from __future__ import annotations

import threading
import time

import jax.numpy as jnp
import pytest

from jaxrl.infra.closable import QueueClosed
from jaxrl.sync.plan import GeneratorParams
from jaxrl.sync.store import GeneratorWeights


class FakeSync:
    """Stands in for WeightSync: a push copies the params into fresh arrays, slowly."""

    def __init__(self):
        self.pushed: dict[int, GeneratorParams] = {}

    def push(self, params, version, previous=None):
        assert previous is None  # GeneratorWeights never hands over buffers to overwrite
        time.sleep(0.01)
        self.pushed[version] = GeneratorParams(version, {"w": params["w"] + 0})
        return self.pushed[version], None


def _params(version):
    return {"w": jnp.full((4,), float(version))}


def _signal_waits(weights: GeneratorWeights) -> threading.Event:
    """An event set once a thread blocks in `weights` (it then waits on the condition, which
    releases the lock: whoever takes the lock next sees the waiter blocked)."""
    waiting = threading.Event()
    wait = weights._wait

    def signalling_wait(*args):
        waiting.set()
        wait(*args)

    weights._wait = signalling_wait
    return waiting


def test_fixed_lag_waits_for_the_generator_and_holds_at_most_two_copies():
    weights = GeneratorWeights(FakeSync(), latest_only=False)
    weights.publish(_params(0), 0)
    v0 = weights.acquire(0)
    weights.publish(_params(1), 1)
    assert weights.held_versions == [0, 1]
    published = threading.Event()
    waiting = _signal_waits(weights)
    thread = threading.Thread(
        target=lambda: (weights.publish(_params(2), 2), published.set()), daemon=True
    )
    thread.start()
    assert waiting.wait(5)  # the push of version 2 blocks for a free slot...
    assert not published.is_set() and weights.held_versions == [0, 1]  # ...and stays blocked
    assert float(v0.params["w"][0]) == 0.0  # the version in use is intact meanwhile
    v1 = weights.acquire(1)  # between batches: takes version 1, frees version 0
    assert published.wait(5) and weights.held_versions == [1, 2]
    assert v0.params["w"].is_deleted() and float(v1.params["w"][0]) == 1.0
    assert weights.acquire(2).version == 2 and v1.params["w"].is_deleted()
    with pytest.raises(ValueError, match="after version"):  # the schedules never go back
        weights.acquire(1)


def test_free_running_supersedes_unused_versions_and_close_wakes_waiters():
    sync = FakeSync()
    weights = GeneratorWeights(sync, latest_only=True)
    weights.publish(_params(0), 0)
    v0 = weights.acquire(None)
    weights.publish(_params(1), 1)
    v1 = sync.pushed[1]
    weights.publish(_params(2), 2)  # version 1 was never sampled from: freed, no waiting
    assert weights.held_versions == [0, 2] and v1.params["w"].is_deleted()
    assert not v0.params["w"].is_deleted()
    assert weights.acquire(None).version == 2 and v0.params["w"].is_deleted()

    error = RuntimeError("trainer died")
    outcome = {}

    def wait_for_version_5():
        try:
            weights.acquire(5)
        except QueueClosed as closed:
            outcome["error"] = closed.error

    waiting = _signal_waits(weights)
    thread = threading.Thread(target=wait_for_version_5)
    thread.start()
    assert waiting.wait(5)  # blocked in acquire(5): close must wake it
    weights.close(error)
    thread.join(5)
    assert outcome["error"] is error
    weights.free()
    assert weights.held_versions == []

"""The role split's rollout channel (`jaxrl.loop.roles`): keys in the coordination service's
key-value store that carry the scored batches from the generator processes to the trainer
processes, and the few JSON values both sides agree on (`start`, `room/k`, `done`).

A batch is a bytes value, zlib-compressed JSON of `ScoredBatch.to_json` (float32 log-probs and
mixture-of-experts routing records exact), under `batch/k`; the lead trainer deletes it once
the step that trained on it is done.
"""

from __future__ import annotations

import json
import time
import zlib

import jax

from jaxrl.loop.rollout_queue import ScoredBatch

_PREFIX = "jaxrl_roles"
_POLL_MS = 1000


class RolloutChannel:
    """Keys in the coordination service's key-value store (module docstring). Blocking reads
    wait at most `timeout_s` and raise TimeoutError naming what they waited for."""

    def __init__(self, timeout_s: float):
        from jax._src import distributed as jax_distributed

        self.client = jax_distributed.global_state.client
        if self.client is None:
            raise RuntimeError("RolloutChannel needs a jax.distributed job (initialize first)")
        self.timeout_s = timeout_s

    def put_json(self, name: str, value) -> None:
        self.client.key_value_set_bytes(f"{_PREFIX}/{name}", json.dumps(value).encode())

    def get_json(self, name: str, what: str, timeout_s: float | None = None):
        return json.loads(self._get(name, what, timeout_s))

    def has(self, name: str) -> bool:
        return self.client.key_value_try_get_bytes(f"{_PREFIX}/{name}") is not None

    def send(self, batch: ScoredBatch) -> None:
        blob = zlib.compress(json.dumps(batch.to_json()).encode(), 1)
        self.client.key_value_set_bytes(f"{_PREFIX}/batch/{batch.batch_index}", blob)

    def receive(self, index: int) -> ScoredBatch:
        blob = self._get(f"batch/{index}", f"the generator to send batch {index}")
        return ScoredBatch.from_json(json.loads(zlib.decompress(blob)))

    def forget(self, index: int) -> None:
        self.client.key_value_delete(f"{_PREFIX}/batch/{index}")

    def _get(self, name: str, what: str, timeout_s: float | None = None) -> bytes:
        """Polls in one-second waits, so a stuck read is noticed against its own deadline."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        key = f"{_PREFIX}/{name}"
        while True:
            try:
                return self.client.blocking_key_value_get_bytes(key, _POLL_MS)
            except jax.errors.JaxRuntimeError as err:
                if "DEADLINE_EXCEEDED" not in str(err):
                    raise
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {what}")

"""`simulate(n)`: JAX on the CPU with `n` simulated devices, unless XLA_FLAGS already sets a
count. Benchmarks call it before anything imports JAX (the flag is read once, at start-up)."""

from __future__ import annotations

import os


def simulate(count: int = 8) -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        flags = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={count}"
        os.environ["XLA_FLAGS"] = flags.strip()

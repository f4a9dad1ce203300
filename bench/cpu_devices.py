"""`simulate(n)`: JAX on the CPU with `n` simulated devices, unless XLA_FLAGS already sets a
count. Benchmarks call it before anything imports JAX (the flag is read once, at start-up)."""

from __future__ import annotations

import os


def simulate(count: int = 8) -> None:
    from jaxrl.infra.xla_cpu import cpu_xla_flags

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = cpu_xla_flags(os.environ.get("XLA_FLAGS", ""), devices=count)

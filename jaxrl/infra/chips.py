"""What the planner knows of an accelerator chip (`ChipSpec`), and the error for a topology it
cannot describe (`TopologyError`); shared by the TPU (`jaxrl.infra.tpu`) and NVIDIA GPU
(`jaxrl.infra.gpu`) tables. Imports no JAX.
"""

from __future__ import annotations

import dataclasses

GiB = 1024**3


@dataclasses.dataclass(frozen=True)
class ChipSpec:
    """Published peaks of one accelerator chip.

    hbm_bytes: HBM capacity; peak_flops: dense bf16 FLOP/s; hbm_bandwidth: bytes/s.
    """

    name: str
    hbm_bytes: int
    peak_flops: float
    hbm_bandwidth: float

    def per_device(self, devices_per_chip: int) -> ChipSpec:
        """The share of one device when a chip shows as several (v4: one per TensorCore)."""
        n = devices_per_chip
        return dataclasses.replace(
            self,
            hbm_bytes=self.hbm_bytes // n,
            peak_flops=self.peak_flops / n,
            hbm_bandwidth=self.hbm_bandwidth / n,
        )


class TopologyError(ValueError):
    """A topology name that is malformed, not whole hosts or nodes, or needs a compiler plugin
    (libtpu, the CUDA plugin) that is missing."""

"""Per-kernel costs of a compiled program's optimized HLO: `jaxrl.infra.hlo_cost` (kept under this
name for the bench scripts that import it)."""

from jaxrl.infra.hlo_cost import Kernel, collectives, kernels, parse_module, shape_bytes, totals

__all__ = ["Kernel", "collectives", "kernels", "parse_module", "shape_bytes", "totals"]

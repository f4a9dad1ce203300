"""The launchers, `python -m launch.<job>`.

Importing the package sets XLA's CPU scheduler flag on a machine that runs JAX on the CPU
(`jaxrl.infra.xla_cpu`): XLA reads XLA_FLAGS when JAX starts its backend, after this import.
"""

from jaxrl.infra.xla_cpu import set_cpu_xla_flags

set_cpu_xla_flags()

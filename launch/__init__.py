"""The launchers, `python -m launch.<job>`.

Importing the package sets XLA's CPU scheduler flag on a machine that runs JAX on the CPU
(`jaxrl.infra.xla_cpu`): XLA reads XLA_FLAGS when JAX starts its backend, after this import.
There it also has malloc keep freed memory for reuse (`keep_freed_memory`: XLA:CPU's temporary
buffers then stop faulting in fresh pages each step; `JAXRL_KEEP_FREED_MEMORY=0` turns it off).
"""

from jaxrl.infra.xla_cpu import keep_freed_memory, keep_freed_memory_wanted, set_cpu_xla_flags

set_cpu_xla_flags()
if keep_freed_memory_wanted():
    keep_freed_memory()

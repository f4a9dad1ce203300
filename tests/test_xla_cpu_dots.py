"""`jaxrl.infra.xla_cpu.CPU_EXACT_DOT_FLAG`: XLA:CPU compiles f32 dots itself instead of
handing them to YNNPACK (whose GEMM rounds more; bench/gguf_parity.py), and `add_xla_flag`
keeps a value the user set."""

import os
import subprocess
import sys

from jaxrl.infra.xla_cpu import CPU_EXACT_DOT_FLAG, add_xla_flag

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SNIPPET = """
import re
import jax, jax.numpy as jnp
x = jnp.ones((64, 576), jnp.float32)
w = jnp.ones((576, 1536), jnp.float32)
hlo = jax.jit(lambda a, b: jnp.tanh(a @ b)).lower(x, w).compile().as_text()
bodies, name = {}, None
for line in hlo.splitlines():
    if line.endswith("{") and not line.startswith(" "):
        name = line.split()[0]
        bodies[name] = []
    elif name is not None:
        bodies[name].append(line)
ynn = re.findall(r"calls=(%[^,\\s]+).*__ynn_fusion", hlo)
print(sum(" dot(" in line for c in ynn for line in bodies[c]), hlo.count(" dot("))
"""


def test_add_xla_flag_keeps_the_users_value():
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    add_xla_flag(CPU_EXACT_DOT_FLAG, env)
    assert env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=4 " + CPU_EXACT_DOT_FLAG
    add_xla_flag(CPU_EXACT_DOT_FLAG, env)  # once only
    assert env["XLA_FLAGS"].split().count(CPU_EXACT_DOT_FLAG) == 1
    theirs = {"XLA_FLAGS": "--xla_cpu_experimental_ynn_fusion_type=individual_dot"}
    add_xla_flag(CPU_EXACT_DOT_FLAG, theirs)
    assert theirs["XLA_FLAGS"] == "--xla_cpu_experimental_ynn_fusion_type=individual_dot"
    empty: dict[str, str] = {}
    add_xla_flag(CPU_EXACT_DOT_FLAG, empty)
    assert empty["XLA_FLAGS"] == CPU_EXACT_DOT_FLAG


def _compiled(xla_flags: str) -> tuple[int, int]:
    """(dots inside YNNPACK fusions, dots) of a compiled f32 matmul."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags)
    result = subprocess.run(
        [sys.executable, "-c", _SNIPPET], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-2000:]
    in_ynn, dots = result.stdout.split()
    return int(in_ynn), int(dots)


def test_the_flag_keeps_dots_out_of_ynnpack():
    """This jaxlib knows the flag (XLA aborts on an unknown one), and with it the dot is XLA's
    own; by default YNNPACK's (which is what the flag is for)."""
    assert _compiled(CPU_EXACT_DOT_FLAG) == (0, 1)
    assert _compiled("") == (1, 1)

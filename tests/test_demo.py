"""`make demo` on its own defaults: a layout whose roles run side by side on CPU devices (the note
`launch.rl` prints for a layout where they take turns is not printed)."""

from __future__ import annotations

import gin

from jaxrl.infra.config import parse_gin, resolve_bindings
from jaxrl.infra.mesh import cpu_overlap_note, make_mesh
from launch.demo import demo_flags
from launch.rl import rl_main


def _meshes(flags: list[str]):
    files = [flags[i + 1] for i, f in enumerate(flags) if f == "--gin_file"]
    params = [f.split("=", 1)[1] for f in flags if f.startswith("--gin_param=")]
    params += [flags[i + 1] for i, f in enumerate(flags) if f == "--gin_param"]
    try:
        parse_gin(files, params)
        kwargs = resolve_bindings(rl_main)
    finally:
        gin.clear_config()
    return make_mesh(kwargs["mesh"]), make_mesh(kwargs["generator_mesh"])


def test_the_demo_layout_runs_both_roles_at_once_on_cpu_devices(tmp_path):
    trainer, generator = _meshes(demo_flags(str(tmp_path), 400, sync=False))
    assert trainer.devices.size == 4 and [d.id for d in generator.devices.flat] == [4]
    assert cpu_overlap_note(trainer, generator) is None
    # The config alone (what benchmarks run) keeps its 4-device generator, and the note.
    flags = [f for f in demo_flags(str(tmp_path), 400, sync=False) if "MeshConfig" not in f]
    trainer, generator = _meshes(flags)
    assert generator.devices.size == 4 and cpu_overlap_note(trainer, generator) is not None

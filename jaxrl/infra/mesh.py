"""Device meshes built from a slice of `jax.devices()`.

Each role (trainer, generator, MSD student) gets its own mesh over its own slice of the global
device list, so the trainer can run FSDP x TP while the generator runs TP x DP replicas on other
chips; colocated runs give both roles the same slice. A `MeshConfig` says which devices (a first
index and a count, or explicit ids) and the named axes with their sizes; one size may be -1,
meaning "whatever is left". Everything is checked before a mesh is built, and errors name the
numbers involved and the fix.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

logger = logging.getLogger(__name__)
_AXIS_TYPES = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Which devices a mesh uses and how they are laid out.

    Attributes:
      axis_names: mesh axis names, e.g. ("fsdp", "tp") for the trainer, ("dp", "tp") for the
        generator. They must match the mesh axes named in the role's rules table.
      axis_sizes: one size per axis; at most one may be -1 (all devices not used by the others).
      first_device: index into `jax.devices()` of the slice's first device.
      num_devices: how many devices from `first_device` on; -1 means all the rest.
      device_indices: explicit indices into `jax.devices()` (overrides `first_device` /
        `num_devices`), for non-contiguous slices, in mesh order. Indices, not `Device.id`s:
        `jax.devices()` is ordered by process, then id, so index 4 of a job of 2 processes x 4
        devices is process 1's first device on every platform (CPU ids there are 2048 + n).
      axis_type: "auto" (GSPMD: shardings from rules + `with_sharding_constraint`, the style the
        models use) or "explicit" (JAX sharding-in-types).
    """

    axis_names: tuple[str, ...] = ("fsdp", "tp")
    axis_sizes: tuple[int, ...] = (-1, 1)
    first_device: int = 0
    num_devices: int = -1
    device_indices: tuple[int, ...] | None = None
    axis_type: str = "auto"

    def validate(self) -> None:
        """Checks the config on its own (no devices needed); raises ValueError naming the field."""
        if len(self.axis_names) != len(self.axis_sizes):
            raise ValueError(
                f"MeshConfig: {len(self.axis_names)} axis_names {self.axis_names} but "
                f"{len(self.axis_sizes)} axis_sizes {self.axis_sizes}; give one size per axis."
            )
        if len(set(self.axis_names)) != len(self.axis_names):
            raise ValueError(f"MeshConfig: axis_names {self.axis_names} has duplicates.")
        if any(s == 0 or s < -1 for s in self.axis_sizes):
            raise ValueError(
                f"MeshConfig: axis_sizes {self.axis_sizes} must be positive, or -1 for the rest."
            )
        if list(self.axis_sizes).count(-1) > 1:
            raise ValueError(
                f"MeshConfig: axis_sizes {self.axis_sizes} has more than one -1; at most one axis "
                "can take the remaining devices."
            )
        if self.first_device < 0:
            raise ValueError(f"MeshConfig: first_device={self.first_device} must be >= 0.")
        if self.num_devices == 0 or self.num_devices < -1:
            raise ValueError(
                f"MeshConfig: num_devices={self.num_devices} must be positive, or -1 for the rest."
            )
        if self.axis_type not in _AXIS_TYPES:
            raise ValueError(
                f"MeshConfig: axis_type={self.axis_type!r}; expected one of {sorted(_AXIS_TYPES)}."
            )


def select_devices(
    config: MeshConfig, devices: Sequence[jax.Device] | None = None
) -> list[jax.Device]:
    """The slice of `devices` (default `jax.devices()`) that `config` asks for."""
    devices = list(jax.devices() if devices is None else devices)
    if config.device_indices is not None:
        indices = config.device_indices
        missing = [i for i in indices if not 0 <= i < len(devices)]
        if missing:
            raise ValueError(
                f"mesh asks for device indices {missing} but only {len(devices)} devices exist "
                f"(indices 0-{len(devices) - 1}); fix MeshConfig.device_indices."
            )
        if len(set(indices)) != len(indices):
            raise ValueError(f"MeshConfig.device_indices {indices} has duplicates.")
        return [devices[i] for i in indices]
    if config.first_device >= len(devices):
        raise ValueError(
            f"mesh starts at device {config.first_device} but only {len(devices)} devices exist; "
            "lower MeshConfig.first_device."
        )
    available = len(devices) - config.first_device
    count = available if config.num_devices == -1 else config.num_devices
    if count > available:
        raise ValueError(
            f"mesh needs {count} devices from index {config.first_device} but only "
            f"{len(devices)} exist ({available} from that index); lower MeshConfig.num_devices "
            "or first_device, or run on more devices."
        )
    return devices[config.first_device : config.first_device + count]


def resolve_axis_sizes(axis_sizes: Sequence[int], num_devices: int) -> tuple[int, ...]:
    """Replaces the -1 in `axis_sizes` by what is left of `num_devices` and checks the product.

    With an explicit device slice the product must equal the slice size; without a -1 and with
    `num_devices=-1` in the config, the caller passes the number of devices after `first_device`
    and a smaller product simply takes the first devices of the slice (see `make_mesh`).
    """
    fixed = math.prod(s for s in axis_sizes if s != -1)
    if -1 not in axis_sizes:
        return tuple(axis_sizes)
    if num_devices % fixed:
        raise ValueError(
            f"mesh axis sizes {tuple(axis_sizes)}: the fixed axes use {fixed} devices, which "
            f"does not divide the {num_devices} available; change the sizes or the device count."
        )
    return tuple(num_devices // fixed if s == -1 else s for s in axis_sizes)


def make_mesh(config: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Builds the mesh `config` describes over its slice of `devices` (default `jax.devices()`).

    Example: MeshConfig(("fsdp", "tp"), (-1, 2), first_device=0, num_devices=4) on 8 devices
    -> Mesh(fsdp=2, tp=2) over devices 0..3.
    """
    config.validate()
    all_devices = list(jax.devices() if devices is None else devices)
    explicit_count = config.device_indices is not None or config.num_devices != -1
    if not explicit_count and -1 not in config.axis_sizes:
        # Fixed sizes and "the rest" as count: use exactly as many devices as the sizes ask for.
        needed = math.prod(config.axis_sizes)
        config = dataclasses.replace(config, num_devices=needed)
    chosen = select_devices(config, all_devices)
    sizes = resolve_axis_sizes(config.axis_sizes, len(chosen))
    if math.prod(sizes) != len(chosen):
        raise ValueError(
            f"mesh axes {dict(zip(config.axis_names, sizes, strict=True))} need "
            f"{math.prod(sizes)} devices but the slice has {len(chosen)}; make the sizes "
            "multiply to the device count or use -1 for one axis."
        )
    axis_types = (_AXIS_TYPES[config.axis_type],) * len(sizes)
    if config.device_indices is None:
        try:  # topology-aware device order (TPU torus, GPU NVLink islands)
            return jax.make_mesh(sizes, config.axis_names, axis_types, devices=chosen)
        except (ValueError, NotImplementedError, AssertionError) as err:
            logger.warning("jax.make_mesh failed on a device slice (%s); using slice order", err)
    # Explicit indices keep the caller's order; also the fallback for slices make_mesh rejects.
    device_grid = np.asarray(chosen, dtype=object).reshape(sizes)
    return Mesh(device_grid, config.axis_names, axis_types=axis_types)


def mesh_device_ids(mesh: Mesh) -> list[int]:
    """The ids of the devices in `mesh`, in mesh order."""
    return [d.id for d in mesh.devices.flat]


def cpu_overlap_note(trainer: Mesh, generator: Mesh) -> str | None:
    """A note when async roles on CPU devices of one process cannot run at the same time: XLA:CPU
    runs one multi-device program at a time there (`python -m bench.scale_validate --turns`: a
    4-device program called while another 4-device one runs waits for it to end; a one-device
    program does not), so a multi-device generator makes no progress during a multi-device
    train step, and the trainer then waits for its groups. None when the roles can overlap
    (either mesh on one device, not CPU, or one process per role)."""
    devices = [*trainer.devices.flat, *generator.devices.flat]
    if any(d.platform != "cpu" for d in devices):
        return None
    if len({d.process_index for d in devices}) > 1 or min(trainer.size, generator.size) < 2:
        return None
    return (
        f"[mesh] note: on CPU devices of one process XLA runs one multi-device program at a "
        f"time: the generator's {generator.size}-device programs wait while each of the "
        f"trainer's {trainer.size}-device programs runs, so the roles' device work takes turns; "
        "a one-device generator mesh (generator/MeshConfig.axis_sizes = (1, 1), num_devices = "
        "1) runs beside the trainer. GPUs and TPUs run disjoint devices' programs at once."
    )


def check_disjoint(meshes: Mapping[str, Mesh]) -> None:
    """Raises if two role meshes share a device (colocated runs pass one mesh, not two)."""
    owner: dict[int, str] = {}
    for role, mesh in meshes.items():
        for device_id in mesh_device_ids(mesh):
            if device_id in owner and owner[device_id] != role:
                raise ValueError(
                    f"device {device_id} is in both the {owner[device_id]!r} and the {role!r} "
                    "mesh; give the roles disjoint slices (first_device / num_devices) or use "
                    "colocated mode."
                )
            owner[device_id] = role

"""TPU chips and topologies for ahead-of-time compilation on a machine without TPUs.

`topology_devices("v5p:2x2x2")` returns the `jax.Device`s of a TPU slice described by libtpu
(`jax.experimental.topologies.get_topology_desc`), with no TPU attached: a mesh built from them
lowers and compiles with the TPU compiler (`jax.jit(f).lower(abstract_args).compile()`), which
reports `memory_analysis()` and `cost_analysis()` per device. That needs the `libtpu` wheel
(`pip install libtpu==0.0.42.1`, part of the `test` extra); it is imported lazily, so the library
works without it and only planning asks for it.

Chip figures (per chip; `CHIPS`) are the published peaks: HBM capacity, dense bf16 matmul
FLOP/s and HBM bandwidth, from the Cloud TPU system-architecture pages (v4, v5e, v5p, v6e).
A v4 chip shows as two devices (one per TensorCore) in these topologies; its HBM and peaks are
split evenly between them (`ChipSpec.per_device`).
"""

from __future__ import annotations

import math
import os
import re
from typing import TYPE_CHECKING

from jaxrl.infra.chips import ChipSpec, GiB, TopologyError
from jaxrl.infra.platforms import tpu_attached, without_plugin_noise

if TYPE_CHECKING:  # for annotations only: this module imports without JAX
    import jax

CHIPS: dict[str, ChipSpec] = {
    "v4": ChipSpec("v4", 32 * GiB, 275e12, 1228e9),
    "v5e": ChipSpec("v5e", 16 * GiB, 197e12, 819e9),
    "v5p": ChipSpec("v5p", 95 * GiB, 459e12, 2765e9),
    "v6e": ChipSpec("v6e", 32 * GiB, 918e12, 1640e9),
}
# Chips per host: libtpu's default host bounds are 2x2x1 chips; a topology is whole hosts.
HOST_CHIPS = (2, 2, 1)

_TOPOLOGY = re.compile(r"^(v4|v5e|v5p|v6e):(\d+)x(\d+)(?:x(\d+))?$")


def parse_topology(name: str) -> tuple[str, tuple[int, ...]]:
    """`"v5p:2x2x2"` -> ("v5p", (2, 2, 2)); checks the name and that it is whole hosts."""
    match = _TOPOLOGY.match(name)
    if not match:
        raise TopologyError(
            f"topology {name!r} is not '<chip>:<X>x<Y>[x<Z>]' with chip in {sorted(CHIPS)} "
            "(e.g. 'v5e:2x2', 'v5p:2x2x2')"
        )
    chip = match.group(1)
    dims = tuple(int(d) for d in match.groups()[1:] if d is not None)
    three_d = chip in ("v4", "v5p")
    if three_d != (len(dims) == 3):
        example = "v5p:2x2x1" if three_d else "v5e:2x2"
        raise TopologyError(
            f"topology {name!r}: {chip} slices are {'3' if three_d else '2'}-D (e.g. {example})"
        )
    padded = dims + (1,) * (3 - len(dims))
    if any(d % h for d, h in zip(padded, HOST_CHIPS, strict=True)):
        whole = [max(d, h) for d, h in zip(padded, HOST_CHIPS, strict=True)]
        smallest = "x".join(str(max(d, h)) for d, h in zip(padded, HOST_CHIPS, strict=True))
        if not three_d:
            smallest = smallest.removesuffix("x1")
        raise TopologyError(
            f"topology {name!r} is not a whole number of TPU hosts ({HOST_CHIPS[0]}x"
            f"{HOST_CHIPS[1]} chips each): libtpu describes slices host by host. Plan on "
            f"'{chip}:{smallest}' ({math.prod(whole)} chips, the smallest whole-host slice "
            "there) or a larger one."
        )
    return chip, dims


def slice_with(chip: str, devices: int) -> str | None:
    """A whole-host slice of `chip` with `devices` devices, e.g. ("v5p", 32) -> "v5p:2x4x4"
    (a v4 chip is two devices); None where there is none."""
    per_chip = 2 if chip == "v4" else 1
    chips, rest = divmod(devices, per_chip)
    dims = [*HOST_CHIPS] if chip in ("v4", "v5p") else [*HOST_CHIPS[:2]]
    while math.prod(dims) < chips:
        low = min(dims)
        dims[len(dims) - 1 - dims[::-1].index(low)] *= 2  # the last of the smallest grows
    if rest or math.prod(dims) != chips:
        return None
    return f"{chip}:" + "x".join(map(str, dims))


def topology_devices(name: str) -> list[jax.Device]:
    """The devices of TPU topology `name` (no TPU needed; needs the libtpu wheel)."""
    parse_topology(name)
    # libtpu takes a machine-wide lock file for the TPU it expects to own; describing a topology
    # owns nothing, so concurrent planners (and test runs) must not block each other.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    if not tpu_attached():
        # libtpu looks for this machine's TPU slice in the environment (the metadata server is
        # skipped without a TPU) and logged 6 lines of errors about the accelerator type and
        # worker hostnames it could not find. Describing one host of no TPUs silences them;
        # the topology described, and what compiles for it, is the same.
        os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
        os.environ.setdefault("TPU_HOST_BOUNDS", "1,1,1")
    try:
        from jax.experimental import topologies

        with without_plugin_noise():  # the CUDA plugin's, when installed
            topology = topologies.get_topology_desc(topology_name=name, platform="tpu")
        return list(topology.devices)
    except Exception as err:  # libtpu missing surfaces as RuntimeError / ValueError from PJRT
        text = str(err)
        if "libtpu" in text.lower() or "unknown backend" in text.lower() or "tpu" not in text:
            raise TopologyError(
                f"cannot describe TPU topology {name!r}: {text.strip().splitlines()[0]}. "
                "Ahead-of-time TPU compilation needs the libtpu wheel: "
                "`pip install libtpu==0.0.42.1` (or `pip install -e '.[test]'`)."
            ) from err
        raise TopologyError(f"libtpu refused topology {name!r}: {text}") from err


def device_spec(devices) -> ChipSpec:
    """The `ChipSpec` share of one device of `devices` (all of one kind)."""
    kind = devices[0].device_kind.lower()
    table = {"tpu v4": "v4", "tpu v5 lite": "v5e", "tpu v5": "v5p", "tpu v6 lite": "v6e"}
    if kind not in table:
        raise TopologyError(f"no chip figures for device kind {devices[0].device_kind!r}")
    per_chip = 1 + max(getattr(d, "core_on_chip", 0) for d in devices)
    return CHIPS[table[kind]].per_device(per_chip)

"""Random, legal trainer / generator layout pairs for the weight-sync property tests.

A case is a pair of meshes over subsets of the available devices (random sizes, shapes, axis
names and device orders; overlapping or disjoint), a few parameters whose dimensions divide
over the mesh axes their specs name (each axis used at most once per spec, the rest
replicated), a parameter dtype and a generator dtype. `describe` prints a case so that a
failure names it; `make_case(seed, devices)` rebuilds it.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

AXIS_NAMES = ("fsdp", "tp", "dp", "sp")
DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class LayoutCase:
    seed: int
    trainer: tuple  # (device indices, mesh shape, axis names)
    generator: tuple
    params: tuple  # ((shape, trainer spec, generator spec), ...)
    param_dtype: str
    generator_dtype: str | None


def _factorize(rng, n: int) -> tuple[int, ...]:
    """A random ordered factorization of n into 1-3 factors (ones allowed)."""
    rank = int(rng.integers(1, 4))
    sizes = [1] * rank
    for p in [2, 2, 2, 3, 3, 5, 7]:
        while n % p == 0:
            n //= p
            sizes[int(rng.integers(rank))] *= p
    assert n == 1
    return tuple(sizes)


def _mesh(rng, indices) -> tuple:
    shape = _factorize(rng, len(indices))
    names = tuple(rng.permutation(AXIS_NAMES)[: len(shape)].tolist())
    return (tuple(indices), shape, names)


def _spec(rng, mesh: tuple, ndim: int) -> tuple:
    """Each mesh axis goes to one dimension (as a single name or inside a tuple) or nowhere."""
    _, shape, names = mesh
    dims: list[list[str]] = [[] for _ in range(ndim)]
    for name in rng.permutation(names).tolist():
        where = int(rng.integers(ndim + 1))
        if where < ndim:
            dims[where].append(name)
    return tuple(None if not d else d[0] if len(d) == 1 else tuple(d) for d in dims)


def _axis_product(mesh: tuple, entry) -> int:
    _, shape, names = mesh
    if entry is None:
        return 1
    entry = (entry,) if isinstance(entry, str) else entry
    return int(np.prod([shape[names.index(a)] for a in entry]))


def make_case(seed: int, num_devices: int) -> LayoutCase:
    rng = np.random.default_rng(seed)
    counts = [n for n in (1, 2, 3, 4, 6, 8) if n <= num_devices]

    def pick():
        n = int(rng.choice(counts))
        return rng.permutation(num_devices)[:n].tolist()  # any subset, any order

    trainer, generator = _mesh(rng, pick()), _mesh(rng, pick())
    params = []
    for _ in range(int(rng.integers(1, 4))):
        ndim = int(rng.integers(1, 4))
        t_spec, g_spec = _spec(rng, trainer, ndim), _spec(rng, generator, ndim)
        shape = tuple(
            int(np.lcm(_axis_product(trainer, a), _axis_product(generator, b)))
            * int(rng.integers(1, 4))
            for a, b in zip(t_spec, g_spec, strict=True)
        )
        params.append((shape, t_spec, g_spec))
    return LayoutCase(
        seed=seed,
        trainer=trainer,
        generator=generator,
        params=tuple(params),
        param_dtype=str(rng.choice(DTYPES)),
        generator_dtype=[None, "float32", "bfloat16"][int(rng.integers(3))],
    )


def shardings(case: LayoutCase, devices, role: str) -> dict[str, NamedSharding]:
    indices, shape, names = getattr(case, role)
    mesh = Mesh(np.asarray([devices[i] for i in indices], dtype=object).reshape(shape), names)
    which = 1 if role == "trainer" else 2
    return {
        f"w{i}": NamedSharding(mesh, PartitionSpec(*p[which])) for i, p in enumerate(case.params)
    }


def host_params(case: LayoutCase) -> dict[str, np.ndarray]:
    """Distinct values per element (so a misplaced block cannot pass), in the param dtype."""
    import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy)

    rng = np.random.default_rng(case.seed + 1)
    return {
        f"w{i}": rng.standard_normal(p[0]).astype(np.float32).astype(case.param_dtype)
        for i, p in enumerate(case.params)
    }


def describe(case: LayoutCase) -> str:
    lines = [
        f"layout case seed={case.seed}: params {case.param_dtype} -> generator "
        f"{case.generator_dtype}",
        f"  trainer   devices {case.trainer[0]} mesh "
        f"{dict(zip(case.trainer[2], case.trainer[1], strict=True))}",
        f"  generator devices {case.generator[0]} mesh "
        f"{dict(zip(case.generator[2], case.generator[1], strict=True))}",
    ]
    for i, (shape, t_spec, g_spec) in enumerate(case.params):
        lines.append(f"  w{i} {shape}: trainer P{t_spec} -> generator P{g_spec}")
    return "\n".join(lines)

"""`jaxrl.loop.roles.check_roles`: which role each process of a job runs, and the refusals (named,
with the fix) of a roles list that does not fit the job or the meshes. Meshes are stand-ins
whose devices carry a process index, so a 2-process layout is checked in one process."""

from types import SimpleNamespace

import numpy as np
import pytest

from jaxrl.loop import roles as roles_lib


def _mesh(*devices: tuple[int, int]):
    """A stand-in mesh over devices given as (id, process index)."""
    return SimpleNamespace(
        devices=np.array([SimpleNamespace(id=i, process_index=p) for i, p in devices])
    )


TRAINER = _mesh((0, 0), (1, 0))  # process 0's devices
GENERATOR = _mesh((4, 1), (5, 1))  # process 1's


@pytest.fixture
def two_processes(monkeypatch):
    monkeypatch.setattr(roles_lib.jax, "process_count", lambda: 2)


def test_each_process_gets_its_role(two_processes):
    layout = roles_lib.check_roles(["trainer", "generator"], TRAINER, GENERATOR)
    assert layout.trainer_processes == (0,) and layout.generator_processes == (1,)
    assert [layout.role_of(p) for p in (0, 1)] == ["trainer", "generator"]


@pytest.mark.parametrize(
    "roles, trainer, generator, message",
    [
        (("trainer",), TRAINER, GENERATOR, "names 1 processes but the job has 2"),
        (("trainer", "sampler"), TRAINER, GENERATOR, "unknown role(s) ['sampler']"),
        (("generator", "trainer"), TRAINER, GENERATOR, "process 0 must be a trainer"),
        (("trainer", "trainer"), TRAINER, GENERATOR, "has no generator process"),
        (
            ("trainer", "generator"),
            _mesh((0, 0), (4, 1)),
            GENERATOR,
            "the trainer mesh uses device(s) [4] of process(es) [1]",
        ),
        (
            ("trainer", "generator"),
            TRAINER,
            _mesh((2, 0), (5, 1)),
            "the generator mesh uses device(s) [2] of process(es) [0]",
        ),
    ],
)
def test_a_roles_list_that_does_not_fit_is_refused(
    two_processes, roles, trainer, generator, message
):
    with pytest.raises(roles_lib.RoleLayoutError) as error:
        roles_lib.check_roles(roles, trainer, generator)
    assert message in str(error.value), str(error.value)

"""Scripts written against 0.1.0 still import: every import line docs/API.md showed at bfba6ed (the
0.1.0 API page) runs, and each name that moved answers from its new home with a
DeprecationWarning naming it (CHANGELOG.md lists the moves)."""

from __future__ import annotations

import importlib
import os
import warnings

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The import lines of docs/API.md at bfba6ed (`git show bfba6ed:docs/API.md`), and where each
# moved name lives now (None: it never moved).
API_0_1_0 = {
    "from jaxrl.tasks.source import PromptItem, register_task": None,
    "from jaxrl.trainer import LossConfig, OptimizerConfig, Trainer": None,
    "from jaxrl.models import hf": None,
    "from jaxrl.executors import colocated_sampler": "jaxrl.generation.placement",
    "from jaxrl.generation.sampling import SamplingConfig": None,
    "from jaxrl.rl import collate_rollouts, rollouts_from_samples": None,
    "from jaxrl.tasks.rewards import compute_rewards, decode_completions": None,
    "from jaxrl.tasks.source import encode_prompts": None,
    "from jaxrl.controller import Controller, RLConfig, sampling_config": "jaxrl.loop",
    "from jaxrl.executors import GeneratorExecutor, RewardExecutor, colocated_sampler": "jaxrl.",
    "from jaxrl.run_io import RunIO": "jaxrl.infra.run_io",
    # named in its text: `jaxrl.infra.config.keep_torch_out()`, `jaxrl.sft.rl_source_after_sft`
    "from jaxrl.infra.config import keep_torch_out": "jaxrl.infra.user_code",
    "from jaxrl.sft import rl_source_after_sft": None,
}
ALIASES = (
    "jaxrl.controller",
    "jaxrl.executors",
    "jaxrl.run_io",
    "jaxrl.roles",
    "jaxrl.rollout_queue",
    "jaxrl.streaming",
    "jaxrl.weight_sync",
    "jaxrl.weight_sync_xproc",
)


@pytest.mark.parametrize("line", sorted(API_0_1_0))
def test_every_import_of_the_0_1_0_api_page_still_works(line):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        namespace: dict = {}
        exec(line, namespace)
    names = [n.strip() for n in line.split(" import ")[1].split(",")]
    assert all(namespace[n] is not None for n in names)
    moved = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    moved = [m for m in moved if " moved to " in m]
    home = API_0_1_0[line]
    if home is None:
        assert not moved, moved
        return
    assert len(moved) == len(names), moved
    for name, message in zip(names, moved, strict=True):
        new_module = namespace[name].__module__  # classes and functions, each where it lives
        assert f"moved to {new_module}.{name} in 0.2.0" in message, message
        assert f"write `from {new_module} import {name}`" in message, message
        assert new_module.startswith(home), (new_module, home)
    assert all(w.filename == "<string>" for w in caught), [w.filename for w in caught]


def test_every_name_of_each_alias_resolves_and_the_changelog_lists_it():
    """Each name an alias module lists resolves; a name removed outright says what replaced it;
    CHANGELOG.md has each alias's line to write instead, and the version is 0.2.0."""
    changelog = open(os.path.join(REPO, "CHANGELOG.md"), encoding="utf-8").read()
    for alias in ALIASES:
        module = importlib.import_module(alias)
        assert f"`from {alias} import" in changelog, alias
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            for name in dir(module):
                value = getattr(module, name)
                assert value is not None, (alias, name)
    with pytest.raises(AttributeError, match=r"RoleController.*removed in 0.2.0.*trainer_feed"):
        _ = importlib.import_module("jaxrl.roles").RoleController
    with pytest.raises(AttributeError, match=r"has no attribute 'nothing'$"):
        _ = importlib.import_module("jaxrl.infra.config").nothing
    assert "## 0.2.0" in changelog
    pyproject = open(os.path.join(REPO, "pyproject.toml"), encoding="utf-8").read()
    assert 'version = "0.2.0"' in pyproject

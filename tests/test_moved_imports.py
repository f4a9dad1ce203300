"""Scripts written against 0.1.0 and 0.2.0 still import: every import line docs/API.md showed at
bfba6ed (the 0.1.0 API page) runs, each module that left the top of `jaxrl/` (0.2.0: the loop's
role folders; 0.3.0: `jaxrl.train`, `jaxrl.plan`, `jaxrl.job`) still imports by its old path, and
each name that moved answers from its new home with a DeprecationWarning naming it (CHANGELOG.md
lists the moves)."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import warnings

import pytest

import jaxrl
from jaxrl.infra.moved_modules import MOVED_MODULES

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The import lines of docs/API.md at bfba6ed (`git show bfba6ed:docs/API.md`), and the package
# where each moved name lives now (None: it never moved).
API_0_1_0 = {
    "from jaxrl.tasks.source import PromptItem, register_task": None,
    "from jaxrl.trainer import LossConfig, OptimizerConfig, Trainer": "jaxrl.train.",
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
    "from jaxrl.sft import rl_source_after_sft": "jaxrl.train.",
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
# The modules that moved whole in 0.3.0: old path -> new path.
MOVED_IN_0_3_0 = {
    "jaxrl.trainer": "jaxrl.train.trainer",
    "jaxrl.train_steps": "jaxrl.train.steps",
    "jaxrl.train_state": "jaxrl.train.state",
    "jaxrl.lora": "jaxrl.train.lora",
    "jaxrl.sft": "jaxrl.train.sft",
    "jaxrl.evaluation": "jaxrl.train.evaluation",
    "jaxrl.planning": "jaxrl.plan.programs",
    "jaxrl.plan_fixes": "jaxrl.plan.fixes",
    "jaxrl.hand_count": "jaxrl.plan.hand_count",
    "jaxrl.specs": "jaxrl.job.specs",
    "jaxrl.workdir": "jaxrl.job.workdir",
}
MOVED_MESSAGE = re.compile(
    r"^([\w.]+)\.(\w+) moved to ([\w.]+)\.\2 in (\S+); write `from \3 import \2`"
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
        match = MOVED_MESSAGE.match(message)
        assert match and match.group(2) == name, message
        new_module, since = match.group(3), match.group(4)
        assert getattr(importlib.import_module(new_module), name) is namespace[name], message
        assert new_module.startswith(home), (new_module, home)
        assert since == ("0.3.0" if home == "jaxrl.train." else "0.2.0"), message
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


def test_every_moved_module_has_an_alias_and_no_file():
    assert set(MOVED_MODULES) == set(ALIASES) | set(MOVED_IN_0_3_0)
    for old in MOVED_MODULES:
        assert not os.path.exists(os.path.join(REPO, *old.split(".")) + ".py"), old


@pytest.mark.parametrize("old", sorted(MOVED_IN_0_3_0))
def test_a_module_moved_in_0_3_0_answers_each_public_name_from_its_new_home(old):
    """`import jaxrl.<old>` still works; each public name of the new module answers from it (the
    same object) with a DeprecationWarning that names the new path, at the line that reads it."""
    new = importlib.import_module(MOVED_IN_0_3_0[old])
    alias = importlib.import_module(old)
    names = dir(alias)
    assert names and set(names) >= {n for n in vars(new) if n[0].isupper()}, (old, names)
    for name in names:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            value = getattr(alias, name)
        [warning] = caught
        assert warning.category is DeprecationWarning and warning.filename == __file__
        message = str(warning.message)
        match = MOVED_MESSAGE.match(message)
        assert match and match.group(1) == old, message
        assert value is getattr(importlib.import_module(match.group(3)), name), message
        if match.group(4) == "0.3.0":
            assert match.group(3) == new.__name__, message
            assert "(the old path goes in 0.4.0; CHANGELOG.md)" in message, message
    with pytest.raises(AttributeError, match=rf"module '{old}' has no attribute '_nothing'$"):
        _ = alias._nothing
    changelog = open(os.path.join(REPO, "CHANGELOG.md"), encoding="utf-8").read()
    assert f"| `{old}` | `{new.__name__}` |" in changelog, old


def test_the_old_import_forms_keep_working(monkeypatch):
    """`from jaxrl import workdir as run_dir`, `jaxrl.specs` read after `import jaxrl` alone, and
    `from jaxrl.trainer import Trainer`, each answering from the new home with a warning; names
    that moved out of `jaxrl.trainer` / `jaxrl.lora` in 0.2.0 still answer (until 0.3.0)."""
    from jaxrl.job import specs, workdir
    from jaxrl.train import lora, steps, trainer

    for old in ("jaxrl.workdir", "jaxrl.specs", "jaxrl.trainer", "jaxrl.lora"):
        monkeypatch.delitem(sys.modules, old, raising=False)
        monkeypatch.delattr(jaxrl, old.rpartition(".")[2], raising=False)
    with pytest.warns(DeprecationWarning, match=r"jaxrl\.specs\.TaskSpec moved to jaxrl\.job\."):
        assert jaxrl.specs.TaskSpec is specs.TaskSpec
    with pytest.warns(DeprecationWarning, match=r"write `from jaxrl\.job\.workdir import"):
        from jaxrl import workdir as run_dir

        assert run_dir.load_run_lora is workdir.load_run_lora
    with pytest.warns(DeprecationWarning, match=r"`from jaxrl\.train\.trainer import Trainer`"):
        from jaxrl.trainer import Trainer
    assert Trainer is trainer.Trainer
    with pytest.warns(
        DeprecationWarning, match=r"moved to jaxrl\.train\.steps\.sft_loss in 0\.2\.0"
    ):
        from jaxrl.trainer import sft_loss
    assert sft_loss is steps.sft_loss
    with pytest.warns(
        DeprecationWarning, match=r"lora\.save_run_lora moved to jaxrl\.job\.workdir"
    ):
        from jaxrl.lora import save_run_lora
    assert save_run_lora is workdir.save_run_lora
    with pytest.warns(DeprecationWarning, match=r"jaxrl\.lora\.LoraConfig moved to jaxrl\.train"):
        assert importlib.import_module("jaxrl.lora").LoraConfig is lora.LoraConfig
    with pytest.raises(AttributeError, match=r"module 'jaxrl' has no attribute 'nothing'$"):
        _ = jaxrl.nothing


def test_an_old_path_imports_in_a_fresh_process_and_warns_at_the_callers_line():
    """In a new interpreter (no module of the run imported yet): the finder is installed by
    `import jaxrl` alone, and `-W error::DeprecationWarning:__main__` turns an old path into an
    error at the line that uses it."""
    code = "from jaxrl.planning import compile_report\n"
    ok = subprocess.run(
        [sys.executable, "-W", "ignore::DeprecationWarning", "-c", code + "print('ok')"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert ok.returncode == 0 and ok.stdout.strip() == "ok", ok.stderr
    strict = subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning:__main__", "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert strict.returncode != 0
    assert (
        "jaxrl.planning.compile_report moved to jaxrl.plan.programs.compile_report" in strict.stderr
    )

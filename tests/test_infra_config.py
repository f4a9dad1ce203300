"""Gin launch helpers: errors name the binding, config.gin in the workdir, workdir reuse rules."""

import dataclasses
import logging
import sys

import gin
import pytest

from jaxrl.infra import config as config_lib
from jaxrl.infra import launcher, preemption, user_code
from jaxrl.infra.errors import DataError


@config_lib.register_config
@dataclasses.dataclass(frozen=True)
class ToyOptimConfig:
    learning_rate: float = 1e-3
    warmup_steps: int = 0
    betas: tuple[float, float] = (0.9, 0.999)

    def validate(self):
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate={self.learning_rate} must be > 0")


@config_lib.register_config
@dataclasses.dataclass(frozen=True)
class ToyRunConfig:
    optim: ToyOptimConfig = ToyOptimConfig()
    num_steps: int = 10
    schedule: str | None = None
    mesh_axes: tuple[str, ...] = ("fsdp", "tp")


CALLS = []


@gin.configurable
def toy_train(workdir: str, config: ToyRunConfig = gin.REQUIRED, seed: int = 0):
    CALLS.append((workdir, config, seed))
    return config


@gin.configurable
def toy_read(workdir: str, config: ToyRunConfig = gin.REQUIRED):
    raise DataError("train.jsonl:2: invalid JSON")


@gin.configurable
def toy_stopped(workdir: str, config: ToyRunConfig = gin.REQUIRED):
    raise preemption.StopRequested("stopped by SIGINT after step 2")


BASE = """
toy_train.config = @ToyRunConfig()
ToyRunConfig.optim = @ToyOptimConfig()
ToyRunConfig.num_steps = 5
ToyOptimConfig.learning_rate = 3e-4
"""


@pytest.fixture
def gin_file(tmp_path):
    path = tmp_path / "base.gin"
    path.write_text(BASE)
    yield str(path)
    gin.clear_config()
    CALLS.clear()


def _launch(gin_file, workdir, *extra):
    return launcher.launch(toy_train, ["--gin_file", gin_file, "--workdir", str(workdir), *extra])


def test_launch_builds_configs_and_writes_config_gin(gin_file, tmp_path):
    workdir = tmp_path / "run"
    config = _launch(gin_file, workdir, "--gin_param", "ToyOptimConfig.betas = [0.8, 0.9]")
    assert config == ToyRunConfig(optim=ToyOptimConfig(3e-4, 0, (0.8, 0.9)), num_steps=5)
    assert CALLS == [(str(workdir), config, 0)]
    written = (workdir / launcher.CONFIG_FILE).read_text()
    assert "ToyOptimConfig.learning_rate = 0.0003" in written and "betas = [0.8, 0.9]" in written


@pytest.mark.parametrize(
    "binding, message",
    [
        ("NoSuchConfig.x = 1", r"No configurable matching 'NoSuchConfig'"),
        (
            "toy_train.config = @ToyRunConfg()",
            r"'@ToyRunConfg\(\)'(.|\n)*Did you mean: ToyRunConfig",
        ),
        (
            "ToyOptimConfig.lerning_rate = 0.1",
            r"ToyOptimConfig' doesn't have a parameter named 'lerning_rate'(.|\n)*"
            r"Did you mean: learning_rate",
        ),
        ("ToyOptimConfig.learning_rate = 'fast'", r"ToyOptimConfig\.learning_rate: expected float"),
        ("ToyRunConfig.num_steps = 2.5", r"ToyRunConfig\.num_steps: expected int, got float 2\.5"),
        ("ToyOptimConfig.betas = (0.9,)", r"ToyOptimConfig\.betas: expected 2 items"),
        ("ToyRunConfig.schedule = 3", r"ToyRunConfig\.schedule: expected str \| None, got int 3"),
        ("toy_train.seed = 'x'", r"toy_train\.seed: expected int"),
        ("ToyOptimConfig.learning_rate = -1.0", r"ToyOptimConfig: learning_rate=-1\.0 must be > 0"),
        ("ToyRunConfig.num_steps = ", r"gin: "),  # a syntax error
        (  # a bare string: gin's own error was Python's, `malformed node or string`
            "ToyRunConfig.schedule = cosine",
            r"--gin_param 'ToyRunConfig.schedule = cosine': strings need quotes(.*); "
            r"write --gin_param=\"ToyRunConfig.schedule = 'cosine'\"$",
        ),
        (  # a keyword: `invalid syntax (<unknown>, line 1)`
            "ToyRunConfig.schedule=async",
            r"strings need quotes(.*)--gin_param=\"ToyRunConfig.schedule = 'async'\"$",
        ),
    ],
)
def test_bad_bindings_end_the_launch_naming_them(gin_file, tmp_path, binding, message):
    with pytest.raises(SystemExit, match=message):
        _launch(gin_file, tmp_path / "run", "--gin_param", binding)
    assert not CALLS, "the launch function must not run"
    assert not (tmp_path / "run").exists(), "nothing is written for a bad config"


def test_wrong_type_in_an_unused_config_is_caught(gin_file, tmp_path):
    unused = tmp_path / "unused.gin"
    unused.write_text("toy_train.config = @ToyRunConfig()\nToyOptimConfig.warmup_steps = 'ten'\n")
    with pytest.raises(SystemExit, match=r"ToyOptimConfig\.warmup_steps: expected int"):
        launcher.launch(toy_train, ["--gin_file", str(unused), "--workdir", str(tmp_path / "r")])


def test_unquoted_string_in_a_gin_file_names_its_line(gin_file, tmp_path):
    path = tmp_path / "bare.gin"
    path.write_text(f"include '{gin_file}'\nToyRunConfig.schedule = runs/x  # a path\n")
    with pytest.raises(SystemExit) as exit_info:
        launcher.launch(toy_train, ["--gin_file", str(path), "--workdir", str(tmp_path / "r")])
    assert str(exit_info.value) == (
        f"config error: {path}, line 2: `ToyRunConfig.schedule = runs/x  # a path`: strings need "
        "quotes in gin (its values are Python literals); write `ToyRunConfig.schedule = 'runs/x'`"
    )


def test_a_data_error_ends_the_launch_in_one_line(gin_file, tmp_path):
    """Regression: a malformed data file ended the launch with a traceback."""

    flags = ["--gin_file", gin_file, "--gin_param", "toy_read.config = @ToyRunConfig()"]
    with pytest.raises(SystemExit) as exit_info:
        launcher.launch(toy_read, [*flags, "--workdir", str(tmp_path / "run")])
    assert str(exit_info.value) == "data error: train.jsonl:2: invalid JSON"


def test_a_stopped_run_says_so_in_one_line(gin_file, tmp_path, capsys):
    """Regression: gin's `In call to configurable` line followed the message of a Ctrl-C."""
    flags = ["--gin_file", gin_file, "--gin_param", "toy_stopped.config = @ToyRunConfig()"]
    with pytest.raises(SystemExit) as exit_info:
        launcher.launch(toy_stopped, [*flags, "--workdir", str(tmp_path / "run")])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == "[jaxrl] stopped by SIGINT after step 2\n"


def test_keep_torch_out_drops_the_transformers_notice_it_causes(monkeypatch):
    logger = logging.getLogger("transformers")
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    monkeypatch.setattr(logger, "filters", [])
    monkeypatch.setattr(logger, "handlers", [handler])
    monkeypatch.delitem(sys.modules, "torch", raising=False)  # restored after the test
    monkeypatch.delenv("JAXRL_ALLOW_TORCH", raising=False)
    try:
        user_code.keep_torch_out()
        assert sys.modules["torch"] is None
    finally:
        del sys.modules["torch"]
    logger.warning("PyTorch was not found. Models won't be available and only tokenizers, ...")
    logger.warning("another warning")
    assert seen == ["another warning"]


def test_missing_required_binding(tmp_path):
    try:
        with pytest.raises(SystemExit, match=r"toy_train\.config is required"):
            launcher.launch(toy_train, ["--workdir", str(tmp_path / "run")])
        with pytest.raises(SystemExit, match=r"--gin_file nope\.gin: no such file"):
            launcher.launch(toy_train, ["--gin_file", "nope.gin", "--workdir", str(tmp_path)])
    finally:
        gin.clear_config()


def test_workdir_reuse_rules(gin_file, tmp_path, caplog):
    workdir = tmp_path / "run"
    _launch(gin_file, workdir)
    changed = ("--gin_param", "ToyRunConfig.num_steps = 7")
    # No checkpoint yet (the first launch failed early, say): a fixed config takes the workdir,
    # without a warning about an --overwrite that was not passed.
    _launch(gin_file, workdir, *changed)
    assert "--overwrite" not in caplog.text
    assert "num_steps = 7" in (workdir / launcher.CONFIG_FILE).read_text()
    _launch(gin_file, workdir, "--overwrite")
    (workdir / "checkpoints" / "1").mkdir(parents=True)
    _launch(gin_file, workdir)  # same config: resume allowed
    assert (workdir / "checkpoints").exists() and len(CALLS) == 4

    with pytest.raises(SystemExit, match=r"different config(.|\n)*num_steps = 7(.|\n)*--overwrite"):
        _launch(gin_file, workdir, *changed)
    assert len(CALLS) == 4
    _launch(gin_file, workdir, *changed, "--overwrite")
    assert not (workdir / "checkpoints").exists(), "--overwrite replaces the old run"
    assert "num_steps = 7" in (workdir / launcher.CONFIG_FILE).read_text()

    stranger = tmp_path / "not_a_run"
    stranger.mkdir()
    (stranger / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit, match="not a run directory"):
        _launch(gin_file, stranger, "--overwrite")
    assert (stranger / "notes.txt").exists()


def test_check_config_for_python_built_configs():
    config_lib.check_config(ToyRunConfig(optim=ToyOptimConfig(learning_rate=1)))
    with pytest.raises(config_lib.ConfigError, match=r"ToyOptimConfig\.warmup_steps: expected int"):
        config_lib.check_config(ToyRunConfig(optim=ToyOptimConfig(warmup_steps="3")))
    with pytest.raises(TypeError, match="frozen dataclass"):
        config_lib.register_config(dataclasses.dataclass(type("Loose", (), {})))

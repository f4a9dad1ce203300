"""Issue 25, what a newcomer meets before and around a run: gin scope typos, checks that run
before any work, --help, SFT on the jsonl task, Ctrl-C, and one metrics record per step after a
resume. Each test failed on commit 3876ef4."""

from __future__ import annotations

import json
import os
import re
import signal
import struct
from collections import Counter

import gin
import numpy as np
import pytest
from disk_cache import jax_cache_dir, jax_disk_cache  # noqa: F401  (fixtures)

from jaxrl.infra import faults
from jaxrl.infra.launcher import launch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ASYNC = os.path.join(REPO, "configs", "rl", "arith_tiny.gin")
SYNC = os.path.join(REPO, "configs", "rl", "arith_tiny_sync.gin")


def _launch(fn, config, workdir, *params):
    flags = ["--gin_file", config, "--workdir", str(workdir)]
    for p in params:
        flags += ["--gin_param", p]
    try:
        return launch(fn, flags)
    finally:
        gin.clear_config()


def _rl(config, workdir, *params):
    from launch.rl import rl_main

    return _launch(rl_main, config, workdir, *params)


@pytest.mark.parametrize(
    "binding, scope, suggestion",
    [
        ("sfts/OptimizerConfig.learning_rate = 1e-5", "sfts", "sft"),
        ("trainr/MeshConfig.axis_sizes = (4, 1)", "trainr", "trainer"),
    ],
)
def test_a_misspelled_gin_scope_ends_the_launch(tmp_path, binding, scope, suggestion):
    """Bug 3: a binding under a scope no reference uses was written to config.gin and ignored."""
    workdir = tmp_path / "run"
    with pytest.raises(SystemExit, match=rf"no reference uses the scope '{scope}'.*{suggestion}"):
        _rl(ASYNC, workdir, binding)
    assert not workdir.exists()  # refused before the workdir was claimed


def test_correct_scopes_and_macros_are_accepted():
    """The negative control of the scope check: the real scopes, nested ones and macros pass."""
    from jaxrl.infra.config import parse_gin, resolve_bindings
    from launch.rl import rl_main

    try:
        parse_gin(
            [ASYNC],
            [
                "sft/OptimizerConfig.learning_rate = 1e-5",
                "trainer/MeshConfig.axis_sizes = (4, 1)",
                "LR = 3e-5",
                "OptimizerConfig.learning_rate = %LR",
            ],
        )
        kwargs = resolve_bindings(rl_main)
    finally:
        gin.clear_config()
    assert kwargs["sft"].optimizer.learning_rate == 1e-5
    assert kwargs["mesh"].axis_sizes == (4, 1)
    assert kwargs["optimizer"].learning_rate == 3e-5


def test_bad_settings_are_refused_before_any_work(tmp_path):
    """Bug 5: overlapping meshes were found after the SFT stage had run; an unimportable reward
    and a bad dtype after the workdir was made. Now: before the SFT stage, before the workdir."""
    sft = ["SFTConfig.steps = 2", "SFTConfig.eval_size = 4"]
    workdir = tmp_path / "run"
    with pytest.raises(SystemExit, match=r"config error: .*cannot import 'nope' from 'nowhere'"):
        _rl(ASYNC, workdir, *sft, "TaskSpec.reward = 'nowhere:nope'")
    assert not workdir.exists()
    with pytest.raises(SystemExit, match=r"config error: .*dtype='bfloat17'; choose one of"):
        _rl(ASYNC, workdir, *sft, "PolicySpec.dtype = 'bfloat17'")
    assert not workdir.exists()
    with pytest.raises(ValueError, match=r"device 2 is in both the 'trainer' and the 'generator'"):
        _rl(ASYNC, workdir, *sft, "generator/MeshConfig.first_device = 2")
    assert not (workdir / "sft").exists()  # the SFT stage never started


@pytest.mark.parametrize("job", ["rl", "sft", "msd", "eval", "generate"])
def test_help_lists_the_configurable_classes_with_fields_and_defaults(job, capsys):
    """Acceptance 2: `python -m launch.<job> --help` shows what can be configured."""
    import importlib

    module = importlib.import_module(f"launch.{job}")
    with pytest.raises(SystemExit) as exit_info:
        if job in ("eval", "generate"):
            module.main(["--help"])
        else:
            launch(getattr(module, f"{job}_main"), ["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    expected = {
        "rl": ["RLConfig:", "  total_steps: int = 1000", "  rho: float | None = None", "SFTConfig:",
               "  optimizer: OptimizerConfig = OptimizerConfig(warmup_steps=20, "
               "schedule='linear')", "rl_main.policy: PolicySpec (required)",
               "example configs: configs/rl/arith_tiny.gin"],
        "sft": ["SFTConfig:", "  steps: int = 300", "TaskSpec:", "  operators: str = '+'"],
        "msd": ["msd_main.", "TeacherConfig:", "StudyConfig:"],
        "eval": ["--workdir", "the run's own value", "TaskSpec", "operators"],
        "generate": ["SamplingConfig", "top_p=1.0", "--max_new_tokens"],
    }[job]  # fmt: skip
    for line in expected:
        assert line in text, (line, text)


def test_a_launch_without_a_gin_file_points_to_configs(tmp_path):
    from launch.sft import sft_main

    with pytest.raises(SystemExit, match=r"No --gin_file was given.*configs/sft/arith_tiny.gin"):
        launch(sft_main, ["--workdir", str(tmp_path / "run")])


def test_jsonl_demonstrations_are_the_chat_prompt_then_the_worked_solution():
    """Bug 4: SFT on the jsonl task crashed (`JsonlMathSource` had no demonstrations). Checked
    against the tokenizer's own encoding of the rendered chat text, token by token."""
    from jaxrl.tasks.source import JsonlMathSource
    from jaxrl.tasks.tokenizer import build_arithmetic_tokenizer

    tok = build_arithmetic_tokenizer()
    path = os.path.join(REPO, "configs", "data", "gsm8k_tiny.jsonl")
    source = JsonlMathSource(path, None, tok, seed=3, instruction="", max_prompt_tokens=48)
    assert len(source.examples) == 8  # the long problem is left out up front
    tokens, mask = source.demonstrations(5, 3, tok, seq_len=64, pool=4)
    for row, index in enumerate([1, 2, 3]):  # items 5, 6, 7 of a pool of 4
        item = source.item(index)
        lines = [json.loads(x) for x in open(path)]
        solution = next(x["answer"] for x in lines if x["question"] in item.text)
        text = tok.apply_chat_template(
            [{"role": "user", "content": item.text.removeprefix("<bos>")},
             {"role": "assistant", "content": solution}], tokenize=False,
        )  # fmt: skip
        want = tok.encode(text, add_special_tokens=False)  # <bos> q solution <eos>
        np.testing.assert_array_equal(tokens[row, : len(want)], want)
        assert (tokens[row, len(want) :] == tok.pad_token_id).all()
        prompt_len = len(tok.encode(item.text, add_special_tokens=False))
        np.testing.assert_array_equal(
            mask[row], (np.arange(64) >= prompt_len) & (np.arange(64) < len(want))
        )
    too_long = r"gsm8k_tiny.jsonl:\d+: the demonstration .*SFTConfig.seq_len=8"
    with pytest.raises(ValueError, match=too_long):
        source.demonstrations(0, 1, tok, seq_len=8)


def _tensorboard_steps(workdir) -> Counter:
    """(tag, step) -> number of scalar points, over every event file of the run, read here
    independently of the library: TFRecord framing (uint64 length, its CRC, the data, its CRC;
    the CRCs are checked) around `Event` protobufs."""
    from tensorboardX.crc32c import crc32c
    from tensorboardX.proto.event_pb2 import Event

    def masked(data: bytes) -> int:
        crc = crc32c(data)
        return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF

    points = Counter()
    for path in sorted((workdir / "tensorboard").glob("events.out.tfevents.*")):
        data, pos = path.read_bytes(), 0
        while pos < len(data):
            header = data[pos : pos + 8]
            (length,) = struct.unpack("<Q", header)
            assert struct.unpack("<I", data[pos + 8 : pos + 12])[0] == masked(header)
            body = data[pos + 12 : pos + 12 + length]
            assert struct.unpack("<I", data[pos + 12 + length : pos + 16 + length])[0] == masked(
                body
            )
            event = Event.FromString(body)
            for value in event.summary.value:
                points[(value.tag, event.step)] += 1
            pos += 16 + length
    return points


RESUME = [
    "rl_main.sft = None",
    "RLConfig.total_steps = 5",
    "RLConfig.num_prompts = 2",
    "RLConfig.samples_per_prompt = 2",
    "RLConfig.save_every_steps = 2",
    "RLConfig.eval_size = 0",  # no evaluation: nothing more to compile
]


def test_ctrl_c_saves_and_a_resumed_run_keeps_one_record_per_step(
    tmp_path,
    monkeypatch,
    capsys,
    jax_disk_cache,  # noqa: F811
):
    """Bug 8 / acceptance 3. A run crashes after step 3 (step 2 saved; steps 1-3 logged), is
    resumed and interrupted by SIGINT after step 4 (it saves step 4 and exits 0, no traceback),
    then resumed to the end: metrics.jsonl has exactly one line per step and TensorBoard one
    point per (tag, step), across its event files."""
    workdir = tmp_path / "run"
    real_after_step = faults.after_step

    def crash_after_3(step, wait_for_saves=None):
        real_after_step(step, wait_for_saves)
        if step == 3:
            wait_for_saves()
            raise RuntimeError("crash after step 3")  # a kill, in-process: nothing more runs

    monkeypatch.setattr(faults, "after_step", crash_after_3)
    with pytest.raises(RuntimeError, match="crash after step 3"):
        _rl(SYNC, workdir, *RESUME)
    monkeypatch.setattr(faults, "after_step", real_after_step)
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["2"]

    monkeypatch.setenv(faults.ENV_VAR, "sigint_at_step=4")
    handler_before = signal.getsignal(signal.SIGINT)
    with pytest.raises(SystemExit) as stopped:
        _rl(SYNC, workdir, *RESUME)
    assert stopped.value.code == 0
    out = capsys.readouterr().out
    assert "resuming" in out and "from step 2" in out
    assert "SIGINT received: finishing this step" in out
    assert "stopped by SIGINT after step 4" in out
    assert signal.getsignal(signal.SIGINT) is handler_before  # the loop's handler is gone
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["2", "4"]

    monkeypatch.delenv(faults.ENV_VAR)
    _rl(SYNC, workdir, *RESUME)
    assert "from step 4" in capsys.readouterr().out
    lines = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 1, 2, 3, 4, 5]
    points = _tensorboard_steps(workdir)
    assert {step for _, step in points} == {0, 1, 2, 3, 4, 5}
    assert set(points.values()) == {1}, [k for k, v in points.items() if v > 1]
    assert points[("loss", 3)] == 1 and points[("learning_rate", 5)] == 1
    assert len(list((workdir / "tensorboard").glob("events.out.tfevents.*"))) == 3


def test_a_malformed_jsonl_ends_the_launch_in_one_line(tmp_path):
    """Regression: a bad line in the task's data file ended the launch with a full traceback."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "1+1", "answer": "#### 2"}\n{"question": "2+2"\n')
    gsm8k = os.path.join(REPO, "configs", "rl", "gsm8k_tiny.gin")
    with pytest.raises(SystemExit) as exit_info:
        _rl(gsm8k, tmp_path / "run", f"TaskSpec.train_path = '{bad}'")
    assert str(exit_info.value) == (
        f"data error: {bad}:2: invalid JSON (Expecting ',' delimiter at column 1)"
    )


def test_too_few_devices_on_a_cpu_names_the_xla_flag():
    """The 8-device configs on a CPU without XLA_FLAGS said to start 8 processes, never how to
    simulate the devices in one."""
    from jaxrl.infra.distributed import ProcessLayoutError, check_mesh_fits
    from jaxrl.infra.mesh import MeshConfig

    needs_16 = MeshConfig(("fsdp", "tp"), (4, 4), first_device=0, num_devices=16)
    with pytest.raises(
        ProcessLayoutError,
        match=r"simulate 16 devices: set XLA_FLAGS=--xla_force_host_platform_device_count=16",
    ):
        check_mesh_fits({"trainer": needs_16})


def test_progress_lines_show_seconds_per_step_and_an_eta(tmp_path, capsys):
    from jaxrl.infra.run_io import RunIO

    io = RunIO(str(tmp_path), total_steps=4, save_every_steps=4, keep_last_n=1, desc="sft",
               log_every_steps=2)  # fmt: skip
    try:
        io.start(0)
        for step in (1, 2):
            io.log(step, {"loss": 1.0}, {"loss": "1.000"})
    finally:
        io.close()
    line = capsys.readouterr().out.strip().splitlines()[-1]
    pace = r"\(\d+s, [\d.e-]+ s/step, ETA 0m\d\ds\)"
    assert re.fullmatch(rf"\[sft\] step 2/4 loss=1\.000 {pace}", line), line

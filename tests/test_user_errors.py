"""Issue 58: what a user did wrong ends a launch in one line that names the fix, not a traceback:
a process layout that does not fit, a reward that raises (its own line of code in the message,
its traceback with JAXRL_TRACEBACK=1), a finished run relaunched with a longer schedule, a number
as a math_jsonl answer, a GGUF file as `init_from`, where `launch.fetch` puts models, and a
generator knob removed in 0.3.0 (issue 56)."""

from __future__ import annotations

import os

import gin
import numpy as np
import pytest

from jaxrl.infra.config import ConfigError
from jaxrl.infra.launcher import launch, prepare_workdir
from jaxrl.tasks.math_jsonl import JsonlFormatError, iter_math_jsonl
from jaxrl.tasks.rewards import RewardError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ASYNC = os.path.join(REPO, "configs", "rl", "arith_tiny.gin")


def _rl(workdir, *params):
    from launch.rl import rl_main

    flags = ["--gin_file", ASYNC, "--workdir", str(workdir)]
    for p in params:
        flags += ["--gin_param", p]
    try:
        return launch(rl_main, flags)
    finally:
        gin.clear_config()


def _one_line(exit_info) -> str:
    message = str(exit_info.value)
    assert exit_info.value.code not in (0, None) and "\n" not in message, message
    assert "Traceback" not in message
    return message


def test_a_process_layout_that_does_not_fit_ends_the_launch_in_one_line(tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        _rl(tmp_path / "run", "trainer/MeshConfig.axis_sizes = (4, 4)",
            "trainer/MeshConfig.num_devices = 16")  # fmt: skip
    message = _one_line(exit_info)
    assert message.startswith("process layout error: the trainer mesh {'fsdp': 4, 'tp': 4} uses ")
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=16" in message


@pytest.mark.parametrize(
    "binding, fix",
    [
        ("rl_main.generator_dtype = 'bfloat16'", "GeneratorConfig.dtype = 'bfloat16'"),
        ("rl_main.engine_slots = 8", "GeneratorConfig.slots = 8"),
        ("rl_main.generator = 'static'", "GeneratorConfig.kind = 'static'"),
    ],
)
def test_a_removed_generator_knob_names_the_line_to_write(tmp_path, binding, fix):
    """rl_main's flat generator knobs (removed in 0.3.0), as --gin_param or in a gin file: refused
    when parsed, before the workdir is claimed, naming the GeneratorConfig line instead."""
    knob = binding.split(" =")[0]
    with pytest.raises(SystemExit) as exit_info:
        _rl(tmp_path / "run", binding)
    refused = f"{knob} was removed in 0.3.0: write `{fix}` instead"
    assert f"{refused} (--gin_param: `{binding}`" in _one_line(exit_info)
    from launch.rl import rl_main

    config = tmp_path / "old.gin"
    config.write_text(f"include '{ASYNC}'\n{binding}  # an older config\n")
    with pytest.raises(SystemExit) as exit_info:
        launch(rl_main, ["--gin_file", str(config), "--workdir", str(tmp_path / "run")])
    gin.clear_config()
    assert f"{refused} ({config}, line 2: " in _one_line(exit_info)
    assert not (tmp_path / "run").exists()


def bad_score(prompts, completions, references):
    scores = []
    for text in completions:
        scores.append(float(text[40]))  # IndexError: the completions are short
    return scores


def test_a_raising_reward_names_its_own_line_and_ends_the_launch_in_one_line(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from jaxrl.loop.reward import RewardExecutor
    from jaxrl.tasks.source import PromptItem
    from jaxrl.tasks.tokenizer import build_arithmetic_tokenizer

    tokenizer = build_arithmetic_tokenizer()
    batch = SimpleNamespace(
        items=[PromptItem("1+2=", "3")] * 2,
        completion_ids=[np.array(tokenizer.encode("3"))] * 2,
        batch_index=0,
    )
    with pytest.raises(RewardError) as raised:
        RewardExecutor(bad_score, tokenizer).score(batch)
    error = raised.value
    line = bad_score.__code__.co_firstlineno + 3
    assert str(error).startswith("reward 'bad_score' raised IndexError: string index out of range")
    assert f"(batch 0) at {__file__}:{line} in bad_score: scores.append(float(text[40]))" in str(
        error
    )
    assert isinstance(error.__cause__, IndexError)

    # Through a launch: one line, with where the run raised it and how to see the traceback.
    @gin.configurable
    def failing_reward_main(workdir):
        error.add_note("[jaxrl] raised in the generator thread at batch 0 (policy version 0)")
        raise error

    try:
        with pytest.raises(SystemExit) as exit_info:
            launch(failing_reward_main, ["--workdir", str(tmp_path / "run")])
        message = _one_line(exit_info)
        assert message.startswith("reward error: reward 'bad_score' raised IndexError")
        assert "in bad_score: scores.append(float(text[40]))" in message
        assert message.endswith(
            "; raised in the generator thread at batch 0 (policy version 0) "
            "(JAXRL_TRACEBACK=1 prints the full traceback)"
        )
        monkeypatch.setenv("JAXRL_TRACEBACK", "1")
        with pytest.raises(RewardError):
            launch(failing_reward_main, ["--workdir", str(tmp_path / "run")])
    finally:
        gin.clear_config()


def test_a_finished_run_relaunched_with_another_config_names_init_from(tmp_path):
    """A longer total_steps is another config; the refusal also says how to start a new run
    from this one's weights (launch.rl's `PolicySpec.init_from` takes a run's workdir)."""
    run = tmp_path / "run"
    (run / "checkpoints" / "2").mkdir(parents=True)
    (run / "checkpoints" / "2" / "state").write_text("")
    old = "rl_main.policy = @PolicySpec()\nRLConfig.total_steps = 2\n"
    (run / "config.gin").write_text(old)
    new = old.replace("total_steps = 2", "total_steps = 4")
    with pytest.raises(ConfigError) as refused:
        prepare_workdir(run, new, overwrite=False)
    message = str(refused.value)
    assert "-RLConfig.total_steps = 2\n+RLConfig.total_steps = 4" in message
    assert "Pass --overwrite" in message
    assert f"--gin_param=\"PolicySpec.init_from = '{run}'\"" in message
    # A LoRA run's checkpoints hold adapters only: no such line.
    (run / "config.gin").write_text(old + "rl_main.lora = @LoraConfig()\n")
    with pytest.raises(ConfigError) as refused:
        prepare_workdir(run, new, overwrite=False)
    assert "init_from" not in str(refused.value)


def test_a_number_as_a_math_jsonl_answer_shows_the_expected_form(tmp_path):
    path = tmp_path / "numbers.jsonl"
    path.write_text('{"question": "2 + 3?", "answer": 5}\n')
    with pytest.raises(JsonlFormatError) as refused:
        list(iter_math_jsonl(path))
    assert str(refused.value) == (
        f'{path}:1: field \'answer\' must be a string, got int (write "answer": "... #### 5")'
    )


def test_a_gguf_file_as_init_from_names_the_import_command(tmp_path):
    gguf = tmp_path / "model.Q4_1.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(SystemExit) as exit_info:
        _rl(tmp_path / "run", f"PolicySpec.init_from = '{gguf}'")
    message = _one_line(exit_info)
    assert message.startswith("config error: ") and "is a file, not a directory" in message
    assert f"python -m launch.import_gguf --gguf={gguf} --out=DIR, then init_from=DIR" in message


def test_the_model_cache_directory_is_documented(capsys):
    from launch import fetch

    with pytest.raises(SystemExit):
        fetch.main(["--help"])
    assert "$JAXRL_CACHE/NAME" in " ".join(capsys.readouterr().out.split())
    assert "`$JAXRL_CACHE/<name>`" in open(os.path.join(REPO, "README.md")).read()


def test_a_reward_that_raises_in_evaluation_is_named_in_one_line_too():
    """Regression: the held-out evaluation scored with the user's reward outside the reward
    executor, so a reward raising there came as a raw traceback (`launch.eval`, and a run's
    evaluation at step 0)."""
    from types import SimpleNamespace

    from jaxrl.generation.sampling import SamplingConfig
    from jaxrl.tasks.source import PromptItem
    from jaxrl.tasks.tokenizer import build_arithmetic_tokenizer
    from jaxrl.train.evaluation import _score

    tokenizer = build_arithmetic_tokenizer()
    tokens = np.array([tokenizer.encode("3")[-1:]] * 2)

    class Sampler:
        def generate(self, params, rows, sampling, key):
            return SimpleNamespace(tokens_bn=tokens, lengths_b=np.array([1, 1]))

    items = [PromptItem("1+2=", "3")] * 2
    with pytest.raises(RewardError) as raised:
        _score(Sampler(), None, tokenizer, bad_score, items, [[1], [1]],
               SamplingConfig(max_new_tokens=1), __import__("jax").random.key(0), 2)  # fmt: skip
    line = bad_score.__code__.co_firstlineno + 3
    assert str(raised.value).startswith("reward 'bad_score' raised IndexError")
    assert f"(evaluation) at {__file__}:{line} in bad_score" in str(raised.value)
    assert raised.value.from_user_code


def test_the_plain_flag_launchers_end_a_users_error_in_one_line(tmp_path, monkeypatch, capsys):
    """Regression: `launch.generate` / `launch.eval` with a --hf_dir that is not there, or an
    empty prompt file, ended in a traceback; they now end as the gin launchers do."""
    from jaxrl.infra.launcher import run_cli
    from launch import generate

    missing = tmp_path / "my_model_rl"
    argv = [f"--hf_dir={missing}", "--prompts=-", "--output=-"]
    monkeypatch.setattr("sys.stdin", __import__("io").StringIO("12+7=\n"))
    with pytest.raises(SystemExit) as exit_info:
        run_cli(lambda: generate.main(argv))
    assert _one_line(exit_info) == (
        f"error: {missing} does not exist (expected a save_pretrained directory: config.json, "
        "*.safetensors, the tokenizer files)"
    )
    empty = tmp_path / "prompts.txt"
    empty.write_text("")
    with pytest.raises(SystemExit) as exit_info:
        run_cli(lambda: generate.main([f"--hf_dir={missing}", f"--prompts={empty}", "--output=-"]))
    assert _one_line(exit_info) == f"data error: {empty}: no prompts"
    monkeypatch.setenv("JAXRL_TRACEBACK", "1")
    monkeypatch.setattr("sys.stdin", __import__("io").StringIO("12+7=\n"))
    with pytest.raises(FileNotFoundError):
        run_cli(lambda: generate.main(argv))
    with pytest.raises(SystemExit) as exit_info:
        run_cli(lambda: 0)
    assert exit_info.value.code == 0

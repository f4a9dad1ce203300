"""Issue 57, a new user's own model through the README (SmolLM2-135M-Instruct as "my model"):
paths typed with `~`, the chat template of an instruct model in `launch.generate`, the completion
budget of `launch.eval --hf_dir` and the share of completions it cuts, a config that needs a
pretrained model, and which limit an episode's prompt runs into. Tiny models and stubs only;
`tests/test_readme_commands.py` runs the README's own commands (a run read from another
directory, a `HOME` of its own) and `tests/test_loop_metrics.py` RL's `completion/truncated`."""

from __future__ import annotations

import json
import os
import shutil
import types

import gin
import numpy as np
import pytest
from disk_cache import jax_cache_dir, jax_disk_cache  # noqa: F401  (fixtures)
from flax import nnx

from jaxrl.infra.launcher import launch
from jaxrl.models import hf
from jaxrl.models.config import ModelConfig
from jaxrl.models.transformer import Transformer
from jaxrl.tasks.tokenizer import build_arithmetic_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# An instruct-style template the raw text cannot be mistaken for: the reply starts after "==".
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}=={% endif %}"
)


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    """A tiny random Llama (context 128) whose tokenizer has `TEMPLATE` as its chat template."""
    tokenizer = build_arithmetic_tokenizer()
    tokenizer.chat_template = TEMPLATE
    config = ModelConfig(
        "llama", 56, 32, 64, 2, 4, 2, 8,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, max_position_embeddings=128,
    )  # fmt: skip
    path = str(tmp_path_factory.mktemp("chat"))
    hf.save_hf(Transformer(config, rngs=nnx.Rngs(0), init_std=0.3), path, tokenizer=tokenizer)
    return path


# Point 2: `~` in paths -------------------------------------------------------------------------


def test_a_tilde_path_is_expanded_and_a_missing_one_does_not_exist(chat_dir, tmp_path, monkeypatch):
    """`--hf_dir=~/...` (bash leaves the `~` after `=`) failed with "has no config.json; is it a
    save_pretrained directory?" for a directory that did not exist; `PolicySpec.init_from =
    '~/...'` failed the same way. Both are expanded now, a run's config.gin holds the absolute
    path, and a missing directory "does not exist"."""
    from jaxrl.infra.config import parse_gin, resolve_bindings
    from jaxrl.job.specs import PolicySpec, TaskSpec
    from launch.rl import rl_main

    monkeypatch.setenv("HOME", str(tmp_path))
    shutil.copytree(chat_dir, tmp_path / "models" / "mine")
    assert hf.load_config("~/models/mine").max_position_embeddings == 128
    with pytest.raises(FileNotFoundError, match=rf"^{tmp_path}/models/gone does not exist"):
        hf.load_config("~/models/gone")
    assert PolicySpec(init_from="~/models/mine").init_from == str(tmp_path / "models" / "mine")
    assert TaskSpec(eval_path="~/e.jsonl").eval_path == str(tmp_path / "e.jsonl")
    with pytest.raises(ValueError, match=r"init_from='.*/models/gone' does not exist"):
        PolicySpec(init_from="~/models/gone").validate()
    with pytest.raises(ValueError, match=r"train_path='nope.jsonl' does not exist"):
        TaskSpec(name="math_jsonl", train_path="nope.jsonl").validate()

    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.jsonl").write_text('{"question": "1+1?", "answer": "#### 2"}\n')
    bindings = [
        "rl_main.policy = @PolicySpec()",
        "rl_main.task = @TaskSpec()",
        "rl_main.rl = @RLConfig()",
        "rl_main.optimizer = @OptimizerConfig()",
        "PolicySpec.init_from = '~/models/mine'",
        "TaskSpec.name = 'math_jsonl'",
        "TaskSpec.train_path = 'p.jsonl'",
    ]
    try:
        parse_gin([], bindings)
        kwargs = resolve_bindings(rl_main)
        stored = " ".join(gin.config_str().replace("\\\n", " ").split())  # long lines joined
    finally:
        gin.clear_config()
    assert kwargs["policy"].init_from == str(tmp_path / "models" / "mine")
    import launch.msd_configs  # noqa: F401  (registers the MSD configs: data paths too)

    try:
        parse_gin([], ["JsonlDataConfig.data_dir = '~/memes'"])
        assert gin.get_bindings("JsonlDataConfig")["data_dir"] == str(tmp_path / "memes")
    finally:
        gin.clear_config()
    assert f"PolicySpec.init_from = '{tmp_path}/models/mine'" in stored
    assert f"TaskSpec.train_path = '{tmp_path}/p.jsonl'" in stored


def test_a_run_is_read_with_only_its_held_out_file(tmp_path):
    """`launch.eval --workdir` needed the run's training file and its init_from directory, which
    it never reads (the weights are the run's checkpoints). Only the held-out file is needed
    now; one that is gone is named, with the flag that replaces it."""
    from jaxrl.infra.config import ConfigError
    from launch.eval import run_settings

    held_out = tmp_path / "eval.jsonl"
    held_out.write_text('{"question": "1+1?", "answer": "#### 2"}\n')
    (tmp_path / "run").mkdir()
    config = [
        "rl_main.policy = @PolicySpec()",
        "rl_main.task = @TaskSpec()",
        "rl_main.rl = @RLConfig()",
        "rl_main.optimizer = @OptimizerConfig()",
        f"PolicySpec.init_from = '{tmp_path / 'moved_model'}'",
        "PolicySpec.requires_init_from = 'a model'",
        "TaskSpec.name = 'math_jsonl'",
        f"TaskSpec.train_path = '{tmp_path / 'gone.jsonl'}'",
        f"TaskSpec.eval_path = '{held_out}'",
        "RLConfig.max_new_tokens = 64",
    ]
    (tmp_path / "run" / "config.gin").write_text("\n".join(config) + "\n")
    task, settings = run_settings(str(tmp_path / "run"))
    assert task.eval_path == task.train_path == str(held_out)
    assert settings["max_new_tokens"] == 64
    held_out.unlink()
    with pytest.raises(ConfigError, match=r"eval_path='.*eval.jsonl' does not exist.*--eval_path"):
        run_settings(str(tmp_path / "run"))
    with pytest.raises(ConfigError, match=r"--workdir .*/nowhere does not exist"):
        run_settings(str(tmp_path / "nowhere"))


def test_a_run_that_stored_its_paths_as_typed_resumes(tmp_path, monkeypatch):
    """A run launched before path fields were stored absolute has 'p.jsonl' in its config.gin;
    relaunched from the same directory (the same file, now written absolute) it resumes, and
    its config.gin is rewritten; another file is another config."""
    import launch.configs  # noqa: F401  (registers TaskSpec)
    from jaxrl.infra.config import ConfigError
    from jaxrl.infra.launcher import prepare_workdir

    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    (run / "checkpoints" / "2").mkdir(parents=True)
    (run / "config.gin").write_text(
        "TaskSpec.name = 'math_jsonl'\nTaskSpec.train_path = 'p.jsonl'\n"
    )
    new = f"TaskSpec.name = 'math_jsonl'\nTaskSpec.train_path = \\\n    '{tmp_path / 'p.jsonl'}'\n"
    assert prepare_workdir(run, new, overwrite=False) is True
    assert (run / "config.gin").read_text() == new
    with pytest.raises(ConfigError, match="holds a run with a different config"):
        prepare_workdir(run, new.replace("p.jsonl", "q.jsonl"), overwrite=False)


# Point 3: the chat template in launch.generate --------------------------------------------------


def _prompt_ids(monkeypatch, capsys, chat_dir, tmp_path, *flags) -> tuple[list[int], str]:
    """The prompt ids `launch.generate` encodes for "1+1=" with `flags`, and its stderr."""
    from launch import generate

    seen = []
    real = generate.encode
    monkeypatch.setattr(generate, "encode", lambda *a: seen.append(real(*a)) or seen[-1])
    (tmp_path / "p.txt").write_text("1+1=\n")
    argv = [f"--hf_dir={chat_dir}", f"--prompts={tmp_path / 'p.txt'}", "--output=-"]
    assert generate.main([*argv, "--max_new_tokens=2", "--greedy", *flags]) == 0
    return seen[0], capsys.readouterr().err


def test_generate_uses_an_instruct_models_chat_template_by_default(
    chat_dir,
    tmp_path,
    monkeypatch,
    capsys,
    jax_disk_cache,  # noqa: F811
):
    """`launch.generate --hf_dir` sent raw text to an instruct model unless --chat_template was
    given (SmolLM2 answered "" with its end of turn at once). A tokenizer with a chat template
    now gets it by default; --raw / --no_chat_template send raw text."""
    tokenizer = hf.load_tokenizer(chat_dir)
    raw = tokenizer.encode("1+1=")
    templated = tokenizer.encode("<bos>1+1===", add_special_tokens=False)
    assert raw != templated
    ids, err = _prompt_ids(monkeypatch, capsys, chat_dir, tmp_path)
    assert ids == templated
    assert "prompts through the chat template (--raw for raw text)" in err
    assert _prompt_ids(monkeypatch, capsys, chat_dir, tmp_path, "--chat_template")[0] == templated
    for flag in ("--raw", "--no_chat_template"):
        assert _prompt_ids(monkeypatch, capsys, chat_dir, tmp_path, flag)[0] == raw, flag


# Point 4: launch.eval's completion budget and truncated completions -----------------------------


def test_eval_of_a_chat_task_on_a_hf_dir_gets_room_to_answer(chat_dir, tmp_path, monkeypatch):
    """`launch.eval --hf_dir --task=math_jsonl` gave every problem 6 new tokens (the arithmetic
    default) and scored 0.0. A chat task now gets `CHAT_MAX_NEW_TOKENS`, within the room the
    longest prompt leaves in the model's context (here 128 tokens)."""
    from launch import eval as eval_launch

    seen = {}
    monkeypatch.setattr(
        eval_launch,
        "evaluate",
        lambda *a, **settings: seen.update(ids=a[5], **settings) or {"eval/accuracy": 0.0},
    )
    problems = tmp_path / "eval.jsonl"
    problems.write_text(
        '{"question": "tom has 3 apples and buys 4.", "answer": "#### 7"}\n'
        '{"question": "5+6?", "answer": "#### 11"}\n'
    )
    argv = [f"--hf_dir={chat_dir}", "--task=math_jsonl", f"--eval_path={problems}"]
    assert eval_launch.main([*argv, "--instruction=", "--samples=0"]) == 0
    longest = max(map(len, seen["ids"]))
    assert seen["max_new_tokens"] == min(eval_launch.CHAT_MAX_NEW_TOKENS, 128 - longest) > 6
    assert eval_launch.main([*argv, "--instruction=", "--max_new_tokens=9"]) == 0
    assert seen["max_new_tokens"] == 9


class _FixedSampler:
    """Completions of 4 tokens each, the last a stop token (eos 2) on every 4th row only."""

    eos_ids = (2,)

    def generate(self, params, prompt_ids, sampling, key, **kwargs):
        rows = len(prompt_ids)
        tokens = np.full((rows, sampling.max_new_tokens), 5, np.int32)
        tokens[::4, 3] = 2
        return types.SimpleNamespace(
            tokens_bn=tokens,
            lengths_b=np.full(rows, 4),
            logprobs_bn=np.zeros(tokens.shape, np.float32),
        )


def test_eval_reports_the_share_of_cut_completions_and_warns_when_most_are(
    chat_dir, monkeypatch, capsys
):
    """A budget that cuts the answers scored 0.0 without a word. evaluate() reports
    eval/truncated (greedy completions no stop token ended), and launch.eval warns on standard
    error when it is above one half, naming the flag."""
    from jaxrl.tasks.source import PromptItem
    from jaxrl.train.evaluation import evaluate
    from launch import eval as eval_launch

    items = [PromptItem(f"{i}+1=", str(i + 1)) for i in range(8)]
    metrics = evaluate(
        _FixedSampler(), None, build_arithmetic_tokenizer(), "arithmetic_exact", items,
        [[1, 5]] * 8, max_new_tokens=4, samples=2,
    )  # fmt: skip
    assert metrics["eval/truncated"] == 0.75  # rows 0 and 4 stopped

    monkeypatch.setattr(
        eval_launch, "evaluate", lambda *a, **k: {"eval/accuracy": 0.0, "eval/truncated": 0.75}
    )
    assert eval_launch.main([f"--hf_dir={chat_dir}", "--eval_size=4"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out.splitlines()[-1])["eval/truncated"] == 0.75
    assert (
        "warning: 75% of the greedy completions reached max_new_tokens=6 (the task's default) "
        "without a stop token"
        in captured.err
        and "larger --max_new_tokens" in captured.err
    )
    monkeypatch.setattr(
        eval_launch, "evaluate", lambda *a, **k: {"eval/accuracy": 0.0, "eval/truncated": 0.5}
    )
    assert eval_launch.main([f"--hf_dir={chat_dir}", "--eval_size=4"]) == 0
    assert "warning" not in capsys.readouterr().err


# Point 6: a config for a pretrained model, and the limit an episode's prompt runs into ----------


def test_a_config_for_a_pretrained_model_refuses_to_start_without_one(tmp_path):
    """configs/rl/calc_smollm2.gin without `PolicySpec.init_from` started "from random weights"
    (the arith_tiny preset) and died at its first episode. It is refused before any work now,
    with the line to write."""
    from launch.rl import rl_main

    workdir = tmp_path / "run"
    config = os.path.join(REPO, "configs", "rl", "calc_smollm2.gin")
    try:
        with pytest.raises(SystemExit) as refused:
            launch(rl_main, ["--gin_file", config, "--workdir", str(workdir)])
    finally:
        gin.clear_config()
    message = str(refused.value)
    assert message.startswith("config error: PolicySpec: init_from is not set, and this config ")
    assert "SmolLM2-135M-Instruct" in message and "launch.fetch smollm2-135m-instruct" in message
    assert "--gin_param=\"PolicySpec.init_from = 'DIR'\"" in message
    assert not workdir.exists()


def test_the_episode_budget_error_names_the_limit_that_binds():
    """ "a prompt of 266 tokens leaves no room in max_total_tokens=288 (engine context 64); raise
    EpisodeBudget.max_total_tokens": raising it changed nothing, the engine's context was the
    limit. The message names the limit that binds and the setting that raises it."""
    from jaxrl.generation.episodes import binding_limit

    def engine(capacity, grows, positions):
        config = types.SimpleNamespace(max_position_embeddings=positions)
        return types.SimpleNamespace(max_capacity=capacity, grows=grows, model_config=config)

    model = binding_limit(288, engine(64, True, 64))
    assert "the model's context, max_position_embeddings=64" in model
    assert "PolicySpec.init_from" in model and "raise EpisodeBudget" not in model
    generator = binding_limit(288, engine(128, False, 8192))
    assert "GeneratorConfig.max_len (the model's max_position_embeddings is 8192)" in generator
    assert generator.endswith("raise GeneratorConfig.max_len")
    budget = binding_limit(100, engine(8192, True, 8192))
    assert budget.endswith("raise EpisodeBudget.max_total_tokens")

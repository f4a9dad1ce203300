"""Every command of the README's Jobs section runs as written (issue 25, acceptance 1), in order,
in a scratch directory that links the repository's configs/; then what a newcomer checks next,
on the runs those commands made (bugs 1, 2, 4, 6 and 7 of issue 25, and acceptance 4). The
README's "Your model, your data" recipe runs as written too, on a tiny random HF model
and a 20-line jsonl written here.

The commands run in this process (`launch(...)` / `main(argv)`, as `python -m` would call them),
so the launches share compiled programs (`disk_cache`). Arguments are appended to some commands
to shrink them to a few steps (later flags and gin bindings win); the README text itself is
what runs.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import shlex
import subprocess
import sys

import gin
import pytest
from disk_cache import jax_cache_dir, jax_disk_cache  # noqa: F401  (fixtures)

from jaxrl.infra.launcher import launch, parse_flags
from jaxrl.infra.metrics import read_metrics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_commands(section: str = "Jobs") -> list[str]:
    """The shell lines of the first ```bash block of the README's "## <section>", with
    continuation lines joined and comments left out."""
    text = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    jobs = text[text.index(f"\n## {section}\n") :]
    start = jobs.index("```bash\n") + len("```bash\n")
    block = jobs[start : jobs.index("```\n", start)].replace("\\\n", " ")
    return [" ".join(x.split()) for x in block.splitlines() if x.strip() and x[0] != "#"]


def _gin(*bindings: str) -> list[str]:
    return [f"--gin_param={b}" for b in bindings]


TINY_SFT = _gin(
    "SFTConfig.steps = 2",
    "SFTConfig.batch_size = 8",
    "SFTConfig.eval_every_steps = 2",
    "SFTConfig.save_every_steps = 2",
    "SFTConfig.eval_size = 8",
    "SFTConfig.eval_samples = 2",
)
TINY_RL = _gin(
    "RLConfig.total_steps = 2",
    "RLConfig.num_prompts = 2",
    "RLConfig.samples_per_prompt = 2",
    "RLConfig.eval_every_steps = 2",
    "RLConfig.save_every_steps = 2",
    "RLConfig.eval_size = 8",
    "RLConfig.eval_samples = 2",
)
# What each command gets appended, by the first key it contains.
EXTRA = {
    # Another task seed (held-out split) and reward than the defaults, so that an evaluation that
    # ignores the run's task shows it (bug 6); an untrained policy varies on this reward.
    "launch.rl --gin_file=configs/rl/arith_tiny_sync.gin --workdir=runs/arith_sync": TINY_SFT
    + TINY_RL
    + _gin("TaskSpec.seed = 5", "TaskSpec.reward = 'rewards_for_tests:even_length'"),
    "--workdir=runs/x": TINY_RL + _gin("rl_main.sft = None", "RLConfig.eval_size = 0"),
    "launch.sft": TINY_SFT,
    "gsm8k_tiny.gin": TINY_SFT
    + TINY_RL
    + _gin(
        "SFTConfig.eval_size = 2",
        "SFTConfig.eval_samples = 0",
        "RLConfig.eval_size = 0",
        "RLConfig.max_new_tokens = 8",
    ),
    "launch.eval --hf_dir": ["--eval_size=8", "--samples=2"],
}
# Commands that another test already runs as the real command: here they are only parsed and
# bound (flags, gin file, every config built and validated), which is what can drift from the
# README. The MSD study is run by tests/test_msd_pipeline.py (`python -m launch.msd` on the same
# config, in a subprocess, shrunk by bench.msd_results.SMOKE_PARAMS).
BIND_ONLY = ("launch.msd --gin_file=configs/msd/digits_caption.gin",)
GIN_JOBS = {"rl": "rl_main", "sft": "sft_main", "msd": "msd_main"}


def _extra(command: str) -> list[str]:
    return next((extra for key, extra in EXTRA.items() if key in command), [])


def run_command(command: str) -> str:
    """Runs one README line in this process; returns its standard output."""
    stdin = None
    if command.startswith("echo ") and " | " in command:
        echo, _, command = command.partition(" | ")
        stdin = " ".join(shlex.split(echo)[1:]) + "\n"
    if not command.startswith("python -m launch."):
        return subprocess.run(["bash", "-c", command], check=True, capture_output=True).stdout
    argv = shlex.split(command)
    job = argv[2].removeprefix("launch.")
    args = argv[3:] + _extra(command)
    module = importlib.import_module(f"launch.{job}")
    if any(key in command for key in BIND_ONLY):
        return _bind_only(getattr(module, GIN_JOBS[job]), args)
    out = io.StringIO()
    old_stdin = sys.stdin
    try:
        sys.stdin = io.StringIO(stdin) if stdin is not None else sys.stdin
        with contextlib.redirect_stdout(out):
            if job in GIN_JOBS:
                launch(getattr(module, GIN_JOBS[job]), args)
            else:
                assert module.main(args) in (0, None), command
    finally:
        sys.stdin = old_stdin
        gin.clear_config()
    return out.getvalue()


def _bind_only(launch_fn, args: list[str]) -> str:
    from jaxrl.infra.config import parse_gin, resolve_bindings
    from jaxrl.infra.launcher import parse_flags

    flags = parse_flags(args)
    try:
        parse_gin(flags.gin_files, flags.gin_params, flags.gin_search_paths)
        kwargs = resolve_bindings(launch_fn)
    finally:
        gin.clear_config()
    return f"bound: {sorted(kwargs)}"


@pytest.fixture(scope="module")
def readme(tmp_path_factory, jax_disk_cache):  # noqa: F811
    """Runs the README's commands in order in a scratch directory: (directory, outputs)."""
    root = tmp_path_factory.mktemp("readme")
    os.symlink(os.path.join(REPO, "configs"), root / "configs")
    outputs = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        for command in readme_commands():
            outputs[command] = run_command(command)
    return root, outputs


def test_every_readme_command_runs_as_written(readme):
    root, outputs = readme
    jobs = {c.split("launch.")[1].split()[0] for c in outputs if "launch." in c}
    assert jobs == {"rl", "sft", "eval", "export", "generate", "plot", "msd"}
    assert len(outputs) == len(readme_commands()) >= 12
    assert _output(outputs, "launch.msd").startswith("bound: ['data', 'study', 'teacher'")
    msd_test = open(os.path.join(REPO, "tests", "test_msd_pipeline.py")).read()
    assert '"configs", "msd", "digits_caption.gin"' in msd_test and '"launch.msd"' in msd_test
    assert (root / "runs" / "arith_sync" / "curves.png").exists()
    assert json.loads((root / "out.jsonl").read_text().splitlines()[0])["prompt"] == "12+7="


def _output(outputs, fragment):
    return next(out for command, out in outputs.items() if fragment in command)


def test_the_generate_example_fits_the_models_context(readme):
    """Bug 1: the default max_new_tokens (64) was the demo model's whole context, so the README's
    own `echo "12+7=" | ... --greedy` failed. Now the default fills the room the prompt leaves."""
    _, outputs = readme
    (record,) = [json.loads(x) for x in _output(outputs, 'echo "12+7="').splitlines()]
    assert record["prompt"] == "12+7="
    # <bos>12+7= is 6 tokens of the 64-token context: at most 58 new tokens.
    assert 1 <= len(record["completion_ids"]) <= 58 and len(record["logprobs"]) == len(
        record["completion_ids"]
    )
    from launch import generate

    assert generate.completion_budget(None, 64, 6, truncate=False) == 58
    assert generate.completion_budget(None, 64, 64, truncate=True) == 32
    with pytest.raises(ValueError, match=r"fills the model's context of 64 tokens.*--truncate"):
        generate.completion_budget(None, 64, 64, truncate=False)
    with pytest.raises(ValueError, match=r"--max_new_tokens=64 leaves no room .*at most 63"):
        generate.completion_budget(64, 64, 6, truncate=True)


def test_generate_with_the_chat_template(readme, tmp_path):
    """Bug 2: --chat_template crashed on transformers 5 (`apply_chat_template` returns a
    BatchEncoding). The arithmetic template renders a user turn as `<bos>` + the text, so the
    greedy completions must equal those of the plain prompts."""
    root, _ = readme
    from launch import generate

    prompts = tmp_path / "p.txt"
    prompts.write_text("12+7=\n3+45=\n")
    records = {}
    for flags in ([], ["--chat_template"]):
        out = tmp_path / f"out{len(flags)}.jsonl"
        argv = [f"--workdir={root / 'runs' / 'arith_sync'}", f"--prompts={prompts}"]
        assert generate.main([*argv, f"--output={out}", "--greedy", *flags]) == 0
        records[bool(flags)] = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["completion_ids"] for r in records[True]] == [
        r["completion_ids"] for r in records[False]
    ]


def test_eval_of_a_run_repeats_the_runs_own_last_evaluation(readme):
    """Bug 6: `launch.eval --workdir` scored a run on the default task (seed 0, its reward) with
    its own defaults. Now it reads the run's TaskSpec and evaluation settings: the numbers are
    those the run logged at its last step (a task seed and a reward other than the defaults)."""
    root, outputs = readme
    evaluated = json.loads(_output(outputs, "launch.eval --workdir=runs/arith_sync").strip())
    logged = read_metrics(root / "runs" / "arith_sync" / "metrics.jsonl")[-1]
    assert evaluated["step"] == logged["step"] == 2
    for key in ("eval/accuracy", "eval/accuracy_t1", "eval/pass_at_2", "eval/num_prompts"):
        assert evaluated[key] == round(logged[key], 4), key
    # The comparison can fail: the run's sampled accuracy is neither 0 nor 1.
    assert 0 < logged["eval/accuracy_t1"] < 1


def test_eval_names_the_sampled_accuracy_by_its_temperature(readme, monkeypatch, capsys):
    """`eval/accuracy_t1` was so named whatever --temperature was. The sampling itself is
    replaced by a stub (what is checked is the naming and the note, not the model)."""
    root, _ = readme
    import numpy as np

    from jaxrl.train import evaluation
    from launch import eval as eval_launch

    temperatures = []

    def fake_score(sampler, params, tokenizer, reward, items, ids, sampling, key, batch_size):
        temperatures.append(None if sampling.greedy else sampling.temperature)
        return np.ones(len(items))

    monkeypatch.setattr(evaluation, "_score", fake_score)
    argv = [f"--workdir={root / 'runs' / 'arith_sync'}", "--temperature=0.5"]
    assert eval_launch.main(argv) == 0
    captured = capsys.readouterr()
    metrics = json.loads(captured.out.strip().splitlines()[-1])
    assert temperatures == [None, 0.5]
    assert metrics["eval/accuracy_t0.5"] == 1.0 and "eval/accuracy_t1" not in metrics
    assert "note: --temperature=0.5; the run evaluated with temperature=1.0" in captured.err


def test_plot_of_an_sft_run_is_labelled_sft(readme, monkeypatch):
    """Bug 7: an SFT-only run was plotted as "RL, greedy" with an empty reward panel; a missing
    directory gave an empty PNG and exit status 0."""
    root, _ = readme
    from matplotlib.figure import Figure

    from launch import plot

    figures = []
    real_savefig = Figure.savefig
    monkeypatch.setattr(
        Figure, "savefig", lambda fig, *a, **k: (figures.append(fig), real_savefig(fig, *a, **k))
    )
    plot.main([str(root / "runs" / "arith_sft")])
    plot.main([str(root / "runs" / "arith_sync")])
    sft_fig, rl_fig = figures
    sft_labels = [t.get_text() for ax in sft_fig.axes for t in ax.get_legend().get_texts()]
    assert "SFT, greedy" in sft_labels and not any("RL" in x for x in sft_labels)
    assert [ax.get_ylabel() for ax in sft_fig.axes] == ["loss", "held-out accuracy"]
    assert [ax.get_ylabel() for ax in rl_fig.axes] == ["reward / mean", "loss", "held-out accuracy"]
    missing = root / "runs" / "no_such_run"
    with pytest.raises(SystemExit, match=r"launch.plot: .*no_such_run: no metrics.jsonl"):
        plot.main([str(missing)])
    assert not missing.exists()


def test_the_gsm8k_config_trains_sft_then_rl_on_the_jsonl_fixture(readme):
    """Acceptance 4 and bug 4 (SFT on the jsonl task crashed): configs/rl/gsm8k_tiny.gin ran its
    SFT stage on the worked solutions, then RL; the fixture's problem too long for the context
    was left out up front, with a count."""
    root, outputs = readme
    out = _output(outputs, "gsm8k_tiny.gin")
    assert "1 of 9 problems left out: their prompts exceed 56 tokens" in out
    run = root / "runs" / "gsm8k_tiny"
    sft = read_metrics(run / "sft" / "metrics.jsonl")
    assert [r["step"] for r in sft] == [1, 2] and all(r["loss"] > 0 for r in sft)
    rl = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rl] == [0, 1, 2]
    assert "reward/mean" in rl[-1] and "eval/accuracy" in sft[-1]
    # Logged in RL too now: update 1 of the linear warm-up to 1e-4, which the schedule caps at
    # the run's 2 steps.
    assert rl[-1]["learning_rate"] == pytest.approx(1e-4 * 1 / 2)


def test_the_exported_directory_generates_right_in_transformers(readme, tmp_path):
    """Frictions of issue 25: the exported tokenizer padded on the right (batched generation in
    transformers then continued from pad tokens), claimed a context of 512, came without a
    generation_config.json, in a directory of mode 0700. Greedy batch generation in transformers
    (PyTorch) from the export now gives the completions of our sampler."""
    import stat

    import torch
    import transformers

    from launch import generate

    root, _ = readme
    exported = root / "exported"
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(exported.stat().st_mode) == 0o777 & ~umask
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    assert tokenizer.padding_side == "left" and tokenizer.model_max_length == 64
    generation = transformers.GenerationConfig.from_pretrained(exported)
    assert (generation.eos_token_id, generation.pad_token_id) == (
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
    )

    prompts = ["12+7=", "3+45=", "60+21="]  # different lengths: the batch is padded
    (tmp_path / "p.txt").write_text("\n".join(prompts) + "\n")
    out = tmp_path / "ours.jsonl"
    argv = [f"--hf_dir={exported}", f"--prompts={tmp_path / 'p.txt'}", f"--output={out}"]
    assert generate.main([*argv, "--greedy", "--max_new_tokens=6"]) == 0
    ours = [json.loads(x)["completion_ids"] for x in out.read_text().splitlines()]

    model = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        generated = model.generate(**batch, max_new_tokens=6, do_sample=False)
    width = batch["input_ids"].shape[1]
    for row, want in enumerate(ours):
        theirs = generated[row, width:].tolist()
        assert theirs[: len(want)] == want, (prompts[row], theirs, want)


# "Your model, your data": the rule for what is appended to the recipe's commands. Only the RL
# launch is shrunk: 2 steps of 2 prompts x 4 samples, 8 new tokens, a 2-prompt evaluation, on one
# device (the README's config spans every device JAX sees). Paths are the README's own, in a
# scratch directory that links the repository's examples/.
RECIPE_EXTRA = _gin(
    "RLConfig.total_steps = 2",
    "RLConfig.eval_every_steps = 2",
    "RLConfig.save_every_steps = 2",
    "RLConfig.num_prompts = 2",
    "RLConfig.samples_per_prompt = 4",
    "RLConfig.max_new_tokens = 8",
    "RLConfig.eval_size = 2",
    "RLConfig.eval_samples = 2",
    "MeshConfig.num_devices = 1",
)


def _problem(i: int) -> str:
    a, b = i + 2, 3 * i + 1
    return json.dumps(
        {
            "question": f"tom has {a} apples and buys {b} more. how many apples does he have?",
            "answer": f"{a} + {b} = {a + b}.\n#### {a + b}",
        }
    )


def readme_python_blocks() -> list[str]:
    import re

    text = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    return re.findall(r"^```python\n(.*?)^```$", text, flags=re.M | re.S)


def _run_recipe_command(command: str) -> str:
    if command.startswith("python examples/"):  # a script, as `python` would run it
        import runpy

        argv = shlex.split(command)[1:]
        old_argv, sys.argv = sys.argv, argv
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                runpy.run_path(argv[0], run_name="__main__")
        finally:
            sys.argv = old_argv
        return out.getvalue()
    if "launch.rl" in command:
        command += " " + " ".join(shlex.quote(x) for x in RECIPE_EXTRA)
    return run_command(command)


@pytest.fixture(scope="module")
def recipe(tmp_path_factory, jax_disk_cache):  # noqa: F811
    """The README's "Your model, your data" block, run in order: (directory, outputs)."""
    root = tmp_path_factory.mktemp("recipe")
    os.symlink(os.path.join(REPO, "examples"), root / "examples")
    (root / "my_prompts.jsonl").write_text("\n".join(_problem(i) for i in range(20)) + "\n")
    (root / "my_eval.jsonl").write_text("\n".join(_problem(i) for i in range(20, 24)) + "\n")
    (reward_block,) = readme_python_blocks()
    assert reward_block.startswith("# my_rewards.py")
    (root / "my_rewards.py").write_text(reward_block)
    outputs = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        patch.syspath_prepend(str(root))  # `python -m` puts the working directory first
        for command in readme_commands("Your model, your data"):
            outputs[command] = _run_recipe_command(command)
    return root, outputs


def test_the_your_model_your_data_recipe_runs_as_written(recipe):
    root, outputs = recipe
    jobs = [c.split()[2] for c in outputs if c.startswith("python -m launch.")]
    assert jobs == ["launch.rl", "launch.eval", "launch.export", "launch.generate"]
    run = root / "runs" / "mine"
    assert "my_rewards:score" in (run / "config.gin").read_text()
    # init_from as the run stored it: absolute (issue 57), so the run reads it from anywhere
    assert f"starting from the HF checkpoint {root / 'my_model'}" in _output(outputs, "launch.rl")
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records if r["step"] > 0] == [1, 2]
    assert all("reward/mean" in r for r in records if r["step"] > 0)
    assert "2" in os.listdir(run / "checkpoints") and (run / "curves.png").exists()
    evaluated = json.loads(_output(outputs, "launch.eval").strip().splitlines()[-1])
    assert evaluated["step"] == 2 and evaluated["eval/num_prompts"] == 2
    exported = root / "my_model_rl"
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (exported / name).exists(), name
    (record,) = [json.loads(x) for x in (root / "out.jsonl").read_text().splitlines()]
    assert record["prompt"].startswith("tom has 3 apples") and record["completion_ids"]


def test_the_recipe_run_is_read_from_another_directory(recipe, tmp_path, monkeypatch, capsys):
    """Issue 57, point 5: the run stored its data paths as typed ('my_prompts.jsonl'), so
    `launch.eval --workdir=<absolute>` from another directory failed ("TaskSpec:
    'my_prompts.jsonl': no such file"), and needed the training file at all. The run's
    config.gin holds absolute paths now, and eval reads only the held-out file."""
    from launch import eval as eval_launch

    root, _ = recipe
    run = root / "runs" / "mine"
    config = " ".join((run / "config.gin").read_text().replace("\\\n", " ").split())
    assert f"TaskSpec.train_path = '{root / 'my_prompts.jsonl'}'" in config
    assert f"TaskSpec.eval_path = '{root / 'my_eval.jsonl'}'" in config
    assert f"PolicySpec.init_from = '{root / 'my_model'}'" in config
    train, moved = root / "my_prompts.jsonl", tmp_path / "moved.jsonl"
    monkeypatch.chdir(tmp_path)
    train.rename(moved)  # eval needs no training file
    try:
        assert eval_launch.main([f"--workdir={run}"]) == 0
    finally:
        moved.rename(train)
    evaluated = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert evaluated["step"] == 2 and evaluated["eval/num_prompts"] == 2


def test_generate_formats_a_runs_prompts_as_its_task_did(recipe, tmp_path, monkeypatch, capsys):
    """Issue 57, point 3: `launch.generate --workdir` of a run trained on chat-templated prompts
    (math_jsonl) sent raw text. It formats prompts as the run's task did now, and says so."""
    from launch import generate

    root, _ = recipe
    monkeypatch.chdir(tmp_path)
    (tmp_path / "q.txt").write_text("tom has 3 apples. how many apples does he have?\n")
    argv = ["--prompts=q.txt", "--output=out.jsonl", "--max_new_tokens=2"]
    assert generate.main([f"--workdir={root / 'runs' / 'mine'}", *argv]) == 0
    assert "[generate] prompts through the chat template (--raw for raw text): as the run's" in (
        capsys.readouterr().err
    )
    assert json.loads((tmp_path / "out.jsonl").read_text())["prompt"].startswith("tom has 3")


SMOLLM2 = "A pretrained model: SmolLM2-135M-Instruct from the package index"


def test_the_smollm2_commands_take_tilde_paths_as_written(tmp_path, monkeypatch):
    """Issue 57, point 2: the README's `--hf_dir=~/.cache/jaxrl/smollm2-135m-instruct` reaches
    the program with its `~` (bash expands it only at a word's start) and failed ("has no
    config.json"). With a HOME of its own that holds a tiny model where `launch.fetch` puts
    SmolLM2, the section's generate command runs as written, and its RL command (run by
    bench/learning/smollm2.py) parses and binds its init_from to that directory. The fetch and
    import lines download or need a GGUF; the eval and export lines need the run."""
    import runpy

    from jaxrl.infra.config import parse_gin, resolve_bindings
    from launch import fetch
    from launch.rl import rl_main

    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    model = home / ".cache" / "jaxrl" / "smollm2-135m-instruct"
    assert fetch.cache_dir() == str(model.parent)  # where the README's fetch line puts it
    tiny = runpy.run_path(os.path.join(REPO, "examples", "tiny_hf_model.py"))["tiny_hf_model"]
    tiny(str(model))
    os.symlink(os.path.join(REPO, "configs"), tmp_path / "configs")
    monkeypatch.chdir(tmp_path)
    commands = readme_commands(SMOLLM2)
    (generate,) = [c for c in commands if "launch.generate" in c]
    assert "--hf_dir=~/.cache/jaxrl/smollm2-135m-instruct" in generate
    (record,) = [json.loads(x) for x in run_command(generate).splitlines()]
    assert record["prompt"] == "What is the capital of France?" and record["completion_ids"]
    (rl,) = [c for c in commands if "launch.rl" in c]
    argv = shlex.split(rl)
    assert argv[:3] == ["XLA_FLAGS=--xla_force_host_platform_device_count=2", "python", "-m"]
    flags = parse_flags(argv[4:])
    try:
        parse_gin(flags.gin_files, flags.gin_params)
        policy = resolve_bindings(rl_main)["policy"]
    finally:
        gin.clear_config()
    assert policy.init_from == str(model)

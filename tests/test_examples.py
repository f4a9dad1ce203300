"""The examples run (tiny settings), so they cannot rot; a launch and the RunIO path import no
torch even though torch is installed here; RunIO's final-step checkpoint can be turned off."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest

from jaxrl.infra.metrics import read_metrics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 600

# `python -m launch.rl ...` (its __main__, as run from a shell), then what it imported.
LAUNCH_AND_REPORT = textwrap.dedent(
    """
    import json, runpy, sys
    sys.argv = ["launch.rl", *sys.argv[1:]]
    runpy.run_module("launch.rl", run_name="__main__", alter_sys=True)
    print(json.dumps({"torch_imported": sys.modules.get("torch") is not None}))
    """
)


def _env():
    env = dict(os.environ)
    # The user's module lives outside the library: examples/ on PYTHONPATH, as the gin file says.
    env["PYTHONPATH"] = os.pathsep.join([REPO, os.path.join(REPO, "examples")])
    return env


@pytest.fixture(scope="module")
def example_runs(tmp_path_factory):
    """Both examples, run concurrently as subprocesses: {name: (returncode, output, workdir)}."""
    workdir = str(tmp_path_factory.mktemp("examples") / "max")
    smoke = [
        "RLConfig.total_steps = 2",
        "RLConfig.num_prompts = 4",
        "RLConfig.samples_per_prompt = 4",
        "RLConfig.eval_size = 8",
        "RLConfig.eval_samples = 2",
        "RLConfig.eval_every_steps = 2",
        "RLConfig.save_every_steps = 2",
    ]
    commands = {
        "custom_task": [sys.executable, "-c", LAUNCH_AND_REPORT, "--workdir", workdir]
        + ["--gin_file", os.path.join(REPO, "examples", "max_task.gin")]
        + [f"--gin_param={p}" for p in smoke],
        "grpo_loop": [sys.executable, os.path.join(REPO, "examples", "grpo_loop.py")]
        + ["--sft_steps", "2", "--rl_steps", "2", "--prompts", "2", "--group", "4"],
    }
    procs = {
        name: subprocess.Popen(
            cmd,
            cwd=REPO,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for name, cmd in commands.items()
    }
    results = {}
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=TIMEOUT_S)
        results[name] = (proc.returncode, out, workdir)
    return results


def test_custom_task_example_runs_through_launch_rl_without_torch(example_runs):
    returncode, out, workdir = example_runs["custom_task"]
    assert returncode == 0, out[-3000:]
    report = json.loads(out.strip().splitlines()[-1])
    assert report == {"torch_imported": False}, out[-3000:]
    records = [r for r in read_metrics(os.path.join(workdir, "metrics.jsonl")) if r["step"] > 0]
    assert [r["step"] for r in records] == [1, 2]
    assert all(math.isfinite(r["loss"]) for r in records)
    assert "eval/accuracy" in records[-1]
    assert "import max_task" in open(os.path.join(workdir, "config.gin")).read()


def test_grpo_loop_example_runs(example_runs):
    returncode, out, _ = example_runs["grpo_loop"]
    assert returncode == 0, out[-3000:]
    steps = [line for line in out.splitlines() if line.startswith("step=")]
    assert [s.split()[0] for s in steps] == ["step=1", "step=2"], out[-3000:]
    for line in steps:
        fields = dict(f.split("=") for f in line.split())
        assert math.isfinite(float(fields["loss"])) and 0 <= float(fields["reward"]) <= 1


RUN_IO = textwrap.dedent(
    """
    import json, os, sys
    import jax.numpy as jnp
    from jaxrl.infra.run_io import RunIO
    from jaxrl.train.trainer import TrainState

    saved = {}
    for save_final in (False, True):
        workdir = os.path.join(sys.argv[1], str(save_final))
        io = RunIO(workdir, total_steps=2, save_every_steps=100, keep_last_n=1, desc="t",
                   save_final=save_final)
        state = TrainState(step=jnp.asarray(2, jnp.int32), params={"w": jnp.ones(3)}, opt_state=())
        io.log(2, {"loss": 1.0}, {})
        io.save(state, {"stage": "test"}, force=True)  # the loops' final-step save
        io.close()
        saved[str(save_final)] = sorted(os.listdir(os.path.join(workdir, "checkpoints")))
    print(json.dumps({"torch_imported": "torch" in sys.modules, "saved": saved}))
    """
)


def test_run_io_imports_no_torch_and_final_save_can_be_off(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", RUN_IO, str(tmp_path)],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["torch_imported"] is False
    assert not [d for d in report["saved"]["False"] if d.isdigit()], report
    assert "2" in report["saved"]["True"], report  # negative control: the default saves step 2
    assert os.listdir(tmp_path / "False" / "tensorboard")  # TensorBoard events still written


def test_a_user_module_that_needs_torch_is_told_how_to_allow_it(tmp_path):
    """Under `keep_torch_out` a reward module importing torch fails with JAXRL_ALLOW_TORCH named;
    with JAXRL_ALLOW_TORCH=1 it imports."""
    (tmp_path / "torch_reward.py").write_text(
        "import torch\n\ndef score(prompts, completions, references):\n"
        "    return [0.0 for _ in completions]\n"
    )
    script = (
        "from jaxrl.infra.user_code import keep_torch_out\n"
        "keep_torch_out()\n"
        "from jaxrl.tasks.rewards import get_reward\n"
        "try:\n"
        "    get_reward('torch_reward:score')\n"
        "    print('imported')\n"
        "except KeyError as e:\n"
        "    print(e)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, str(tmp_path)])}
    env.pop("JAXRL_ALLOW_TORCH", None)
    run = lambda extra: subprocess.run(  # noqa: E731
        [sys.executable, "-c", script], env={**env, **extra}, capture_output=True, text=True,
        timeout=120, check=True,
    ).stdout  # fmt: skip
    assert "set JAXRL_ALLOW_TORCH=1" in run({})
    assert run({"JAXRL_ALLOW_TORCH": "1"}).strip() == "imported"

"""The sync RL loop end to end: launch.rl on a tiny config, on-policy log-ratios, exact resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import gin
import numpy as np

from jaxrl.infra.metrics import read_metrics
from jaxrl.job import workdir as run_dir
from jaxrl.job.specs import PolicySpec, TaskSpec, build_model_config, build_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, "configs", "rl", "arith_tiny_sync.gin")
# A few steps of everything: SFT, RL with evals and saves.
SMOKE = [
    "SFTConfig.steps = 4",
    "SFTConfig.eval_every_steps = 2",
    "SFTConfig.save_every_steps = 2",
    "SFTConfig.eval_size = 8",
    "SFTConfig.eval_samples = 2",
    "RLConfig.total_steps = 4",
    "RLConfig.num_prompts = 4",
    "RLConfig.samples_per_prompt = 4",
    "RLConfig.eval_every_steps = 2",
    "RLConfig.save_every_steps = 2",
    "RLConfig.eval_size = 8",
    "RLConfig.eval_samples = 2",
    "OptimizerConfig.learning_rate = 1e-3",
    "OptimizerConfig.warmup_steps = 0",
    # An untrained policy never solves the task, so score something it varies on: RL must then
    # move the weights.
    "TaskSpec.reward = 'rewards_for_tests:even_length'",
]


def _flags(workdir, params):
    flags = ["--gin_file", CONFIG, "--workdir", str(workdir)]
    for p in params:
        flags += ["--gin_param", p]
    return flags


def _final_params(workdir):
    config = build_model_config(PolicySpec(), build_tokenizer(PolicySpec(), TaskSpec()))
    step, state = run_dir.restore_params(str(workdir), config)
    from flax import nnx

    return step, {"/".join(map(str, k)): np.asarray(v) for k, v in nnx.to_flat_state(state)}


def test_sync_rl_runs_end_to_end_on_a_2x2_mesh(tmp_path, capsys):
    from jaxrl.infra.launcher import launch
    from launch.rl import rl_main

    mesh = [
        "MeshConfig.axis_names = ('fsdp', 'tp')",
        "MeshConfig.axis_sizes = (2, 2)",
        "rl_main.mesh = @MeshConfig()",
    ]
    try:
        result = launch(rl_main, _flags(tmp_path / "run", SMOKE + mesh))
    finally:
        gin.clear_config()
    out = capsys.readouterr().out
    for what in ("metrics:", "plot:", "checkpoints:"):
        assert what in out
    assert os.path.exists(result["plot"])
    records = read_metrics(str(tmp_path / "run" / "metrics.jsonl"))
    steps = [r for r in records if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for r in steps:
        assert np.isfinite(r["loss"]) and r["num_tokens"] > 0
        # Sync fp32: the trainer's log pi of the sampled tokens is the sampler's log mu.
        assert r["abs_log_ratio_max"] <= 1e-5, r["abs_log_ratio_max"]
        assert r["truncated_fraction"] == 0.0
        for key in (
            "reward/mean",
            "time/generate_s",
            "time/train_s",
            "time/reward_s",
            "throughput/tokens_per_s",
        ):
            assert key in r, key
    assert "eval/accuracy" in records[0] and "eval/accuracy" in steps[-1]
    # The SFT stage ran to its end inside the run's workdir, then RL changed the weights.
    assert read_metrics(str(tmp_path / "run" / "sft" / "metrics.jsonl"))[-1]["step"] == 4
    _, sft = _final_params(tmp_path / "run" / "sft")
    step, rl = _final_params(tmp_path / "run")
    assert step == 4
    assert any(not np.array_equal(sft[k], rl[k]) for k in sft)
    assert all(np.isfinite(v).all() for v in rl.values())

    from launch import eval as eval_launch

    assert eval_launch.main([f"--workdir={tmp_path / 'run'}", "--eval_size=8", "--samples=2"]) == 0
    evaluated = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert evaluated["step"] == 4 and 0 <= evaluated["eval/accuracy"] <= 1
    assert "eval/pass_at_2" in evaluated


RESUME = [
    "rl_main.sft = None",
    "rl_main.plot = False",  # no curves PNG (matplotlib): ~1 s a launch
    "TaskSpec.reward = 'rewards_for_tests:even_length'",
    "RLConfig.total_steps = 6",
    "RLConfig.num_prompts = 4",
    "RLConfig.samples_per_prompt = 4",
    "RLConfig.eval_every_steps = 100",
    "RLConfig.save_every_steps = 2",
    "RLConfig.eval_size = 8",
    "RLConfig.eval_samples = 0",
    "OptimizerConfig.learning_rate = 1e-2",
]


def _run(workdir, fault=None):
    env = {k: v for k, v in os.environ.items() if k != "JAXRL_FAULT"}
    env["PYTHONPATH"] = os.pathsep.join([REPO, os.path.join(REPO, "tests")])
    if fault:
        env["JAXRL_FAULT"] = fault
    return subprocess.run(
        [sys.executable, "-m", "launch.rl", *_flags(workdir, RESUME)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_resume_after_kills_is_bitwise_equal(tmp_path):
    """Killed once between saves (after step 3; step 2 is saved), once inside the save of step 4
    (its temporary directory exists, never committed), and stopped by SIGTERM after step 4 (a
    saved step: it exits 0 at once), the same command, rerun, ends with the parameters of an
    uninterrupted run, having trained on the same prompts."""
    reference = _run(tmp_path / "reference")
    assert reference.returncode == 0, reference.stderr[-3000:]
    run = tmp_path / "run"
    killed = _run(run, "kill_at_step=3")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["2"]
    killed = _run(run, "kill_in_save=4")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert "resuming" in killed.stdout and "from step 2" in killed.stdout
    assert (run / "checkpoints" / "4.orbax-checkpoint-tmp").exists()
    # SIGTERM right after step 4, which is saved on schedule: the process stops there, exit 0.
    stopped = _run(run, "sigterm_at_step=4")
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert "from step 2" in stopped.stdout  # the half-written step 4 was not restored
    assert "stopped by SIGTERM after step 4" in stopped.stdout
    resumed = _run(run)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "from step 4" in resumed.stdout

    ref_step, ref = _final_params(tmp_path / "reference")
    step, params = _final_params(run)
    assert step == ref_step == 6
    for name, value in ref.items():
        assert value.tobytes() == params[name].tobytes(), name
    _, initial = _final_params_at(run, 4)
    assert any(initial[k].tobytes() != params[k].tobytes() for k in params)  # RL moved them
    for workdir in (tmp_path / "reference", run):
        extra_dir = workdir / "checkpoints" / "6" / "extra"
        extra = json.loads(next(p for p in extra_dir.iterdir()).read_text())
        assert extra["prompts_trained"] == 6 * 4
    steps = [r["step"] for r in read_metrics(str(run / "metrics.jsonl")) if r["step"] > 0]
    assert sorted(set(steps)) == [1, 2, 3, 4, 5, 6]


def _final_params_at(workdir, step):
    config = build_model_config(PolicySpec(), build_tokenizer(PolicySpec(), TaskSpec()))
    from flax import nnx

    step, state = run_dir.restore_params(str(workdir), config, step=step)
    return step, {"/".join(map(str, k)): np.asarray(v) for k, v in nnx.to_flat_state(state)}

"""The async RL run as one job of two processes (`launch.local_cluster`, gloo on CPU): every mesh
spans both processes (configs/rl/arith_tiny_2proc.gin), process 1 is killed after step 3, the
whole job is started again and resumes from its last checkpoint to the end. Its per-step rewards
equal a single-process run of the same config (fixed lag: the same samples), its losses agree to
float rounding (the devices are laid out differently)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 6
PARAMS = [
    "rl_main.sft = None",
    f"RLConfig.total_steps = {STEPS}",
    "RLConfig.save_every_steps = 2",
    "RLConfig.eval_size = 0",  # evaluation across processes: bench/rl_multiprocess.py
    "RLConfig.num_prompts = 4",
    "RLConfig.samples_per_prompt = 4",
    "RLConfig.oversample = 2",
    "OptimizerConfig.learning_rate = 1e-2",
    "OptimizerConfig.warmup_steps = 0",
]


def _rl_command(config: str, workdir) -> list[str]:
    command = [sys.executable, "-m", "launch.rl", f"--gin_file=configs/rl/{config}"]
    return command + [f"--workdir={workdir}"] + [f"--gin_param={p}" for p in PARAMS]


def _run(command, fault: str = "", timeout_s: int = 150) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAXRL_FAULT=fault)
    env.pop("XLA_FLAGS", None)  # local_cluster sets the device count per process
    return subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
    )


def _cluster(workdir, fault: str = "", extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """configs/rl/arith_tiny_2proc.gin (with `extra` flags) as a job of 2 processes x 4 devices."""
    launcher = [
        sys.executable, "-m", "launch.local_cluster", "--num_processes", "2",
        "--devices_per_process", "4", "--timeout_s", "120", "--heartbeat_timeout_s", "5", "--",
    ]  # fmt: skip
    return _run(launcher + _rl_command("arith_tiny_2proc.gin", workdir) + list(extra), fault)


def _metrics(workdir) -> dict[int, dict]:
    """The last record of each step (a resumed run logs the steps after its checkpoint again)."""
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return {r["step"]: r for r in map(json.loads, f)}


def test_async_rl_on_two_processes_resumes_after_a_process_is_killed(tmp_path):
    workdir = tmp_path / "two_processes"
    killed = _cluster(workdir, fault="kill_at_step=3@1")
    output = killed.stdout + killed.stderr
    assert killed.returncode != 0, output[-4000:]
    # Process 1 is SIGKILLed (137); process 0 may see its peer gone first (a gloo read error:
    # exit 1) and be the one the launcher reports. Either way the job stopped.
    assert re.search(r"\[local_cluster\] process [01] exited with status (137|1);", output), output[
        -4000:
    ]
    checkpoints = workdir / "checkpoints"
    assert sorted(os.listdir(checkpoints)) == ["2"], os.listdir(checkpoints)

    resumed = _cluster(workdir)
    output = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, output[-6000:]
    assert f"[0] [rl] resuming {workdir} from step 2" in output, output[-4000:]
    assert f"[0] [rl] step {STEPS}/{STEPS}" in output, output[-4000:]
    assert "[1] [rl]" not in output  # progress on process 0 only
    assert str(STEPS) in os.listdir(checkpoints)
    two = _metrics(workdir)
    assert sorted(two) == list(range(STEPS + 1))
    assert [two[s]["async/staleness"] for s in range(1, STEPS + 1)] == [0, 1, 2, 2, 2, 2]

    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    single_dir = tmp_path / "one_process"
    single = subprocess.run(
        _rl_command("arith_tiny.gin", single_dir),
        cwd=REPO,
        env=dict(os.environ, **env, JAXRL_FAULT=""),
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )
    assert single.returncode == 0, (single.stdout + single.stderr)[-4000:]
    one = _metrics(single_dir)
    steps = range(1, STEPS + 1)
    assert [one[s]["reward/mean"] for s in steps] == [two[s]["reward/mean"] for s in steps]
    np.testing.assert_allclose(
        [two[s]["loss"] for s in steps], [one[s]["loss"] for s in steps], rtol=1e-4, atol=1e-6
    )


def test_free_running_schedule_is_refused_across_processes(tmp_path):
    result = _cluster(tmp_path / "run", extra=("--gin_param=RLConfig.schedule = 'free_running'",))
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-4000:]
    assert "RLConfig.schedule='free_running' in a job of 2 processes" in output, output[-4000:]
    assert "use RLConfig.schedule = 'fixed_lag'" in output
    assert not (tmp_path / "run" / "checkpoints").exists()

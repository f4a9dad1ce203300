"""The async RL run as one job of two processes (`launch.local_cluster`, gloo on CPU): every mesh
spans both processes (configs/rl/arith_tiny_2proc.gin), process 1 is killed after step 3, the
whole job is started again and resumes from its last checkpoint to the end. Its per-step rewards
equal a single-process run of the same config (fixed lag: the same samples), its losses and
parameters agree to float rounding (the devices are laid out differently).

The reward is `rewards_for_tests:even_length`, on which a random policy varies within groups, so
the rewards, losses and parameters move over the steps and the comparison can fail; a control
inside the test feeds the same comparison a perturbed copy of one run and sees it flagged."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys

import numpy as np
from flax import nnx
from procs import suite_xla_flags

from jaxrl.job import workdir as run_dir
from jaxrl.job.specs import PolicySpec, TaskSpec, build_model_config, build_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 6
SAVED = (2, 4, 6)
PARAMS = [
    "rl_main.sft = None",
    "rl_main.plot = False",  # no curves PNG (matplotlib): ~1 s a launch
    # The engine runs on single-process meshes: the two-process job samples with the static
    # sampler (launch.rl falls back to it), so the one-process reference must too.
    "GeneratorConfig.kind = 'static'",
    # A random policy never solves arithmetic (every reward 0, no gradient); it does vary on this.
    "TaskSpec.reward = 'rewards_for_tests:even_length'",
    f"RLConfig.total_steps = {STEPS}",
    "RLConfig.save_every_steps = 2",
    f"RLConfig.keep_last_n = {len(SAVED)}",
    "RLConfig.eval_size = 0",  # evaluation across processes: bench/rl_multiprocess.py
    "RLConfig.num_prompts = 4",
    "RLConfig.samples_per_prompt = 4",
    "RLConfig.oversample = 2",
    "OptimizerConfig.learning_rate = 1e-2",
    "OptimizerConfig.warmup_steps = 0",
]
# The two layouts reduce in different orders: losses and parameters agree to float rounding.
LOSS_RTOL, LOSS_ATOL = 1e-4, 1e-6
# Parameter disagreement, as a fraction of how far the parameters moved over the saved steps.
PARAM_RTOL = 1e-3


def _env(fault: str = "") -> dict[str, str]:
    env = dict(os.environ, JAXRL_FAULT=fault)
    env["PYTHONPATH"] = os.pathsep.join([REPO, os.path.join(REPO, "tests")])
    return env


def _rl_command(config: str, workdir) -> list[str]:
    command = [sys.executable, "-m", "launch.rl", f"--gin_file=configs/rl/{config}"]
    return command + [f"--workdir={workdir}"] + [f"--gin_param={p}" for p in PARAMS]


def _run(command, env, timeout_s: int = 150) -> subprocess.CompletedProcess:
    return subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
    )


def _cluster(workdir, fault: str = "", extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """configs/rl/arith_tiny_2proc.gin (with `extra` flags) as a job of 2 processes x 4 devices."""
    launcher = [
        sys.executable, "-m", "launch.local_cluster", "--num_processes", "2",
        "--devices_per_process", "4", "--timeout_s", "120", "--heartbeat_timeout_s", "5", "--",
    ]  # fmt: skip
    env = _env(fault)
    env["XLA_FLAGS"] = suite_xla_flags()  # local_cluster sets the device count per process
    return _run(launcher + _rl_command("arith_tiny_2proc.gin", workdir) + list(extra), env)


def _metrics(workdir) -> dict[int, dict]:
    """The last record of each step (a resumed run logs the steps after its checkpoint again)."""
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return {r["step"]: r for r in map(json.loads, f)}


def _saved_params(workdir) -> dict[int, dict[str, np.ndarray]]:
    """The parameters of each saved step, by name, on this process's first device."""
    config = build_model_config(PolicySpec(), build_tokenizer(PolicySpec(), TaskSpec()))
    out = {}
    for step in SAVED:
        restored, state = run_dir.restore_params(str(workdir), config, step=step)
        assert restored == step
        out[step] = {"/".join(map(str, k)): np.asarray(v) for k, v in nnx.to_flat_state(state)}
    return out


def _disagreements(one: dict, two: dict) -> list[str]:
    """How the run `two` differs from the run `one` (empty: they agree). Each run is
    {"metrics": {step: record}, "params": {saved step: {name: array}}}: rewards must be equal,
    losses close, and the parameters of every saved step within PARAM_RTOL of how far the
    parameters moved between the first and the last saved step."""
    problems = []
    steps = range(1, STEPS + 1)
    for s in steps:
        r1, r2 = one["metrics"][s]["reward/mean"], two["metrics"][s]["reward/mean"]
        if r1 != r2:
            problems.append(f"step {s}: reward/mean {r2} != {r1}")
        l1, l2 = one["metrics"][s]["loss"], two["metrics"][s]["loss"]
        if not abs(l2 - l1) <= LOSS_ATOL + LOSS_RTOL * abs(l1):
            problems.append(f"step {s}: loss {l2} vs {l1}")
    first, last = one["params"][SAVED[0]], one["params"][SAVED[-1]]
    moved = np.sqrt(sum(np.sum((last[k] - first[k]) ** 2) for k in last))
    for step in SAVED:
        p1, p2 = one["params"][step], two["params"][step]
        diff = np.sqrt(sum(np.sum((p2[k] - p1[k]) ** 2) for k in p1))
        if not diff <= PARAM_RTOL * moved:
            problems.append(f"step {step}: params differ by {diff:.3g} (moved {moved:.3g})")
    return problems


def _perturbed(run: dict, what: str) -> dict:
    """A copy of `run` as if one process had seen different data: one sample's reward at one
    step, one step's loss (by 1%), or half of the largest tensor (noise of std 1e-3, far below
    the parameters' own scale) changed."""
    run = copy.deepcopy(run)
    if what == "reward":
        run["metrics"][4]["reward/mean"] += 1.0 / 16  # one sample of 16 scored differently
    elif what == "loss":
        run["metrics"][5]["loss"] *= 1.01
    else:
        params = run["params"][SAVED[-1]]
        name = max(params, key=lambda k: params[k].size)
        half = params[name].shape[0] // 2
        rng = np.random.default_rng(0)
        params[name][half:] += 1e-3 * rng.standard_normal(params[name][half:].shape)
    return run


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
    assert sorted(os.listdir(checkpoints), key=int) == [str(s) for s in SAVED]
    two = {"metrics": _metrics(workdir), "params": _saved_params(workdir)}
    assert sorted(two["metrics"]) == list(range(STEPS + 1))
    staleness = [two["metrics"][s]["async/staleness"] for s in range(1, STEPS + 1)]
    assert staleness == [0, 1, 2, 2, 2, 2]

    single_dir = tmp_path / "one_process"
    env = _env() | {"XLA_FLAGS": suite_xla_flags(devices=8)}
    single = _run(_rl_command("arith_tiny.gin", single_dir), env | {"JAX_PLATFORMS": "cpu"})
    assert single.returncode == 0, (single.stdout + single.stderr)[-4000:]
    one = {"metrics": _metrics(single_dir), "params": _saved_params(single_dir)}

    # The comparison can fail: rewards vary within groups and from step to step, every step has
    # a gradient, and the parameters move from save to save.
    steps = range(1, STEPS + 1)
    records = [one["metrics"][s] for s in steps]
    rewards = [r["reward/mean"] for r in records]
    print("rewards", rewards, "losses", [r["loss"] for r in records])
    assert all(0 < r < 1 for r in rewards) and len(set(rewards)) > 1, rewards
    assert all(r["grad_norm"] > 0 and r["loss"] != 0 for r in records), records
    for a, b in zip(SAVED, SAVED[1:], strict=False):
        before, after = one["params"][a], one["params"][b]
        assert max(np.abs(after[k] - before[k]).max() for k in after) > 1e-3, (a, b)

    params_gap = max(
        np.abs(two["params"][s][k] - one["params"][s][k]).max()
        for s in SAVED
        for k in one["params"][s]
    )
    loss_gap = max(abs(two["metrics"][s]["loss"] - one["metrics"][s]["loss"]) for s in steps)
    print(f"max |two - one| over the steps: params {params_gap:.3g}, loss {loss_gap:.3g}")
    assert _disagreements(one, two) == []
    # Control: the same comparison flags a run in which one process's data was perturbed.
    for what in ("reward", "loss", "params"):
        flagged = _disagreements(one, _perturbed(two, what))
        assert len(flagged) == 1, (what, flagged)


def test_free_running_schedule_is_refused_across_processes(tmp_path):
    result = _cluster(tmp_path / "run", extra=("--gin_param=RLConfig.schedule = 'free_running'",))
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-4000:]
    assert "RLConfig.schedule='free_running' in a job of 2 processes" in output, output[-4000:]
    assert "use RLConfig.schedule = 'fixed_lag'" in output
    assert not (tmp_path / "run" / "checkpoints").exists()

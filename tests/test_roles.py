"""Role-split async RL (`rl_main.roles`, configs/rl/arith_tiny_roles.gin, its SFT stage too):
process 0 runs only the trainer (and the SFT stage) on its 4 devices, process 1 only the
generator and the reward on its 4 (`launch.local_cluster`). Compared with a one-process run of
the same config (8 devices, both roles in one process, the same device positions):

- fixed lag makes it the same computation, bit for bit: every logged value of the SFT stage and
  of every RL step (timings aside) and every parameter of the SFT stage and of each saved step
  equal, with a generator made slow (its reward sleeps 1 s) that the trainer waits for: every
  trained batch is the one fixed lag names, never older than `max_staleness`, nothing dropped;
- the generator process SIGKILLed mid-run, then (relaunched, resumed) the trainer process: each
  time the job ends within 10 s, non-zero; relaunched once more it resumes from the checkpoint
  (which holds the queued rollouts) and ends bitwise equal to the uninterrupted one-process run,
  each batch trained exactly once.

Bitwise needs each process of the local cluster to have the XLA:CPU thread pool of the
one-process run (`launch.local_cluster` sets PJRT_NPROC): with a pool sized by its own 4
devices on a host of fewer than 8 cores, the trainer computed other float sums (SFT and RL
losses 1 ulp apart within a few steps), which these comparisons flag.

The reward varies within groups (`rewards_for_tests:even_length`), so rewards, losses and
parameters move and the comparison can fail (a control feeds it copies 1 ulp off)."""

from __future__ import annotations

import copy
import math
import os
import re
import sys
import time

import numpy as np
import pytest
from flax import nnx
from procs import suite_xla_flags
from test_distributed_rl import PARAMS, SAVED, STEPS, _env, _metrics, _run, _saved_params

from jaxrl.infra.checkpoint import CheckpointConfig, Checkpointer
from jaxrl.job import workdir as run_dir
from jaxrl.job.specs import build_model_config, build_tokenizer
from launch.configs import PolicySpec, TaskSpec

CONFIG = "arith_tiny_roles.gin"
SFT_STEPS = 4
# The shipped config's SFT stage, shortened; evaluated once, at its last step.
ROLE_PARAMS = [p for p in PARAMS if p != "rl_main.sft = None"] + [
    f"SFTConfig.steps = {SFT_STEPS}",
    "SFTConfig.eval_every_steps = 1000",
    "SFTConfig.save_every_steps = 1000",
    "SFTConfig.eval_size = 4",
    "SFTConfig.eval_samples = 1",
]
LAG = MAX_STALENESS = 2  # configs/rl/arith_tiny.gin
STOP_WITHIN_S = 10.0
SLOW = "TaskSpec.reward = 'rewards_for_tests:even_length_slow_generator'"


def _cached(env: dict, cache: str) -> dict:
    return env | {
        "JAX_COMPILATION_CACHE_DIR": cache,
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }


def _command(workdir, extra: tuple[str, ...] = ()) -> list[str]:
    command = [sys.executable, "-m", "launch.rl", f"--gin_file=configs/rl/{CONFIG}"]
    command += [f"--workdir={workdir}"] + [f"--gin_param={p}" for p in ROLE_PARAMS]
    return command + [f"--gin_param={p}" for p in extra]


def _cluster(workdir, cache: str, fault: str = "", extra: tuple[str, ...] = ()):
    """The roles config as a job of 2 processes x 4 devices; returns (result, unix time at which
    the launcher had exited)."""
    launcher = [
        sys.executable, "-m", "launch.local_cluster", "--num_processes", "2",
        "--devices_per_process", "4", "--timeout_s", "150", "--heartbeat_timeout_s", "5", "--",
    ]  # fmt: skip
    env = _cached(_env(fault), cache)
    env["XLA_FLAGS"] = suite_xla_flags()  # local_cluster sets the device count per process
    result = _run(launcher + _command(workdir, extra), env, timeout_s=180)
    return result, time.time()


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, xla_cache):
    """The same config on one process with 8 devices (roles are ignored there)."""
    workdir = tmp_path_factory.mktemp("roles") / "one_process"
    env = _cached(_env(), xla_cache)
    env |= {"XLA_FLAGS": suite_xla_flags(devices=8), "JAX_PLATFORMS": "cpu"}
    result = _run(_command(workdir), env)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    run = _outputs(workdir)
    rewards = [run["metrics"][s]["reward/mean"] for s in range(1, STEPS + 1)]
    assert all(0 < r < 1 for r in rewards) and len(set(rewards)) > 1, rewards  # can fail
    return run


def _outputs(workdir) -> dict:
    """What a run leaves: the SFT stage's metrics and final parameters, the RL steps' metrics
    and the parameters of each saved step."""
    config = build_model_config(PolicySpec(), build_tokenizer(PolicySpec(), TaskSpec()))
    step, sft = run_dir.restore_params(str(workdir / "sft"), config)
    assert step == SFT_STEPS
    return {
        "sft": _metrics(workdir / "sft"),
        "metrics": _metrics(workdir),
        "params": _saved_params(workdir)
        | {"sft": {"/".join(map(str, k)): np.asarray(v) for k, v in nnx.to_flat_state(sft)}},
    }


def _timing(key: str) -> bool:
    """Logged values that follow the wall clock (or the threads' timing), not the computation."""
    return (
        key.split("/")[0] in ("time", "throughput", "host")
        or key in ("wall_time_s", "sync/gbps", "async/queue_depth")
        or key.startswith("async/overlap_fraction")
    )


def _differences(one: dict, two: dict) -> list[str]:
    """Where the run `two` is not bit for bit the run `one` (empty: it is)."""
    out = []
    for stage in ("sft", "metrics"):
        if sorted(one[stage]) != sorted(two[stage]):
            out.append(f"{stage}: steps {sorted(one[stage])} vs {sorted(two[stage])}")
            continue
        for step, record in one[stage].items():
            for key in sorted(set(record) | set(two[stage][step])):
                a, b = record.get(key), two[stage][step].get(key)
                if not _timing(key) and a != b:
                    out.append(f"{stage} step {step} {key}: {a!r} vs {b!r}")
    for saved, params in one["params"].items():
        for name, value in params.items():
            other = two["params"][saved][name]
            if value.dtype != other.dtype or not np.array_equal(value, other):
                out.append(f"params {saved} {name}: max gap {np.abs(other - value).max():.3g}")
    return out


def _ulp_off(run: dict, what: str) -> dict:
    """A copy of `run` with one value moved by the smallest step its dtype has."""
    run = copy.deepcopy(run)
    if what in ("sft", "loss"):
        records = run["sft"][SFT_STEPS] if what == "sft" else run["metrics"][STEPS - 1]
        records["loss"] = math.nextafter(records["loss"], math.inf)
    else:
        params = run["params"][SAVED[-1]]
        name = max(params, key=lambda k: params[k].size)
        params[name].flat[0] = np.nextafter(params[name].flat[0], np.float32(np.inf))
    return run


def _check_equal(one: dict, two: dict) -> None:
    compared = sum(len(r) for stage in ("sft", "metrics") for r in one[stage].values())
    leaves = sum(len(p) for p in one["params"].values())
    differences = _differences(one, two)
    print(f"role split vs one process: {compared} logged values, {leaves} parameter arrays; "
          f"{len(differences)} differ")  # fmt: skip
    assert differences == [], differences[:20]


def _stopped_within(result, ended: float) -> float:
    """Seconds from the fault's SIGKILL (announced on stdout) to the launcher's exit."""
    match = re.search(r"jaxrl\.faults: SIGKILL to process \d at unix time ([\d.]+)", result.stdout)
    assert match, result.stdout[-4000:]
    return ended - float(match.group(1))


def test_role_split_run_equals_one_process_and_waits_for_a_slow_generator(
    one_process, tmp_path, xla_cache
):
    workdir = tmp_path / "roles"
    result, _ = _cluster(workdir, xla_cache, extra=(SLOW,))
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert f"[0] [rl] step {STEPS}/{STEPS}" in output and "[1] [rl]" not in output
    two = _outputs(workdir)
    _check_equal(one_process, two)
    for what in ("sft", "loss", "params"):  # the comparison flags a value 1 ulp off
        assert len(_differences(one_process, _ulp_off(two, what))) == 1, what

    # The slow generator: the trainer waited for it and trained on the batch fixed lag names.
    records = [two["metrics"][s] for s in range(1, STEPS + 1)]
    for s, r in enumerate(records, start=1):
        assert r["data/batch_index"] == s - 1, (s, r["data/batch_index"])
        assert r["async/generator_version"] == max(s - 1 - LAG, 0), s
        assert r["async/staleness"] == min(s - 1, LAG) <= MAX_STALENESS, s
        assert r["time/reward_s"] >= 1.0, r["time/reward_s"]  # the injected sleep happened
    assert records[-1]["async/dropped_samples"] == 0
    idle = sum(r["time/trainer_idle_s"] for r in records[1:])
    print(f"trainer idle over steps 2-{STEPS}: {idle:.2f} s")
    assert idle > 0.5, idle


def test_generator_then_trainer_killed_and_relaunched_equals_one_process(
    one_process, tmp_path, xla_cache
):
    workdir = tmp_path / "roles"
    checkpoints = workdir / "checkpoints"
    # 1. The generator process dies after sending batch 3.
    killed, ended = _cluster(workdir, xla_cache, fault="kill_at_batch=3@1")
    output = killed.stdout + killed.stderr
    assert killed.returncode != 0, output[-4000:]
    assert "[local_cluster] process 1 exited with status 137;" in output, output[-4000:]
    seconds = _stopped_within(killed, ended)
    print(f"generator killed: the job ended {seconds:.1f} s later")
    assert seconds < STOP_WITHIN_S
    first = sorted(os.listdir(checkpoints)) if checkpoints.exists() else []
    assert first in ([], ["2"]), first  # step 2's save may or may not have committed

    # 2. Relaunched, it resumes; the trainer process dies after step 4 (its save committed).
    killed, ended = _cluster(workdir, xla_cache, fault="kill_at_step=4@0")
    output = killed.stdout + killed.stderr
    assert killed.returncode != 0, output[-4000:]
    if first:
        assert f"[0] [rl] resuming {workdir} from step 2" in output, output[-4000:]
    assert re.search(r"\[local_cluster\] process [01] exited with status (137|134|1);", output)
    seconds = _stopped_within(killed, ended)
    print(f"trainer killed: the job ended {seconds:.1f} s later")
    assert seconds < STOP_WITHIN_S
    assert "4" in os.listdir(checkpoints)

    # 3. Relaunched, it resumes from step 4, whose checkpoint holds batches 4 and 5 (sampled by
    # versions 2 and 3, which the restored trainer cannot regenerate), and finishes.
    resumed, _ = _cluster(workdir, xla_cache)
    output = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, output[-6000:]
    assert f"[0] [rl] resuming {workdir} from step 4" in output, output[-4000:]
    with Checkpointer(checkpoints, CheckpointConfig(), read_only=True) as ckpt:
        at_4, at_end = ckpt.read_extra(4), ckpt.read_extra(STEPS)
    assert [b["batch_index"] for b in at_4["pending_rollouts"]] == [4, 5]
    assert at_4["data_position"] == STEPS
    # Each batch trained exactly once over the three launches: 6 consumed, none dropped, and
    # step s trained batch s - 1.
    assert at_end["queue_stats"]["consumed_batches"] == STEPS, at_end["queue_stats"]
    assert at_end["queue_stats"]["dropped_samples"] == 0
    two = _outputs(workdir)
    assert [two["metrics"][s]["data/batch_index"] for s in range(1, STEPS + 1)] == list(
        range(STEPS)
    )
    _check_equal(one_process, two)

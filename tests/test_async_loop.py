"""The async loop end to end through `launch.rl` on configs/rl/arith_tiny.gin (trainer FSDP 2 x TP 2
on devices 0-3, generator 2 x TP 2 on devices 4-7): fixed-lag runs are reproducible bit for bit
and resume exactly after kills between and inside saves; a failing reward or generator ends the
run quickly, loudly, with the last checkpoint intact.

Subprocesses share a persistent XLA compilation cache (same programs, so only the first run
compiles; tests/procs.py); that changes no result, only the seconds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from procs import REPO, launch_env, launch_flags

from jaxrl.infra.metrics import read_metrics
from jaxrl.job import workdir as run_dir
from jaxrl.job.specs import PolicySpec, TaskSpec, build_model_config, build_tokenizer

CONFIG = os.path.join(REPO, "configs", "rl", "arith_tiny.gin")
MARK_ENV = "JAXRL_TEST_FAULT_MARK"
# Six steps of fixed-lag-2 async RL from random weights, saved (and kept) every 2 steps, no
# evaluation.
TINY = [
    "rl_main.sft = None",
    "rl_main.plot = False",  # no curves PNG (matplotlib): ~1 s a launch
    "TaskSpec.reward = 'rewards_for_tests:even_length'",
    "RLConfig.total_steps = 6",
    "RLConfig.num_prompts = 4",
    "RLConfig.samples_per_prompt = 4",
    "RLConfig.oversample = 1",
    "RLConfig.eval_size = 0",
    "RLConfig.save_every_steps = 2",
    "RLConfig.keep_last_n = 3",
    "RLConfig.lag = 2",
    "RLConfig.max_staleness = 2",
    "RLConfig.queue_size = 3",
    "OptimizerConfig.learning_rate = 1e-2",
    "OptimizerConfig.warmup_steps = 0",
]


def _start(
    workdir, cache, params=(), fault=None, entry=("-m", "launch.rl"), mark=None, config=CONFIG
):
    extra = {MARK_ENV: str(mark)} if mark else {}
    return subprocess.Popen(
        [sys.executable, *entry, *launch_flags(config, workdir, TINY + list(params))],
        cwd=REPO,
        env=launch_env(cache, fault, **extra),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(process) -> subprocess.CompletedProcess:
    """Waits for `process`; `.ended` is the wall-clock time it exited (as seen from here)."""
    stdout, stderr = process.communicate(timeout=600)
    result = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    result.ended = time.time()
    return result


def _run(workdir, cache, params=(), fault=None):
    return _finish(_start(workdir, cache, params, fault))


def _params(workdir, step=None):
    config = build_model_config(PolicySpec(), build_tokenizer(PolicySpec(), TaskSpec()))
    from flax import nnx

    step, state = run_dir.restore_params(str(workdir), config, step=step)
    return step, {"/".join(map(str, k)): np.asarray(v) for k, v in nnx.to_flat_state(state)}


def _extra(workdir, step):
    extra_dir = Path(workdir) / "checkpoints" / str(step) / "extra"
    return json.loads(next(p for p in extra_dir.iterdir() if p.suffix != ".txt").read_text())


def _last_records(workdir):
    by_step = {r["step"]: r for r in read_metrics(str(Path(workdir) / "metrics.jsonl"))}
    return [by_step[s] for s in sorted(by_step) if s > 0]


def test_fixed_lag_is_reproducible_and_resumes_exactly_after_kills(tmp_path, xla_cache):
    """A run killed after step 3 (step 2 saved), inside the save of step 4, and stopped by SIGTERM
    after step 3 (it saves step 4, exits 0), then rerun, ends bitwise equal to an uninterrupted
    run with the same seed, having trained batch k at step k + 1 exactly once: the batches
    sampled ahead by older versions came back from the checkpoint. Its first process, a fresh
    same-seed run, also matches the reference's step-2 checkpoint bit for bit, rollouts sampled
    ahead included."""
    reference = _run(tmp_path / "reference", xla_cache)
    assert reference.returncode == 0, reference.stderr[-3000:]
    run = tmp_path / "run"
    killed = _run(run, xla_cache, fault="kill_at_step=3")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["2"]
    _, ref_2 = _params(tmp_path / "reference", 2)
    _, run_2 = _params(run, 2)
    assert all(ref_2[k].tobytes() == run_2[k].tobytes() for k in ref_2)
    sampled = [  # batches 2 and 3, sampled ahead (timings aside)
        [(b["batch_index"], b["policy_version"], b["rollouts"]) for b in extra["pending_rollouts"]]
        for extra in (_extra(tmp_path / "reference", 2), _extra(run, 2))
    ]
    assert sampled[0][:2] == sampled[1][:2]
    # The step-2 checkpoint holds the batches sampled by versions older than 2 (lag 2: batches
    # 2 and 3, by versions 0 and 1) and where the generator stopped.
    extra = _extra(run, 2)
    pending = extra["pending_rollouts"]
    assert [b["batch_index"] for b in pending] == list(range(2, extra["data_position"]))
    assert [b["policy_version"] for b in pending] == [
        max(k - 2, 0) for k in range(2, 2 + len(pending))
    ]
    assert extra["data_position"] >= 4 and len(pending[0]["rollouts"]) == 16
    killed = _run(run, xla_cache, fault="kill_in_save=4")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert "from step 2" in killed.stdout
    assert (run / "checkpoints" / "4.orbax-checkpoint-tmp").exists()
    # SIGTERM after step 3 (a graceful stop): the run saves step 4 and exits 0.
    stopped = _run(run, xla_cache, fault="sigterm_at_step=3")
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert "from step 2" in stopped.stdout
    assert "stopped by SIGTERM after step 4" in stopped.stdout
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["2", "4"]
    resumed = _run(run, xla_cache)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "from step 4" in resumed.stdout

    _, ref = _params(tmp_path / "reference")
    step, params = _params(run)
    assert step == 6
    for name, value in ref.items():
        assert value.tobytes() == params[name].tobytes(), name
    _, at_4 = _params(run, 4)
    assert any(at_4[k].tobytes() != ref[k].tobytes() for k in ref)  # RL moved them
    for workdir in (tmp_path / "reference", run):
        records = _last_records(workdir)
        assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
        assert [r["data/batch_index"] for r in records] == [0, 1, 2, 3, 4, 5]
        assert [r["async/staleness"] for r in records] == [0, 1, 2, 2, 2, 2]
        assert records[-1]["async/dropped_samples"] == 0
        assert records[-1]["async/staleness_mean"] == pytest.approx(9 / 6)
        assert _extra(workdir, 6)["prompts_trained"] == 6 * 4


def test_sigterm_saves_the_current_step_and_exits_zero(tmp_path, xla_cache):
    """A real SIGTERM from outside while the run trains: it finishes the step, saves it with the
    async state, exits 0 within 30 s and says where the checkpoint is; the rerun resumes there
    (and stops gracefully again after its first step)."""
    run = tmp_path / "run"
    long = ["RLConfig.total_steps = 100", "RLConfig.save_every_steps = 1000"]
    process = _start(run, xla_cache, long)
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 300
    while not (metrics.exists() and any(r["step"] >= 2 for r in read_metrics(str(metrics)))):
        assert process.poll() is None and time.time() < deadline, process.stderr.read()[-3000:]
        time.sleep(0.1)
    sent = time.time()
    process.send_signal(signal.SIGTERM)
    stopped = _finish(process)
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert stopped.ended - sent < 30.0
    line = next(x for x in stopped.stdout.splitlines() if "stopped by SIGTERM after step" in x)
    step = int(line.split("after step ")[1].split(";")[0])
    assert 2 <= step < 100
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [str(step)]
    assert _extra(run, step)["data_position"] >= step + 2  # lag 2: batches sampled ahead kept
    resumed = _run(run, xla_cache, long[:1] + ["RLConfig.total_steps = " + str(step + 2)])
    assert resumed.returncode != 0  # a different config is refused, not silently mixed
    assert "holds a run with a different config" in resumed.stderr
    # The rerun resumes there; stopped again one step later (its 100 steps would add ~40 s).
    resumed = _run(run, xla_cache, long, fault=f"sigterm_at_step={step + 1}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"from step {step}" in resumed.stdout
    again = next(x for x in resumed.stdout.splitlines() if "stopped by SIGTERM after step" in x)
    assert step < int(again.split("after step ")[1].split(";")[0]) < 100, again


# --- faults ------------------------------------------------------------------------------------

_CALLS = {"reward": 0}


def reward_fails_at_batch_4(prompts, completions, references):
    """`even_length`, except that its fifth call (batch 4; evaluation is off) raises."""
    _CALLS["reward"] += 1
    if _CALLS["reward"] == 5:
        Path(os.environ[MARK_ENV]).write_text(repr(time.time()))
        raise RuntimeError("injected reward failure")
    return [float(len(c) % 2 == 0) for c in completions]


def launch_with_generator_fault() -> None:
    """`launch.rl` whose generator raises while sampling batch 4 (run in a subprocess)."""
    from jaxrl.generation.executor import GeneratorExecutor
    from jaxrl.infra.launcher import launch
    from launch.rl import rl_main

    generate = GeneratorExecutor.generate

    def failing(self, params, items, prompt_ids, policy_version, batch_index):
        if batch_index == 4:
            Path(os.environ[MARK_ENV]).write_text(repr(time.time()))
            raise RuntimeError("injected generator failure")
        return generate(self, params, items, prompt_ids, policy_version, batch_index)

    GeneratorExecutor.generate = failing
    launch(rl_main, sys.argv[1:])


def test_a_failing_reward_or_generator_ends_the_run_fast_with_its_traceback(tmp_path, xla_cache):
    """Batch 4 fails (lag 1), in the reward function of one run and in the generator of another
    (run side by side). The trainer, waiting at the step-4 save for batch 4, re-raises the
    original exception: non-zero exit within 10 s of the fault, and the step-2 checkpoint intact
    (nothing half written). The generator's fault shows its traceback through the failing
    function; the reward's, a user error, one line naming the reward's own line of code."""
    lag_1 = ["RLConfig.lag = 1", "RLConfig.max_staleness = 1"]
    reward = lag_1 + ["TaskSpec.reward = 'test_async_loop:reward_fails_at_batch_4'"]
    generator = ("-c", "import sys, test_async_loop as t; t.launch_with_generator_fault()")
    started = {
        "reward": _start(tmp_path / "reward", xla_cache, reward, mark=tmp_path / "reward.t"),
        "generator": _start(
            tmp_path / "generator", xla_cache, lag_1, entry=generator, mark=tmp_path / "generator.t"
        ),
    }
    expected = {
        "reward": [
            "reward error: reward 'test_async_loop:reward_fails_at_batch_4' raised RuntimeError: "
            "injected reward failure (batch 4) at ",
            'in reward_fails_at_batch_4: raise RuntimeError("injected reward failure"); raised in '
            "the generator thread at batch 4 (policy version 3); the run stops, its last "
            "checkpoint is intact (JAXRL_TRACEBACK=1 prints the full traceback)",
        ],
        "generator": [
            "RuntimeError: injected generator failure",
            "in failing",
            "Traceback",
            "raised in the generator thread at batch 4",
        ],
    }
    results = {}
    waiters = [
        threading.Thread(target=lambda w=w, p=p: results.__setitem__(w, _finish(p)))
        for w, p in started.items()
    ]
    for waiter in waiters:
        waiter.start()
    for waiter in waiters:
        waiter.join()
    for where, result in results.items():
        workdir = tmp_path / where
        assert result.returncode == 1, (where, result.returncode, result.stderr[-3000:])
        fault_time = float((tmp_path / f"{where}.t").read_text())
        assert result.ended - fault_time < 10.0, where
        for text in expected[where]:
            assert text in result.stderr, (where, result.stderr[-3000:])
        if where == "reward":
            assert "Traceback" not in result.stderr, result.stderr[-3000:]
        assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["2"], where
        step, params = _params(workdir)
        assert step == 2 and all(np.isfinite(v).all() for v in params.values()), where


# --- generator dtype ---------------------------------------------------------------------------


def test_generator_dtype_from_gin_casts_the_pushed_weights(tmp_path, xla_cache):
    """`GeneratorConfig.dtype = 'bfloat16'`: the generator samples from bf16 copies of the fp32
    trainer's weights, so even on-policy (lag 0) the trainer's log pi of the sampled tokens
    differs from the sampler's log mu by bf16 rounding (fp32 on both sides: <= 1e-5, the sync
    smoke test); a value that is not a dtype is refused by name."""
    from jaxrl.generation.placement import GeneratorConfig
    from launch.rl import rl_main

    refused = GeneratorConfig(dtype="float16")
    with pytest.raises(SystemExit, match="GeneratorConfig.dtype='float16'"):
        rl_main(str(tmp_path / "refused"), None, None, None, None, generator_config=refused)
    assert not (tmp_path / "refused").exists()
    on_policy = ["RLConfig.total_steps = 2", "RLConfig.lag = 0", "RLConfig.max_staleness = 0"]
    result = _run(tmp_path / "bf16", xla_cache, on_policy + ["GeneratorConfig.dtype = 'bfloat16'"])
    assert result.returncode == 0, result.stderr[-3000:]
    records = _last_records(tmp_path / "bf16")
    assert [r["async/staleness"] for r in records] == [0, 0]
    assert min(r["abs_log_ratio_max"] for r in records) > 1e-3, records

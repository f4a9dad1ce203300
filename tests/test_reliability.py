"""Rows of docs/RELIABILITY.md that no other test file covers: a non-finite loss (in `RunIO` and
in a real run), a stalled generator (`RLConfig.stall_timeout_s`), ENOSPC inside the Orbax writer,
and config / placement mistakes refused by `launch.rl` before any training."""

from __future__ import annotations

import errno
import math
import os
import threading
import time

import gin
import jax
import jax.numpy as jnp
import pytest

from jaxrl.infra import checkpoint as ckpt_lib
from jaxrl.infra.launcher import launch
from jaxrl.infra.metrics import read_metrics
from jaxrl.infra.run_io import NonFiniteLossError, RunIO
from jaxrl.train.trainer import TrainState

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _state(step: int, value: float) -> TrainState:
    return TrainState(
        step=jnp.int32(step), params={"w": jnp.full((4, 2), value)}, opt_state={"m": jnp.zeros(2)}
    )


def test_non_finite_loss_stops_naming_the_step_and_the_last_good_checkpoint(tmp_path):
    io = RunIO(str(tmp_path), total_steps=10, save_every_steps=1, keep_last_n=2, desc="rl")
    try:
        io.log(1, {"loss": 0.5}, {})
        io.save(_state(1, 1.0), {"step": 1})
        io.ckpt.wait_until_finished()
        for name in ("loss", "grad_norm"):
            with pytest.raises(
                NonFiniteLossError,
                match=rf"{name} is (nan|inf) at step 2; the last good checkpoint is step 1 in ",
            ):
                io.log(2, {"loss": 0.1, name: math.nan if name == "loss" else math.inf}, {})
    finally:
        io.close()
    assert io.ckpt.all_steps() == [1]


def test_enospc_in_the_checkpoint_writer_fails_loudly_and_leaves_the_last_save_intact(
    tmp_path, monkeypatch
):
    """The disk fills while step 2 is written: the error reaches the caller (the training loop,
    which exits with it), step 2 never counts as saved, and the next run cleans up and restores
    step 1."""
    from orbax.checkpoint._src.path import atomicity

    directory = tmp_path / "ckpt"
    config = ckpt_lib.CheckpointConfig(save_every_steps=1, keep_last_n=3)
    ckpt = ckpt_lib.Checkpointer(directory, config)
    ckpt.save(1, {"w": jnp.ones((4, 2))}, extra={"step": 1})
    ckpt.wait_until_finished()

    async def disk_full(self_):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", disk_full)
    with pytest.raises(Exception, match="No space left on device"):
        ckpt.save(2, {"w": jnp.zeros((4, 2))}, extra={"step": 2})
        ckpt.wait_until_finished()
    monkeypatch.undo()
    ckpt.close()
    with ckpt_lib.Checkpointer(directory, config) as fresh:
        assert fresh.all_steps() == [1]
        restored = fresh.restore(abstract_target=jax.eval_shape(lambda: {"w": jnp.ones((4, 2))}))
        assert restored.step == 1 and restored.extra == {"step": 1}
    assert sorted(p.name for p in directory.iterdir()) == ["1"]


def _launch_rl(workdir, *params, config="arith_tiny.gin"):
    from launch.rl import rl_main

    flags = ["--gin_file", os.path.join(REPO, "configs", "rl", config)]
    flags += ["--workdir", str(workdir)]
    for p in ("rl_main.sft = None", *params):
        flags += ["--gin_param", p]
    try:
        return launch(rl_main, flags)
    finally:
        gin.clear_config()


# A few tiny steps from random weights, on a reward a random policy varies on (so the first
# step has a gradient), evaluation off.
_TINY = (
    "TaskSpec.reward = 'rewards_for_tests:even_length'",
    "RLConfig.total_steps = 2",
    "RLConfig.num_prompts = 2",
    "RLConfig.samples_per_prompt = 4",
    "RLConfig.oversample = 1",
    "RLConfig.eval_size = 0",
    "RLConfig.save_every_steps = 1",
    "OptimizerConfig.warmup_steps = 0",
)


def test_a_real_run_whose_loss_turns_nan_stops_at_that_step(tmp_path):
    """A sync run at learning rate 1e30: step 1 is finite and saved, it throws the weights to
    ~1e30, and step 2's forward overflows. The run stops naming step 2 and checkpoint 1, and the
    non-finite state is never saved. With a KL term the frozen reference is the initial weights
    (the KL of step 1, before any update, is exactly 0)."""
    workdir = tmp_path / "run"
    diverging = ("OptimizerConfig.learning_rate = 1e30", "LossConfig.kl_coef = 0.1")
    expected = r"\[rl\] loss is nan at step 2; the last good checkpoint is step 1 in .*checkpoints"
    with pytest.raises(NonFiniteLossError, match=expected):
        _launch_rl(workdir, *_TINY, *diverging, config="arith_tiny_sync.gin")
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["1"]
    records = {r["step"]: r for r in read_metrics(str(workdir / "metrics.jsonl"))}
    assert sorted(records) == [0, 1, 2]
    assert math.isfinite(records[1]["loss"]) and records[1]["grad_norm"] > 0
    assert 0 <= records[1]["kl"] < 1e-9  # float rounding: two compiled forwards of one policy
    assert math.isnan(records[2]["loss"])


def test_a_stalled_generator_ends_the_run_after_stall_timeout_s(tmp_path, monkeypatch):
    """Async mode whose generator never returns batch 0: the trainer, waiting for it, gives up
    after `RLConfig.stall_timeout_s` (2 s here) with a TimeoutError naming what it waited for,
    and stops the generator thread on its way out; nothing is saved."""
    from jaxrl.generation.executor import GeneratorExecutor
    from jaxrl.loop.rollout_queue import RolloutQueue

    stall_s = 2.0
    released = threading.Event()
    waits = []  # (timeout, start, end) of each trainer wait for a batch

    def stalled_generate(self, *args):
        released.wait(60)  # until the run closes the queue (below); at most a minute
        raise RuntimeError("the stalled generator was released")

    def close_and_release(self, error=None, close=RolloutQueue.close):
        released.set()
        close(self, error)

    def timed_get(self, timeout=None, get=RolloutQueue.get):
        start = time.monotonic()
        try:
            return get(self, timeout)
        finally:
            waits.append((timeout, start, time.monotonic()))

    monkeypatch.setattr(GeneratorExecutor, "generate", stalled_generate)
    monkeypatch.setattr(RolloutQueue, "close", close_and_release)
    monkeypatch.setattr(RolloutQueue, "get", timed_get)
    with pytest.raises(TimeoutError, match="timed out waiting for a scored batch"):
        _launch_rl(tmp_path / "run", *_TINY, f"RLConfig.stall_timeout_s = {stall_s}")
    [(timeout, start, end)] = waits
    print(f"the trainer waited {end - start:.2f} s (stall_timeout_s = {stall_s})")
    assert timeout == stall_s and stall_s <= end - start < stall_s + 5
    assert released.is_set()  # the run closed the queue: the generator thread was stopped
    deadline = time.monotonic() + 10
    while any(t.name == "jaxrl-generator" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the generator thread is still running"
        time.sleep(0.01)
    checkpoints = tmp_path / "run" / "checkpoints"
    assert not checkpoints.exists() or not any(checkpoints.iterdir())


def test_rl_launch_refuses_bad_settings_before_training(tmp_path):
    workdir = tmp_path / "run"
    with pytest.raises(SystemExit, match=r"config error: .*lag=-1"):
        _launch_rl(workdir, "RLConfig.lag = -1")
    with pytest.raises(SystemExit, match=r"config error: .*max_staleness=1 < lag=2"):
        _launch_rl(workdir, "RLConfig.max_staleness = 1")
    # Placement: the trainer asks for devices [0, 16) of 8; the same workdir is reused after
    # each refusal (no checkpoint was written, so the fixed config takes it).
    with pytest.raises(
        SystemExit, match=r"^process layout error: the trainer mesh .* uses devices \[0, 16\)"
    ):
        _launch_rl(workdir, "trainer/MeshConfig.axis_sizes = (4, 4)",
                   "trainer/MeshConfig.num_devices = 16")  # fmt: skip
    with pytest.raises(SystemExit, match=r"async mode needs the generator's own devices"):
        _launch_rl(workdir, "rl_main.generator_mesh = None")
    with pytest.raises(ValueError, match=r"device \d+ is in both the 'trainer' and"):
        _launch_rl(workdir, "generator/MeshConfig.first_device = 2")
    assert not (workdir / "checkpoints").exists() or not any((workdir / "checkpoints").iterdir())

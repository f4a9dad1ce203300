"""Multi-turn episodes in the async schedules, through `launch.rl` on configs/rl/calc_tiny.gin
(shrunk: trainer and generator on one device each, an even-length reward that an untrained
policy varies on): a fixed-lag run, the config's SFT warm start (two steps) then RL, is
reproducible bit for bit and resumes bit for bit after a SIGKILL; a streaming run killed after a
save resumes and trains no episode group twice, and evaluates greedy episodes. Staleness figures
count sampled tokens only (observations carry version -1).

The runs share a persistent XLA compilation cache and one engine shape (slots, steps per
call), so that only the first run compiles most programs; that changes no result, only the
seconds."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest
from procs import REPO, run_launch

from jaxrl.infra.metrics import read_metrics
from jaxrl.job import workdir as run_dir
from jaxrl.loop.feeds.streaming import token_staleness_metrics
from jaxrl.loop.rollout_queue import prompt_ledger
from jaxrl.rl import Rollout

CONFIG = os.path.join(REPO, "configs", "rl", "calc_tiny.gin")
STEPS, PROMPTS, G = 4, 2, 4
TINY = [
    "TaskSpec.name = 'envs_for_tests:calculator_even_length'",
    "rl_main.episode_tool_workers = 0",  # steps inline: device calls of fixed shapes
    "rl_main.mesh = @trainer/MeshConfig()",
    "trainer/MeshConfig.axis_sizes = (1, 1)",
    "trainer/MeshConfig.num_devices = 1",
    "rl_main.generator_mesh = @generator/MeshConfig()",
    "generator/MeshConfig.axis_names = ('dp', 'tp')",
    "generator/MeshConfig.axis_sizes = (1, 1)",
    "generator/MeshConfig.first_device = 1",
    "generator/MeshConfig.num_devices = 1",
    f"GeneratorConfig.slots = {PROMPTS * G}",  # both schedules: the same engine programs
    "GeneratorConfig.steps_per_call = 4",
    "RLConfig.mode = 'async'",
    f"RLConfig.total_steps = {STEPS}",
    f"RLConfig.num_prompts = {PROMPTS}",
    f"RLConfig.samples_per_prompt = {G}",
    "RLConfig.eval_size = 0",
    "RLConfig.save_every_steps = 2",
    "RLConfig.keep_last_n = 3",
    "rl_main.plot = False",  # no curves PNG (matplotlib) in each of the five launches
    "OptimizerConfig.learning_rate = 1e-2",
    "OptimizerConfig.warmup_steps = 0",
]
FIXED_LAG = [
    "SFTConfig.steps = 2",  # the config's SFT warm start; under the kill's step 3 (its steps count)
    "SFTConfig.batch_size = 8",
    "SFTConfig.save_every_steps = 100",
    "SFTConfig.eval_size = 0",
    "RLConfig.schedule = 'fixed_lag'",
    "RLConfig.lag = 1",
    "RLConfig.max_staleness = 1",
    "RLConfig.queue_size = 1",
]
STREAMING = [
    "rl_main.sft = None",
    "RLConfig.schedule = 'streaming'",
    "RLConfig.max_staleness = 4",
    "RLConfig.queue_size = 1",
    "RLConfig.eval_size = 2",  # greedy episodes on the trainer's engine, at steps 0 and 4
    f"RLConfig.eval_every_steps = {STEPS}",
]


def _launch(workdir, cache, schedule, fault=None):
    return run_launch(CONFIG, workdir, TINY + schedule, cache, fault, timeout=900)


def _params(workdir, step=None) -> dict[str, np.ndarray]:
    from flax import nnx

    config, _ = run_dir.load_model_spec(str(workdir))
    _, state = run_dir.restore_params(str(workdir), config, step=step)
    return {"/".join(map(str, k)): np.asarray(v) for k, v in nnx.to_flat_state(state)}


def _extra(workdir, step) -> dict:
    extra_dir = Path(workdir) / "checkpoints" / str(step) / "extra"
    return json.loads(next(p for p in extra_dir.iterdir() if p.suffix != ".txt").read_text())


def _records(workdir) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(str(Path(workdir) / "metrics.jsonl"))}


# Figures of a step that are functions of the run (not of the clock).
EXACT = ("loss", "num_tokens", "reward/mean", "episode/turns_mean", "episode/sampled_tokens_mean")


def test_fixed_lag_episodes_are_reproducible_and_resume_bitwise_after_sigkill(tmp_path, xla_cache):
    """Two runs of one config, each the SFT warm start then RL on episodes: the uninterrupted
    reference, and one killed with SIGKILL after step 3 (step 2 saved, with the episodes batch 2
    sampled ahead by version 1) then rerun. Step 2 and the queued episodes are bitwise the
    reference's; the rerun resumes from step 2 (no second SFT stage) and ends with the
    reference's parameters and per-step figures bit for bit. The loss counts the episodes'
    sampled tokens only, and on-policy (step 1) the trainer's log-probs of the sampled tokens are
    the engine's: observations attended where the engine put them."""
    reference = _launch(tmp_path / "reference", xla_cache, FIXED_LAG)
    assert reference.returncode == 0, reference.stderr[-3000:]
    assert "SFT warm start" in reference.stdout
    sft = _records(tmp_path / "reference" / "sft")
    assert max(sft) == 2 and np.isfinite(sft[2]["loss"])
    assert (tmp_path / "reference" / "sft" / "checkpoints" / "2").is_dir()
    run = tmp_path / "run"
    killed = _launch(run, xla_cache, FIXED_LAG, fault="kill_at_step=3")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["2"]
    ref_2, run_2 = _params(tmp_path / "reference", 2), _params(run, 2)
    assert all(ref_2[k].tobytes() == run_2[k].tobytes() for k in ref_2)
    saved = [_extra(w, 2)["pending_rollouts"] for w in (tmp_path / "reference", run)]
    for batch in (b for pending in saved for b in pending):
        batch["metrics"] = {k: v for k, v in batch["metrics"].items() if not k.startswith("time/")}
    assert saved[0] == saved[1]  # the episodes sampled ahead, bit for bit
    pending = saved[1]
    assert [(b["batch_index"], b["policy_version"]) for b in pending] == [(2, 1)]
    rollouts = pending[0]["rollouts"]
    assert len(rollouts) == PROMPTS * G
    for r in rollouts:  # episodes, with their masks and per-token versions
        mask = np.asarray(r["loss_mask"])
        versions = np.asarray(r["token_versions"])
        assert len(mask) == len(versions) == len(r["completion_ids"])
        assert set(versions[mask]) == {1} and set(versions[~mask]) <= {-1}
    assert any(not all(r["loss_mask"]) for r in rollouts)  # some episode called the tool

    resumed = _launch(run, xla_cache, FIXED_LAG)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming" in resumed.stdout and "from step 2" in resumed.stdout
    assert "SFT warm start" not in resumed.stdout
    ref, params = _params(tmp_path / "reference"), _params(run)
    for name, value in ref.items():
        assert value.tobytes() == params[name].tobytes(), name
    assert any(ref_2[k].tobytes() != ref[k].tobytes() for k in ref)  # RL moved them
    a, b = _records(tmp_path / "reference"), _records(run)
    assert sorted(a) == sorted(b) == list(range(STEPS + 1))
    for step in range(1, STEPS + 1):
        assert a[step]["data/batch_index"] == b[step]["data/batch_index"] == step - 1
        assert a[step]["async/staleness"] == min(step - 1, 1)
        for key in EXACT:
            assert a[step][key] == b[step][key], (step, key)
        assert np.isfinite(a[step]["loss"]) and a[step]["episode/turns_mean"] >= 1
        # The loss counts the batch's sampled tokens (observations out).
        assert a[step]["num_tokens"] == round(a[step]["episode/sampled_tokens_mean"] * PROMPTS * G)
    assert a[1]["abs_log_ratio_max"] <= 1e-4  # on-policy, fp32
    rewards = {a[s]["reward/mean"] for s in a if s > 0}
    assert len(rewards) > 1 or 0 < rewards.pop() < 1  # the episodes' rewards varied


def test_streaming_episodes_resume_after_sigkill_without_training_a_group_twice(
    tmp_path, xla_cache
):
    """Killed with SIGKILL after step 3 (step 2 saved), then rerun to the end: it resumes from
    step 2, the groups the checkpoint held queued are trained first, and no prompt's episode
    group is trained twice; the checkpoints' ledgers name every issued prompt's fate exactly
    once. Per-token versions stay with the queued episodes, -1 on their observations."""
    run = tmp_path / "run"
    killed = _launch(run, xla_cache, STREAMING, fault="kill_at_step=3")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    saved = _extra(run, 2)
    assert (saved["schedule"], saved["prompts_trained"]) == ("streaming", 2 * PROMPTS)
    for group in saved["pending_groups"]:
        for r in group["rollouts"]:
            mask, versions = np.asarray(r["loss_mask"]), np.asarray(r["token_versions"])
            assert versions[mask].min() >= group["policy_version"] >= 0
            assert set(versions[~mask]) <= {-1}
    queued = [g["batch_index"] for g in saved["pending_groups"]]

    resumed = _launch(run, xla_cache, STREAMING)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming" in resumed.stdout and "from step 2" in resumed.stdout
    records = _records(run)
    assert sorted(records) == list(range(STEPS + 1))
    trained = {
        s: [int(records[s][f"stream/trained_prompt/{j}"]) for j in range(PROMPTS)]
        for s in range(1, STEPS + 1)
    }
    flat = [i for s in sorted(trained) for i in trained[s]]
    assert len(flat) == len(set(flat)) == STEPS * PROMPTS  # no episode group trained twice
    after = [i for s in range(3, STEPS + 1) for i in trained[s]]
    assert after[: len(queued)] == queued[: len(after)]  # the queued groups first
    for step in (2, STEPS):
        blob = _extra(run, step)
        ledger = prompt_ledger(blob)
        named = sorted(i for indices in ledger.values() for i in indices)
        assert named == list(range(blob["next_prompt"]))  # one fate each
        assert ledger["trained"] == sorted(i for s in range(1, step + 1) for i in trained[s])
    for s in range(1, STEPS + 1):
        assert records[s]["stream/token_staleness_max"] >= 0  # observations (-1) left out
        assert records[s]["episode/turns_mean"] >= 1
    for s in (0, STEPS):  # evaluated as episodes while the generator streams
        assert 0 <= records[s]["eval/tool_call_rate"] <= 1 and records[s]["eval/turns_mean"] >= 1
        assert 0 <= records[s]["eval/accuracy"] <= 1


def _rollout(versions, mask=None) -> Rollout:
    n = len(versions)
    return Rollout(
        prompt_ids=np.array([1]),
        completion_ids=np.arange(n),
        behaviour_logprobs=np.zeros(n, np.float32),
        policy_version=0,
        reward=0.0,
        group_id=0,
        token_versions=np.array(versions, np.int32),
        loss_mask=None if mask is None else np.array(mask, bool),
    )


def test_staleness_figures_count_sampled_tokens_only():
    """Observation tokens (version -1, loss mask False) are in no staleness figure; rows
    without a mask (single-turn) count every token."""
    episode = _rollout([3, 3, -1, -1, 4, 4, 4], [1, 1, 0, 0, 1, 1, 1])
    metrics, staleness = token_staleness_metrics([episode, _rollout([5, 5])], 5)
    assert sorted(staleness.tolist()) == [0, 0, 1, 1, 1, 2, 2]
    assert metrics["stream/token_staleness_max"] == 2.0
    assert metrics["stream/token_staleness_mean"] == pytest.approx(7 / 7)
    assert metrics["stream/mixed_version_rows"] == 0.5
    assert "stream/tokens_at_staleness/6" not in metrics  # 5 - (-1): an observation
    assert metrics["stream/tokens_at_staleness/2"] == 2.0
    # An episode whose only old-looking tokens are observations: no sampled token is stale.
    calm = _rollout([5, 5, -1, -1, 5], [1, 1, 0, 0, 1])
    metrics, _ = token_staleness_metrics([calm], 5)
    assert metrics["stream/token_staleness_max"] == 0.0
    assert metrics["stream/mixed_version_rows"] == 0.0

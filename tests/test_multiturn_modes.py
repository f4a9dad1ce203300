"""Multi-turn episodes in the async schedules, through `launch.rl` on configs/rl/calc_tiny.gin
(shrunk: no SFT, trainer and generator on one device each, an even-length reward that an
untrained policy varies on): a fixed-lag run is reproducible bit for bit and resumes bit for bit
after a SIGKILL; a streaming run killed after a save resumes and trains no episode group twice.
Staleness figures count sampled tokens only (observations carry version -1).

Subprocesses share a persistent XLA compilation cache (only the first run compiles); that
changes no result, only the seconds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import test_multiturn as episodes_tests  # its tiny model, engine and scripted environments
from flax import nnx

from jaxrl import workdir as run_dir
from jaxrl.generation.episodes import EpisodeRunner
from jaxrl.infra.metrics import read_metrics
from jaxrl.loop.feeds.streaming import token_staleness_metrics
from jaxrl.loop.rollout_queue import prompt_ledger
from jaxrl.rl import Rollout

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, "configs", "rl", "calc_tiny.gin")
STEPS, PROMPTS, G = 4, 2, 4
TINY = [
    "rl_main.sft = None",
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
    "RLConfig.mode = 'async'",
    f"RLConfig.total_steps = {STEPS}",
    f"RLConfig.num_prompts = {PROMPTS}",
    f"RLConfig.samples_per_prompt = {G}",
    "RLConfig.eval_size = 0",
    "RLConfig.save_every_steps = 2",
    "RLConfig.keep_last_n = 3",
    "OptimizerConfig.learning_rate = 1e-2",
    "OptimizerConfig.warmup_steps = 0",
]
FIXED_LAG = [
    "RLConfig.schedule = 'fixed_lag'",
    "RLConfig.lag = 1",
    "RLConfig.max_staleness = 1",
    "RLConfig.queue_size = 1",
]
STREAMING = [
    "RLConfig.schedule = 'streaming'",
    "RLConfig.max_staleness = 4",
    "RLConfig.queue_size = 1",
    f"rl_main.engine_slots = {PROMPTS * G}",
    "rl_main.engine_steps_per_call = 4",
    "RLConfig.eval_size = 2",  # greedy episodes on the trainer's engine, at steps 0 and 4
    f"RLConfig.eval_every_steps = {STEPS}",
]


@pytest.fixture(scope="module")
def xla_cache(tmp_path_factory):
    return str(tmp_path_factory.getbasetemp() / "multiturn_modes_xla_cache")


def _launch(workdir, cache, schedule, fault=None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "JAXRL_FAULT"}
    env["PYTHONPATH"] = os.pathsep.join([REPO, os.path.join(REPO, "tests")])
    env["JAX_COMPILATION_CACHE_DIR"] = cache
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    if fault:
        env["JAXRL_FAULT"] = fault
    flags = ["--gin_file", CONFIG, "--workdir", str(workdir)]
    for p in TINY + schedule:
        flags += ["--gin_param", p]
    return subprocess.run(
        [sys.executable, "-m", "launch.rl", *flags],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip


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
    """Two runs of one config: the uninterrupted reference, and one killed with SIGKILL after
    step 3 (step 2 saved, with the episodes batch 2 sampled ahead by version 1) then rerun. Step 2
    and the queued episodes are bitwise the reference's; the rerun resumes from step 2 and ends
    with the reference's parameters and per-step figures bit for bit."""
    reference = _launch(tmp_path / "reference", xla_cache, FIXED_LAG)
    assert reference.returncode == 0, reference.stderr[-3000:]
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


@pytest.fixture(scope="module")
def engine4():
    model = episodes_tests.Transformer(episodes_tests.CONFIG, rngs=nnx.Rngs(0), init_std=0.3)
    return episodes_tests._engine(model, 4)


def test_streamed_episodes_join_the_running_batch_and_span_versions(engine4):
    """`EpisodeRunner.stream` (the streaming generator's driver): groups started between its
    yields join the running engine and get the tokens and turns they get in one `run` call (the
    noise is a function of episode, turn, sample and token only); with a new version before
    every device call, episodes span versions and each sampled token records its own
    (observations -1)."""
    engine, params = engine4
    t = episodes_tests
    runner = EpisodeRunner(engine, t.SAMPLING, t.BUDGET, tool_workers=0)
    whole = t._run(engine, params, t._groups(), tool_workers=0)

    def bump(version):
        return version + 1, params

    groups = t._groups()
    for group in groups[:2]:
        runner.start(group)
    streamed, waiting = [], list(groups[2:])
    for trajectories in runner.stream(params, jax.random.key(0), update=bump):
        streamed.append(trajectories)
        if waiting:  # one more group joins after each finished one
            runner.start(waiting.pop(0))
    assert sorted(ts[0].episode for ts in streamed) == list(range(t.NUM_GROUPS))
    by_episode = {ts[0].episode: ts for ts in streamed}
    spanning = 0
    for ts in whole:
        for w in ts:
            s = by_episode[w.episode][w.sample]
            assert (s.tokens, s.loss_mask, s.turns, s.status) == (
                w.tokens, w.loss_mask, w.turns, w.status,
            )  # fmt: skip
            versions, mask = np.asarray(s.token_versions), np.asarray(s.loss_mask)
            assert np.all(versions[~mask] == -1) and np.all(versions[mask] >= 0)
            assert np.all(np.diff(versions[mask]) >= 0)  # in sampling order
            spanning += len(set(versions[mask])) > 1
    assert spanning > 0

"""The streaming schedule end to end through `launch.rl` (configs/rl/chain_tiny_streaming.gin,
shrunk): a run killed with SIGKILL after step 3 (step 2 saved) and relaunched resumes from step 2,
trains no group twice, trains the groups the checkpoint held queued first, re-issues the prompts
that were in flight, and its counts add up (trained + queued + in flight + dropped = issued).

Subprocesses share a persistent XLA compilation cache (only the first run compiles)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from jaxrl.infra.metrics import read_metrics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, "configs", "rl", "chain_tiny_streaming.gin")
STEPS, PROMPTS = 6, 4
TINY = [
    "rl_main.sft = None",
    "TaskSpec.reward = 'rewards_for_tests:even_length'",
    f"RLConfig.total_steps = {STEPS}",
    f"RLConfig.num_prompts = {PROMPTS}",
    "RLConfig.samples_per_prompt = 4",
    "RLConfig.max_new_tokens = 12",
    "RLConfig.eval_size = 0",
    "RLConfig.save_every_steps = 2",
    "RLConfig.keep_last_n = 4",
    "RLConfig.max_staleness = 8",  # > STEPS: nothing is dropped, so the ledger is exact
    "RLConfig.oversample = 1",  # nor left out by dynamic sampling (tests/test_streaming_queue.py)
    "RLConfig.queue_size = 2",
    "rl_main.engine_slots = 16",
    "rl_main.engine_steps_per_call = 4",
    "rl_main.engine_precompile = False",  # tests/test_generation_engine.py covers it
    "OptimizerConfig.learning_rate = 1e-2",
    "OptimizerConfig.warmup_steps = 0",
]


def _run(workdir, cache, fault=None):
    env = {k: v for k, v in os.environ.items() if k != "JAXRL_FAULT"}
    env["PYTHONPATH"] = os.pathsep.join([REPO, os.path.join(REPO, "tests")])
    env["JAX_COMPILATION_CACHE_DIR"] = cache
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    if fault:
        env["JAXRL_FAULT"] = fault
    flags = ["--gin_file", CONFIG, "--workdir", str(workdir)]
    for p in TINY:
        flags += ["--gin_param", p]
    return subprocess.run(
        [sys.executable, "-m", "launch.rl", *flags],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def _extra(workdir, step):
    extra_dir = Path(workdir) / "checkpoints" / str(step) / "extra"
    return json.loads(next(p for p in extra_dir.iterdir() if p.suffix != ".txt").read_text())


def _trained(record) -> list[int]:
    return [int(record[f"stream/trained_prompt/{j}"]) for j in range(PROMPTS)]


def test_streaming_resumes_after_kill_without_training_a_group_twice(tmp_path):
    cache = str(tmp_path / "xla_cache")
    run = tmp_path / "run"
    killed = _run(run, cache, fault="kill_at_step=3")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["2"]
    saved = _extra(run, 2)
    assert (saved["mode"], saved["schedule"], saved["prompts_trained"]) == (
        "async", "streaming", 2 * PROMPTS,
    )  # fmt: skip
    queued = [g["batch_index"] for g in saved["pending_groups"]]
    in_flight = saved["in_flight_prompts"]
    # Per-token versions travel with the queued groups.
    for group in saved["pending_groups"]:
        for r in group["rollouts"]:
            assert len(r["token_versions"]) == len(r["completion_ids"])
            assert min(r["token_versions"]) == group["policy_version"]

    resumed = _run(run, cache)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming" in resumed.stdout and "from step 2" in resumed.stdout
    by_step = {r["step"]: r for r in read_metrics(str(run / "metrics.jsonl"))}
    assert sorted(by_step) == list(range(STEPS + 1))  # the redone step 3 logged once
    trained = {s: _trained(by_step[s]) for s in range(1, STEPS + 1)}
    flat = [i for s in sorted(trained) for i in trained[s]]
    assert len(flat) == len(set(flat)) == STEPS * PROMPTS  # no group trained twice
    before = set(trained[1] + trained[2])
    assert before.isdisjoint(queued) and before.isdisjoint(in_flight)
    assert all(i < saved["next_prompt"] for i in before)
    # The checkpoint's queued groups come first after the resume (FIFO, none stale).
    after = [i for s in range(3, STEPS + 1) for i in trained[s]]
    assert after[: len(queued)] == queued
    # Counts add up at the end: every issued prompt is trained, queued or in flight (none was
    # dropped: max_staleness exceeds the run), and the queue's counts continue across the kill.
    final = _extra(run, STEPS)
    left = [g["batch_index"] for g in final["pending_groups"]] + final["in_flight_prompts"]
    stats = final["queue_stats"]
    assert stats["dropped_on_admission"] == stats["dropped_on_consumption"] == 0
    assert sorted(flat + left) == list(range(final["next_prompt"]))
    assert stats["consumed_batches"] == STEPS * PROMPTS
    assert final["prompts_trained"] == STEPS * PROMPTS
    # The prompts in flight at the kill were re-issued: trained after the resume, or still open.
    assert set(in_flight) <= set(after) | set(left)

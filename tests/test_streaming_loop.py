"""The streaming schedule end to end through `launch.rl` (configs/rl/chain_tiny_streaming.gin,
shrunk, with dynamic sampling and a staleness bound that drop and filter groups): a run killed
with SIGKILL after step 3 (step 2 saved), relaunched and killed after step 5 (step 4 saved), then
relaunched to the end, resumes each time from its checkpoint, trains no group twice, trains the
groups the checkpoint held queued first, re-issues the prompts that were in flight, and its
ledger accounts for every issued prompt by index: trained, queued, in flight, dropped or
filtered, exactly one of them at every checkpoint, each fate kept across the kills, the trained
ones those the steps logged.

Subprocesses share a persistent XLA compilation cache (only the first run compiles;
tests/procs.py)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from procs import REPO, run_launch

from jaxrl.infra.metrics import read_metrics
from jaxrl.loop.rollout_queue import prompt_ledger

CONFIG = os.path.join(REPO, "configs", "rl", "chain_tiny_streaming.gin")
STEPS, PROMPTS = 6, 4
TINY = [
    "rl_main.sft = None",
    "rl_main.plot = False",  # no curves PNG (matplotlib): ~1 s a launch
    "TaskSpec.reward = 'rewards_for_tests:even_length'",
    f"RLConfig.total_steps = {STEPS}",
    f"RLConfig.num_prompts = {PROMPTS}",
    "RLConfig.samples_per_prompt = 2",  # a group of one reward is common: filtered
    "RLConfig.max_new_tokens = 12",
    "RLConfig.eval_size = 0",
    "RLConfig.save_every_steps = 2",
    "RLConfig.keep_last_n = 4",
    "RLConfig.max_staleness = 0",  # a group waiting in the queue over a step is dropped
    "RLConfig.oversample = 2",  # dynamic sampling (tests/test_streaming_queue.py)
    "RLConfig.queue_size = 2",
    "GeneratorConfig.slots = 8",
    "GeneratorConfig.steps_per_call = 4",
    "GeneratorConfig.precompile = False",  # tests/test_generation_engine.py covers it
    "OptimizerConfig.learning_rate = 1e-2",
    "OptimizerConfig.warmup_steps = 0",
]


def _run(workdir, cache, fault=None):
    return run_launch(CONFIG, workdir, TINY, cache, fault)


def _extra(workdir, step):
    extra_dir = Path(workdir) / "checkpoints" / str(step) / "extra"
    return json.loads(next(p for p in extra_dir.iterdir() if p.suffix != ".txt").read_text())


def _trained(record) -> list[int]:
    return [int(record[f"stream/trained_prompt/{j}"]) for j in range(PROMPTS)]


def _check_ledger(blob: dict, trained: list[int]) -> dict[str, list[int]]:
    """The checkpoint's ledger, checked: each issued prompt has exactly one fate, the counts
    agree with the names, and the trained prompts are `trained` (the logged steps')."""
    ledger = prompt_ledger(blob)
    named = [i for indices in ledger.values() for i in indices]
    assert sorted(named) == list(range(blob["next_prompt"])), ledger  # exactly one fate each
    stats = blob["queue_stats"]
    assert len(ledger["dropped"]) == stats["dropped_on_admission"] + stats["dropped_on_consumption"]
    assert len(ledger["filtered"]) == stats["filtered_batches"]
    assert len(ledger["trained"]) == stats["consumed_batches"] == blob["prompts_trained"]
    assert ledger["trained"] == sorted(trained)
    return ledger


def test_streaming_resumes_after_kills_and_accounts_for_every_prompt(tmp_path, xla_cache):
    cache = xla_cache
    run = tmp_path / "run"
    killed = _run(run, cache, fault="kill_at_step=3")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["2"]
    saved = _extra(run, 2)
    assert (saved["mode"], saved["schedule"], saved["prompts_trained"]) == (
        "async", "streaming", 2 * PROMPTS,
    )  # fmt: skip
    queued = [g["batch_index"] for g in saved["pending_groups"]]
    # Per-token versions travel with the queued groups.
    for group in saved["pending_groups"]:
        for r in group["rollouts"]:
            assert len(r["token_versions"]) == len(r["completion_ids"])
            assert min(r["token_versions"]) == group["policy_version"]

    killed = _run(run, cache, fault="kill_at_step=5")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert "resuming" in killed.stdout and "from step 2" in killed.stdout
    resumed = _run(run, cache)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming" in resumed.stdout and "from step 4" in resumed.stdout
    by_step = {r["step"]: r for r in read_metrics(str(run / "metrics.jsonl"))}
    assert sorted(by_step) == list(range(STEPS + 1))  # the redone steps logged once
    trained = {s: _trained(by_step[s]) for s in range(1, STEPS + 1)}
    flat = [i for s in sorted(trained) for i in trained[s]]
    assert len(flat) == len(set(flat)) == STEPS * PROMPTS  # no group trained twice
    # The checkpoint's queued groups come first after the resume (FIFO), those not dropped.
    after = [i for s in range(3, STEPS + 1) for i in trained[s]]
    fresh = [i for i in queued if i in after]
    assert after[: len(fresh)] == fresh

    # Prompt by prompt, at each checkpoint and across the kills.
    ledgers = {
        s: _check_ledger(_extra(run, s), [i for t in range(1, s + 1) for i in trained[t]])
        for s in (2, 4, STEPS)
    }
    for a, b in ((2, 4), (4, STEPS)):
        for fate in ("trained", "dropped", "filtered"):  # final: kept by every later one
            assert set(ledgers[a][fate]) <= set(ledgers[b][fate]), (a, b, fate)
        # A queued group is never sampled again: trained or dropped later, or still queued.
        later = ledgers[b]["trained"] + ledgers[b]["dropped"] + ledgers[b]["queued"]
        assert set(ledgers[a]["queued"]) <= set(later), (a, b)
    final = ledgers[STEPS]
    print({fate: len(indices) for fate, indices in final.items()})
    assert final["dropped"] and final["filtered"], final  # both kinds occurred and are named

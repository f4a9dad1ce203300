"""The control knobs of the multi-turn learning bench (`python -m bench learning calc`): the
calculator with its tool disabled (`TaskSpec.tool_disabled`: every call answered `=?`) and the loss
mask removed (`Trajectory.to_rollout(mask_observations=False)`, `rl_main.mask_observations`, which
reaches `EpisodeFeed`'s rollouts). No model runs: the feed's episode runner is replaced by a
scripted one."""

from __future__ import annotations

import types

import numpy as np

from jaxrl.generation.episodes import EpisodeBudget, Trajectory
from jaxrl.generation.sampling import SamplingConfig
from jaxrl.job.specs import TaskSpec, build_source
from jaxrl.loop.config import RLConfig
from jaxrl.loop.feeds.episodes import episode_feed
from jaxrl.tasks.tokenizer import build_arithmetic_tokenizer


def _call_and_answer(tokenizer, source, item_index: int = 0):
    """The observation the environment gives for the right call of train item `item_index`."""
    a, b = source.task.operands(item_index, "train")
    env = source.make_env()
    env.reset(source.item(item_index))
    step = env.step(tokenizer.encode(f"({a}*{b})", add_special_tokens=False))
    return tokenizer.decode(step.observation), step.status, a * b


def test_tool_disabled_answers_every_call_with_a_question_mark_and_keeps_the_demonstrations():
    tokenizer = build_arithmetic_tokenizer()
    on = build_source(
        TaskSpec(name="calculator", operators="*", min_digits=2, max_digits=2), tokenizer
    )
    off = build_source(
        TaskSpec(name="calculator", operators="*", min_digits=2, max_digits=2, tool_disabled=True),
        tokenizer,
    )
    text, status, product = _call_and_answer(tokenizer, on)
    assert (text, status) == (f"={product}", "ok")
    text, status, _ = _call_and_answer(tokenizer, off)
    assert (text, status) == ("=?", "ok")
    assert on.make_env(disabled=True).disabled and not off.make_env(disabled=False).disabled
    # Same problems, same SFT demonstrations: only the environment's replies differ.
    assert [on.item(i) for i in range(8)] == [off.item(i) for i in range(8)]
    for x, y in zip(
        on.demonstrations(0, 16, tokenizer, 32),
        off.demonstrations(0, 16, tokenizer, 32),
        strict=True,
    ):
        np.testing.assert_array_equal(x, y)


def _trajectory(group_id: int = 0) -> Trajectory:
    """`(12*34)` sampled, `=408` observed, `408<eos>` sampled (ids are arbitrary here)."""
    t = Trajectory(0, 0, group_id, (1, 5, 6))
    for ids, sampled, version in (([10, 11, 12], True, 3), ([20, 21], False, -1), ([30], True, 4)):
        t.tokens += ids
        t.loss_mask += [sampled] * len(ids)
        t.behaviour_logprobs += [-0.5 if sampled else 0.0] * len(ids)
        t.token_versions += [version] * len(ids)
    t.reward, t.status = 1.0, "done"
    return t


def test_to_rollout_without_the_observation_mask_trains_every_token():
    masked = _trajectory().to_rollout()
    unmasked = _trajectory().to_rollout(mask_observations=False)
    assert masked.loss_mask.tolist() == [True, True, True, False, False, True]
    assert unmasked.loss_mask.tolist() == [True] * 6
    for r in (masked, unmasked):  # the rest is the same: ids, placeholders, oldest sampled version
        assert r.completion_ids.tolist() == [10, 11, 12, 20, 21, 30]
        assert r.behaviour_logprobs.tolist() == [-0.5, -0.5, -0.5, 0.0, 0.0, -0.5]
        assert r.policy_version == 3 and r.reward == 1.0


def _fake_controller(num_prompts: int = 2, g: int = 2):
    """What `EpisodeFeed` reads of a controller: its config, the engine, prompts, buckets."""
    config = RLConfig(mode="sync", num_prompts=num_prompts, samples_per_prompt=g, max_new_tokens=16)
    engine = types.SimpleNamespace(eos_ids=(2,))
    sampler = types.SimpleNamespace(engine=engine, prompt_buckets=(8, 16))
    generator = types.SimpleNamespace(sampler=sampler, sampling=SamplingConfig(16))
    items = [types.SimpleNamespace(text=f"p{j}") for j in range(num_prompts)]
    return types.SimpleNamespace(
        config=config,
        generator=generator,
        prompts=lambda step: (items, None),
        prompt_bucket=lambda ids: 8,
    )


def test_episode_feed_passes_the_mask_switch_to_its_rollouts():
    source = types.SimpleNamespace(make_env=lambda: None, stop_ids=(7,))
    budget = EpisodeBudget(max_turns=3, max_turn_tokens=4, max_total_tokens=16)
    trained = {}
    for mask in (True, False):
        ctl = _fake_controller()
        feed = episode_feed(source, budget, tool_workers=0, mask_observations=mask)(ctl)
        assert 7 in feed.runner.sampling.stop_ids
        feed.runner.run = lambda params, key, groups, version: [
            [_trajectory(g.group_id) for _ in g.envs] for g in groups
        ]
        taken = feed.take(0, params=None)
        feed.stop(failed=False)
        assert len(taken.rollouts) == 4
        trained[mask] = {tuple(r.loss_mask.tolist()) for r in taken.rollouts}
    assert trained[True] == {(True, True, True, False, False, True)}
    assert trained[False] == {(True,) * 6}


def test_learning_bench_summary_finds_when_the_targets_are_first_met(tmp_path):
    """bench/learning/calc.py's row of a run: the first evaluation with tool-call rate >= 90%
    and accuracy >= start + 40 points, and the probe's pattern of a self-written value."""
    import json

    from bench.learning.calc import WRITES_OUTPUT, summarise

    evals = [(0, 100.0, 0.0, 0.05), (25, 130.0, 0.95, 0.40), (50, 160.0, 0.92, 0.50)]
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for step, wall, tool, accuracy in evals:
            record = {"step": step, "wall_time_s": wall, "eval/accuracy": accuracy}
            record |= {"eval/tool_call_rate": tool} | ({"reward/mean": 0.5} if step else {})
            f.write(json.dumps(record) + "\n")
    row = summarise("rl", "RL", str(tmp_path))
    assert (row["target_step"], row["target_s"], row["gain_pts"]) == (50, 60.0, 45.0)
    assert (row["steps"], row["tool_start"], row["acc_end"]) == (50, 0.0, 0.5)
    assert WRITES_OUTPUT.search("(37*48)=1776").group(1) == "1776"
    assert WRITES_OUTPUT.search("(37*48)*7))2") is None

"""bench.multiturn's scripted workload (`--turn_tokens`): what docs/multiturn.md says it is."""

from __future__ import annotations

import argparse

from bench.multiturn import scripted_workload


def test_scripted_workload_has_its_turns_replies_and_stop_share():
    args = argparse.Namespace(turn_tokens=32, turns=3, observation_tokens=8, prompts=2)
    work = scripted_workload("arith_tiny", args)
    vocab = work.model.config.vocab_size
    assert vocab == 512 and work.stop_ids == tuple(range(512 - 16, 512))  # P(stop) ~ 1 / 32
    assert work.budget.max_turns == 3 and work.budget.max_turn_tokens == 96
    assert all(0 < t < work.stop_ids[0] for p in work.prompts for t in p)
    env = work.make_env(1)
    assert tuple(env.reset(work.items[1])) == work.prompts[1] != work.prompts[0]
    steps = [env.step([5, work.stop_ids[0]]) for _ in range(3)]
    assert [s.done for s in steps] == [False, False, True]
    assert len(steps[0].observation) == 8 and steps[0].observation == steps[1].observation

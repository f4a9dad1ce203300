"""`bench.peers.workload`: the prompts and rewards every side of the peer benchmarks shares."""

import pytest

from bench.peers import workload


def test_tiny_prompts_are_reproducible_and_in_range():
    a = workload.tiny_prompt_ids(3, 8)
    assert a == workload.tiny_prompt_ids(3, 8)
    assert a != workload.tiny_prompt_ids(4, 8)
    assert len(a) == 8 and all(len(p) == 16 and min(p) >= 3 and max(p) < 512 for p in a)
    texts = workload.tiny_prompt_texts(3, 8)
    assert [[int(t) for t in s.split()] for s in texts] == a


def test_rewards():
    assert workload.even_ids(["2 4 5 7", "", "6"]) == [0.5, 0.0, 1.0]
    messages, answers = workload.smol_messages(0, 3)
    assert len(messages) == 3 and messages[0][0]["role"] == "user"
    q = messages[0][0]["content"]
    a, op, b = q.split("?")[0].split()[-3:]
    assert answers[0] == str(arith(int(a), op, int(b)))
    completions = [f"so the answer is {answers[0]}", "it is 1,000,000", "no idea"]
    assert workload.arithmetic_correct(completions, [answers[0], "1000000", "3"]) == [1, 1, 0]


def arith(a, op, b):
    return {"+": a + b, "-": a - b, "*": a * b}[op]


def test_summary_skips_warmup_and_overrides():
    steps = [dict(step_s=10.0, generate_s=4.0, train_s=6.0)] + [
        dict(step_s=1.0 + i, generate_s=0.5, train_s=0.5 + i) for i in range(3)
    ]
    row = workload.summarise(steps, warmup=1)
    assert row["step_s"] == 2.0 and row["train_s"] == 1.5 and row["first_step_s"] == 10.0
    shape = workload.shape("smol", samples=4, new_tokens=0)
    assert (shape.samples, shape.new_tokens, shape.rows) == (4, 128, 16)
    with pytest.raises(SystemExit, match="unknown shape"):
        workload.shape("huge")


def test_rl_step_sides_with_shared_prompts():
    import argparse

    from bench.peers.rl_step import side_commands

    args = argparse.Namespace(
        steps=3, shape_name="smol", num_prompts=0, samples=0, new_tokens=0, pack_length=576,
        smoke=False, tunix_python="", trl_python="/venv/bin/python", sides="",
    )  # fmt: skip
    sides = side_commands(args, "/m")
    assert list(sides) == ["library", "library_shared", "trl"]
    assert sides["library_shared"][2][-2:] == ["--pack_length", "576"]
    assert "--pack_length" not in sides["library"][2]
    args.pack_length = 0
    assert "library_shared" not in side_commands(args, "/m")

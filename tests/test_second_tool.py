"""A second multi-turn tool written as a user would (examples/capital_tool.py: a country ->
capital lookup, through `jaxrl.env.base.Step`, `register_task` and `register_reward` only): its
bounded parser and environment on their own; the episode driver on it with a model that never
closes a call (the turn budget truncates it, the tool is never stepped) and one that closes
every call; and examples/capital_tool.gin through `launch.rl` in-process for two RL steps, the
tool answering calls (its tally and the episode metrics). The calculator's own checks:
tests/test_multiturn.py."""

from __future__ import annotations

import importlib
import math
import os
import sys

import gin
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jaxrl.env.base import Step
from jaxrl.generation.engine import Engine
from jaxrl.generation.episodes import EpisodeBudget, EpisodeGroup, EpisodeRunner
from jaxrl.generation.sampling import SamplingConfig
from jaxrl.infra.metrics import read_metrics
from jaxrl.job.specs import TaskSpec, chain_tiny
from jaxrl.models.transformer import Transformer
from jaxrl.tasks.rewards import get_reward
from jaxrl.tasks.source import get_task
from jaxrl.tasks.tokenizer import build_arithmetic_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(REPO, "examples")
CONFIG = os.path.join(EXAMPLES, "capital_tool.gin")


@pytest.fixture(scope="module")
def tool():
    """examples/capital_tool.py, imported as the gin file's `import capital_tool` imports it
    (examples/ on sys.path, as PYTHONPATH=examples does for the command line)."""
    added = EXAMPLES not in sys.path
    if added:
        sys.path.insert(0, EXAMPLES)
    try:
        yield importlib.import_module("capital_tool")
    finally:
        if added:
            sys.path.remove(EXAMPLES)


@pytest.fixture(scope="module")
def tokenizer():
    return build_arithmetic_tokenizer()


def _enc(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_parser_reads_calls_and_refuses_everything_else(tool):
    assert tool.parse_call("ask peru?") == "peru"
    assert tool.parse_call("hmm ask new zealand?") == "new zealand"  # the last `ask ` counts
    assert tool.parse_call("ask x ask chile?") == "chile"
    bad = [
        "peru?",  # no `ask `
        "ask peru",  # not closed
        "ask ?",  # empty name
        "ask peru ?",  # trailing space
        "ask  peru?",  # double space
        "ask per7u?",  # digits
        "ask __import__('os')?",  # code is text like any other
        "ask " + "a" * (tool.MAX_KEY_CHARS + 1) + "?",  # overlong
    ]
    for text in bad:
        with pytest.raises(tool.CallError):
            tool.parse_call(text)
    assert tool.lookup("peru") == "lima" and tool.lookup("narnia") is None


def test_environment_answers_calls_and_scores_the_answer(tool, tokenizer):
    vocab = tokenizer.get_vocab()
    for name in [*tool.CAPITALS, *tool.CAPITALS.values()]:
        assert all(ch in vocab for ch in name), name  # no <unk> in prompts or replies
    source = get_task("capitals")(_spec(), tokenizer)
    assert source.stop_ids == (tokenizer.convert_tokens_to_ids("?"),)
    assert not set(source.heldout) & set(source.train) and len(source.heldout) == 8
    assert {source.item(i).text for i in range(200)} <= {f"capital of {c}:" for c in source.train}
    item = source.item(0)
    env = source.make_env()
    assert tokenizer.decode(env.reset(item)) == f"<bos>{item.text}"
    before = tool.calls_by_status()

    def reply(text):
        step = env.step(_enc(tokenizer, text))
        return tokenizer.decode(step.observation), step.done, step.status

    assert reply("ask peru?") == ("=lima", False, "ok")
    assert reply("ask new zealand?") == ("=wellington", False, "ok")
    for malformed in ["peru?", "ask 12?", "ask (1*2)?", "?"]:
        assert reply(malformed) == ("=error", False, "malformed")
    assert reply("ask narnia?") == ("=unknown", False, "unknown_key")
    after = tool.calls_by_status()
    assert {k: after.get(k, 0) - before.get(k, 0) for k in after} == {
        "ok": 2,
        "malformed": 4,
        "unknown_key": 1,
    }
    eos = tokenizer.eos_token_id
    assert env.step(_enc(tokenizer, item.reference) + [eos]) == Step(reward=1.0, done=True)
    wrong = "oslo" if item.reference != "oslo" else "lima"
    assert env.step(_enc(tokenizer, wrong) + [eos]) == Step(reward=0.0, done=True)
    # A turn closed by neither `?` nor <eos> (the driver truncates such a turn before any
    # step): the episode ends unscored, and no call is counted.
    assert env.step(_enc(tokenizer, "ask peru")) == Step(done=True, status="unclosed")
    assert tool.calls_by_status() == after
    # The registered reward is the same scoring, for single-turn use of the task.
    score = get_reward("capital_exact")
    assert score(["", "", ""], [" lima ", "lim", "lima"], ["lima", "lima", None]) == [1, 0, 0]


def _spec() -> TaskSpec:
    return TaskSpec(name="capitals")


# --- the episode driver on the tool, with models that write one token forever ----------------


@pytest.fixture(scope="module")
def engine(tokenizer):
    """A chain_tiny engine (4 slots) and its model."""
    model = Transformer(chain_tiny(len(tokenizer), tokenizer), rngs=nnx.Rngs(0))
    engine, _ = Engine.for_model(model, num_slots=4, steps_per_call=4, max_total_len=64)
    return engine, model


def _always(model, token: int):
    """Params under which the model writes `token` after any context: the layers add nothing
    to the residual stream (zero output projections), every embedding is the same vector, and
    the unembedding points that vector at `token` alone."""

    def value(path, var):
        if path[-1] in ("o_kernel", "down_kernel"):
            return var.replace(jnp.zeros_like(var[...]))
        if path == ("embedding",):
            return var.replace(jnp.ones_like(var[...]))
        if path == ("lm_head",):
            return var.replace(jnp.zeros_like(var[...]).at[:, token].set(1.0))
        return var

    _, params = nnx.split(model)
    flat = nnx.to_flat_state(params)
    return nnx.from_flat_state([(path, value(path, var)) for path, var in flat])


def _episodes(engine, params, tool, tokenizer, budget):
    source = get_task("capitals")(_spec(), tokenizer)
    sampling = SamplingConfig(budget.max_turn_tokens, stop_ids=source.stop_ids)
    runner = EpisodeRunner(engine, sampling, budget, tool_workers=0)
    groups = [
        EpisodeGroup(e, source.item(e), [source.make_env() for _ in range(2)]) for e in (0, 1)
    ]
    try:
        out = runner.run(params, jax.random.key(0), groups)
    finally:
        runner.close()
    return [t for ts in out for t in ts]


def test_a_call_that_never_closes_is_truncated_by_the_turn_budget(engine, tool, tokenizer):
    """A model that writes `a` forever never closes its call: each turn runs out of
    `max_turn_tokens`, the driver ends the episode "truncated" and never steps the tool. A model
    that writes `?` forever closes every call: the tool answers each `=error` ("malformed"),
    masked out of the loss, until the turn budget ends the episode."""
    eng, model = engine
    budget = EpisodeBudget(
        max_turns=3, max_turn_tokens=6, max_total_tokens=64, max_observation_tokens=26
    )
    before = tool.calls_by_status()
    a = tokenizer.convert_tokens_to_ids("a")
    for t in _episodes(eng, _always(model, a), tool, tokenizer, budget):
        assert t.status == "truncated" and t.turns == 1 and t.step_statuses == []
        assert t.tokens == [a] * budget.max_turn_tokens and all(t.loss_mask)
    assert tool.calls_by_status() == before  # the tool was never called

    close = tokenizer.convert_tokens_to_ids("?")
    error = _enc(tokenizer, tool.ERROR_REPLY)
    for t in _episodes(eng, _always(model, close), tool, tokenizer, budget):
        assert t.status == "truncated" and t.turns == budget.max_turns
        assert t.step_statuses == ["malformed"] * budget.max_turns
        assert t.tokens == ([close] + error) * (budget.max_turns - 1) + [close]
        assert t.loss_mask == ([True] + [False] * len(error)) * (budget.max_turns - 1) + [True]
    after = tool.calls_by_status()
    assert after.get("malformed", 0) - before.get("malformed", 0) == 4 * budget.max_turns


# --- examples/capital_tool.gin through launch.rl ----------------------------------------------

SMOKE = [
    "RLConfig.total_steps = 2",
    "RLConfig.num_prompts = 4",
    "RLConfig.samples_per_prompt = 4",
    "RLConfig.eval_size = 0",
    "RLConfig.eval_every_steps = 2",
    "RLConfig.save_every_steps = 2",
    "rl_main.plot = False",
]


def test_the_example_config_runs_episodes_with_the_tool_through_launch_rl(tool, tmp_path):
    from jaxrl.infra.launcher import launch
    from launch.rl import rl_main

    workdir = tmp_path / "capitals"
    flags = ["--gin_file", CONFIG, "--workdir", str(workdir)]
    for p in SMOKE:
        flags += ["--gin_param", p]
    before = tool.calls_by_status()
    try:
        result = launch(rl_main, flags)
    finally:
        gin.clear_config()
    after = tool.calls_by_status()
    calls = {k: n for k in after if (n := after[k] - before.get(k, 0))}
    assert result["final_step"] == 2
    assert "import capital_tool" in (workdir / "config.gin").read_text()
    records = {r["step"]: r for r in read_metrics(str(workdir / "metrics.jsonl"))}
    steps = [records[s] for s in (1, 2)]
    assert max(records) == 2
    for r in steps:
        assert math.isfinite(r["loss"]) and r["num_tokens"] > 0
        fractions = [r[f"episode/{s}_fraction"] for s in ("done", "truncated")]
        assert math.isclose(sum(fractions), 1.0)  # no tool error, no timeout
        assert r["episode/tool_error_fraction"] == r["episode/timeout_fraction"] == 0.0
    # The tool answered calls: its own tally, and the episodes that went on past a reply.
    assert sum(calls.values()) >= 1, calls
    assert max(r["episode/turns_mean"] for r in steps) > 1.0
    assert max(r["episode/observation_tokens_mean"] for r in steps) > 0.0
    assert max(r["episode/bad_step_fraction"] for r in steps) > 0.0  # random calls: malformed
    print(f"tool calls by status: {calls}")
    for s in (1, 2):
        r = records[s]
        print(
            f"step {s}: turns_mean={r['episode/turns_mean']:.4f} "
            f"observation_tokens_mean={r['episode/observation_tokens_mean']:.4f} "
            f"bad_step_fraction={r['episode/bad_step_fraction']:.4f} "
            f"done={r['episode/done_fraction']:.4f} truncated={r['episode/truncated_fraction']:.4f}"
        )

"""The errors a real chat model makes in a tool call, on SmolLM2-135M-Instruct's own tokenizer
(tests/data/smollm2_tokenizer): each episode's turns are the ids that tokenizer gives a model's
text, run through the `EpisodeRunner` as the engine would hand them out (cut at `<|im_end|>` or
at the turn's budget), so the statuses and their metrics are the loop's own."""

from __future__ import annotations

import json
import types

import jax
import pytest
from chat_fixtures import smollm2_tokenizer

from jaxrl.env.calculator import CalculatorTask
from jaxrl.env.chat_calculator import ChatCalculatorEnv, ChatCalculatorSource
from jaxrl.generation.engine import GroupResult
from jaxrl.generation.episodes import (
    MAX_GROUP,
    EpisodeBudget,
    EpisodeGroup,
    EpisodeRunner,
    episode_metrics,
)
from jaxrl.generation.sampling import SamplingConfig

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>'
BUDGET = EpisodeBudget(
    max_turns=3, max_turn_tokens=48, max_total_tokens=1024, max_observation_tokens=256
)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return smollm2_tokenizer(str(tmp_path_factory.mktemp("smollm2_tokenizer")))


@pytest.fixture(scope="module")
def source(tok):
    return ChatCalculatorSource(CalculatorTask(min_digits=2, max_digits=2), tok)


class ScriptedEngine:
    """Stands in for the engine: turn t of episode e is `scripts[e][t]` (ids), cut after its
    first stop id or at the request's budget, as the engine cuts a sampled turn. Its context,
    `max_capacity`, is the model's (SmolLM2's is 8192)."""

    def __init__(self, scripts, eos_id: int, max_capacity: int = 8192):
        self.scripts, self.eos_ids, self.max_capacity = scripts, (eos_id,), max_capacity
        self.model_config = types.SimpleNamespace(max_position_embeddings=max_capacity)
        self.queue, self.requests = [], []

    def submit(self, request):
        self.queue.append(request)
        self.requests.append(request)

    def release(self, *row):
        pass

    def reset(self):
        self.queue = []

    def run(self, params, key, *, version=0, update=None, kv_on_update="keep"):
        while self.queue:
            request = self.queue.pop(0)
            episode, turn = divmod(request.request_id // MAX_GROUP, BUDGET.max_turns)
            ids = list(self.scripts[episode][turn])[: request.budget]
            stops = set(request.sampling.stop_ids) | set(self.eos_ids)
            cut = next((i + 1 for i, t in enumerate(ids) if t in stops), len(ids))
            ids = ids[:cut]
            yield GroupResult.of(
                request, [ids], [[-0.5] * len(ids)], [[version] * len(ids)], 0, samples=(0,)
            )


def _run(source, scripts, *, max_capacity=8192, envs=None):
    """Runs one episode per script (held-out items 0..), G = 1, steps inline."""
    tok = source.tokenizer
    engine = ScriptedEngine(scripts, tok.eos_token_id, max_capacity)
    items = source.eval_items(len(scripts))
    groups = [
        EpisodeGroup(e, items[e], [envs[e] if envs and e in envs else source.make_env()])
        for e in range(len(scripts))
    ]
    runner = EpisodeRunner(engine, SamplingConfig(48, stop_ids=source.stop_ids), BUDGET,
                           tool_workers=0)  # fmt: skip
    out = [ts[0] for ts in runner.run(None, jax.random.key(0), groups)]
    return out, items, engine


def _text(tok, trajectory, start=0):
    return tok.decode(trajectory.tokens[start:], skip_special_tokens=False)


def _replies(tok, trajectory):
    """The tool messages the environment appended, as JSON objects."""
    text = _text(tok, trajectory)
    parts = text.split("<|im_start|>tool\n")[1:]
    return [json.loads(p.split("<|im_end|>")[0]) for p in parts]


def test_the_real_tokenizer_renders_in_delta_form_and_ends_a_turn_at_im_end(tok, source):
    assert tok.eos_token == "<|im_end|>" and source.stop_ids == (tok.eos_token_id,)
    call = tok.encode(CALL % "37*48", add_special_tokens=False)
    assert len(call) > 20 and tok.convert_ids_to_tokens(call[:2]) == ["<", "tool"]
    prompt = source.eval_items(1)[0].text
    assert prompt.endswith("<|im_start|>assistant\n") and "What is" in prompt


def test_each_error_a_model_makes_gets_its_status_reply_and_metric(tok, source):
    def ids(text):
        return tok.encode(text, add_special_tokens=False)

    items = source.eval_items(8)
    answers = [int(i.reference) for i in items]
    a0, b0 = source.task.operands(0, "heldout")
    expression = f"{a0}*{b0}"
    canonical = ids(CALL % expression + "<|im_end|>")
    # The same call split into other tokens than the tokenizer's own (a model may write it so).
    pieces = ["<", "tool", "_", "call", ">", '{"name', '": "calc', "ulator", '", "arguments": {"']
    rest = ids("expression" + CALL.split("expression")[1] % expression + "<|im_end|>")
    resplit = [i for p in pieces for i in ids(p)] + rest
    assert resplit != canonical and tok.decode(resplit) == tok.decode(canonical)

    scripts = {
        0: [resplit, ids(f"{answers[0]}<|im_end|>")],
        # <|im_start|> inside the call: the call is refused, the episode goes on.
        1: [
            ids(
                '<tool_call>{"name": "calculator", <|im_start|>"arguments": {"expression": "1*2"}}'
                "</tool_call><|im_end|>"
            ),
            ids(f"{answers[1]}<|im_end|>"),
        ],
        # A <tool_call> never closed before <|im_end|>.
        2: [
            ids('<tool_call>{"name": "calculator", "arguments": {"expression": "3*4"}}<|im_end|>'),
            ids("I think 12<|im_end|>"),
        ],  # fmt: skip
        # Arguments of the wrong JSON type: a number, then a string; then the answer.
        3: [
            ids(
                '<tool_call>{"name": "calculator", "arguments": {"expression": 12}}</tool_call>'
                "<|im_end|>"
            ),  # fmt: skip
            ids('<tool_call>{"name": "calculator", "arguments": "3*4"}</tool_call><|im_end|>'),
            ids(f"{answers[3]}<|im_end|>"),
        ],
        # A turn that runs out of its 48 tokens before <|im_end|>.
        4: [ids("Let me think step by step. " * 12)],
        # A tool that raises.
        5: [canonical],
        # Another tool's name.
        6: [
            ids(
                '<tool_call>{"name": "calc", "arguments": {"expression": "3*4"}}</tool_call>'
                "<|im_end|>"
            ),  # fmt: skip
            ids("12<|im_end|>"),
        ],
    }
    raising = ChatCalculatorEnv(tok, tool=lambda e: 1 // 0)
    out, items, _ = _run(source, [scripts[e] for e in range(7)], envs={5: raising})

    # 0: read whatever the split; the result comes back and the answer scores.
    assert out[0].step_statuses == ["ok", "ok"] and out[0].status == "done"
    assert out[0].reward == 1.0 and _replies(tok, out[0]) == [{"result": a0 * b0}]
    # 1: malformed, with the reason; the model's next turn is still its answer.
    assert out[1].step_statuses == ["malformed", "ok"] and out[1].status == "done"
    assert "special token <|im_start|>" in _replies(tok, out[1])[0]["error"]
    assert out[1].reward == 1.0
    # 2: no closing tag before the end of the turn.
    assert out[2].step_statuses[0] == "malformed" and out[2].turns == 2
    assert "no </tool_call>" in _replies(tok, out[2])[0]["error"]
    # 3: two malformed calls, each told what was wrong, then the answer.
    assert out[3].step_statuses == ["malformed", "malformed", "ok"] and out[3].reward == 1.0
    errors = [r["error"] for r in _replies(tok, out[3])]
    assert 'string expression; got {"expression": 12}' in errors[0]
    assert 'got "3*4"' in errors[1]
    # 6: another tool's name is named back.
    assert out[6].step_statuses == ["malformed", "ok"]
    assert "unknown tool 'calc'" in _replies(tok, out[6])[0]["error"]
    # 4: cut at the turn budget: truncated, no step ran.
    assert out[4].status == "truncated" and out[4].step_statuses == []
    assert sum(out[4].loss_mask) == BUDGET.max_turn_tokens
    # 5: the tool raised.
    assert out[5].status == "tool_error"
    # The metrics the loop logs count each of them.
    m = episode_metrics(out)
    assert m["episode/done_fraction"] == pytest.approx(5 / 7)
    assert m["episode/truncated_fraction"] == pytest.approx(1 / 7)
    assert m["episode/tool_error_fraction"] == pytest.approx(1 / 7)
    assert m["episode/malformed_step_fraction"] == pytest.approx(5 / 11)  # of 11 steps
    assert m["episode/bad_step_fraction"] == pytest.approx(5 / 11)
    for t in out:  # the trainer's view: sampled ids trained, the tool's replies not
        sampled = [i for i, m in zip(t.tokens, t.loss_mask, strict=True) if m]
        assert len(sampled) == sum(len(s) for s in scripts[t.episode][: t.turns]) or (
            t.status == "truncated" and t.episode == 4
        )


def test_a_conversation_that_reaches_the_context_is_truncated_within_it(tok, source):
    prompt_len = len(tok.encode(source.eval_items(1)[0].text, add_special_tokens=False))
    call = tok.encode(CALL % "12*34" + "<|im_end|>", add_special_tokens=False)
    context = prompt_len + len(call) + 40  # room for one call, its reply and a few tokens
    out, _, engine = _run(source, [[call, call, call]], max_capacity=context)
    (t,) = out
    assert t.status == "truncated" and t.step_statuses == ["ok"]
    assert len(t.prompt_ids) + len(t.tokens) <= context
    # The second turn was given only the room left, and used it all without reaching <|im_end|>.
    second = engine.requests[1]
    assert second.budget == context - prompt_len - len(t.tokens[: len(call)]) - (
        t.observation_tokens
    )
    assert t.turns == 2 and t.tokens[-1] != tok.eos_token_id
    # A prompt past the context is refused before any turn, naming the limit to raise.
    with pytest.raises(ValueError, match="no room in the model's context, max_position_emb"):
        _run(source, [[call]], max_capacity=prompt_len)

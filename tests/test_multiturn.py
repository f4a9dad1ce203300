"""Multi-turn episodes (`jaxrl.generation.episodes`, `jaxrl.env`): the token ids the trainer gets
are exactly the engine's and the environment's; observation tokens are attended but carry no
loss and no gradient, whatever their placeholders; tokens and turn counts do not depend on the
slot count, the arrival order or the tools' timing; malformed calls, raising and slow tools and
over-budget episodes end (or not) with their status while the run goes on; the streaming driver's
groups join the running batch and span weight versions. The calculator tool's parser and
environment are checked on their own. Launches: tests/test_multiturn_modes.py."""

from __future__ import annotations

import dataclasses
import random
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from disk_cache import jax_cache_dir, jax_disk_cache  # noqa: F401  (fixtures)
from flax import nnx

from jaxrl.env.base import Step
from jaxrl.env.calculator import (
    CalculatorError,
    CalculatorSource,
    CalculatorTask,
    calculate,
)
from jaxrl.generation.engine import Engine
from jaxrl.generation.episodes import (
    EpisodeBudget,
    EpisodeGroup,
    EpisodeRunner,
    request_id,
)
from jaxrl.generation.sampling import SamplingConfig
from jaxrl.infra.mesh import MeshConfig, make_mesh
from jaxrl.infra.sharding import TRAINER_RULES
from jaxrl.models.config import ModelConfig
from jaxrl.models.transformer import Transformer
from jaxrl.rl import collate_rollouts, group_advantages, logprobs_from_logits, make_loss
from jaxrl.rl.losses import PolicyLossInputs
from jaxrl.tasks.source import PromptItem
from jaxrl.tasks.tokenizer import build_arithmetic_tokenizer
from jaxrl.train.trainer import LossConfig, Trainer

# Engines of the same shapes (here, and the 4-slot engines of the other multi-turn tests) load
# compiled programs from the session's disk cache instead of compiling them again.
pytestmark = pytest.mark.usefixtures("jax_disk_cache")

CONFIG = ModelConfig(
    "llama", 64, 32, 64, 2, 4, 4, 8, max_position_embeddings=128, eos_token_id=2, pad_token_id=0
)
EOS, G, MAX_LEN = 2, 4, 64
STOPS = tuple(range(4, 64, 4))  # a turn is a "tool call" when it ends at one of these
SAMPLING = SamplingConfig(8, stop_ids=STOPS)
BUDGET = EpisodeBudget(
    max_turns=4, max_turn_tokens=8, max_total_tokens=MAX_LEN, max_observation_tokens=16
)
NUM_GROUPS = 6


class ScriptedEnv:
    """Observations are a function of the turn; the episode ends at `<eos>` or after the
    item's reference number of steps. `mode` makes it misbehave: "malformed" (the first call
    gets an error observation, status "malformed"), "raise", "slow" (each step waits on
    `release` for up to 2 s), "flood" (an observation past the budget). Steps wait a random
    0-3 ms (unseeded), so replies arrive in a different order on every run. `log` holds
    (turn ids received, observation returned) per step."""

    def __init__(self, mode: str = "ok", release: threading.Event | None = None):
        self.mode, self.release, self.log = mode, release, []

    def reset(self, item):
        self.wanted = int(item.reference)
        return [1] + [int(t) for t in item.text.split()]

    def step(self, ids):
        time.sleep(random.random() * 0.003)
        if self.mode == "raise":
            raise RuntimeError("the tool crashed")
        if self.mode == "slow":
            self.release.wait(2.0)
        if self.mode == "malformed" and not self.log:
            self.log.append((list(ids), [3, 3]))
            return Step([3, 3], status="malformed")
        done = ids[-1] == EOS or len(self.log) + 1 >= self.wanted
        observation = [] if done else [4 + (sum(ids) + k) % 10 for k in range(1 + sum(ids) % 3)]
        if self.mode == "flood":
            done, observation = False, [7] * (BUDGET.max_observation_tokens + 1)
        self.log.append((list(ids), observation))
        return Step(observation, reward=(sum(ids) % 7) / 7, done=done)


def _groups(modes=("ok",) * NUM_GROUPS, release=None) -> list[EpisodeGroup]:
    """Prompts of 3-6 tokens; the episodes want 1-4 steps."""
    return [
        EpisodeGroup(
            e,
            PromptItem(
                " ".join(str(10 + (7 * e + k) % 50) for k in range(2 + e % 4)), str(1 + e % 4)
            ),
            [ScriptedEnv(mode, release) for _ in range(G)],
            group_id=100 + e,
        )
        for e, mode in enumerate(modes)
    ]


class Recording:
    """The engine, keeping every `GroupResult` row it hands out by (request id, sample)."""

    def __init__(self, engine: Engine):
        self.engine, self.results = engine, {}

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def run(self, *args, **kwargs):
        for result in self.engine.run(*args, **kwargs):
            samples = result.samples or range(len(result.tokens_gn))
            for row, g in enumerate(samples):
                self.results[result.request_id, g] = (result, row)
            yield result


@pytest.fixture(scope="module")
def model():
    return Transformer(CONFIG, rngs=nnx.Rngs(0), init_std=0.3)


def _engine(model, slots: int) -> tuple[Engine, nnx.State]:
    return Engine.for_model(
        model, num_slots=slots, steps_per_call=4, max_total_len=MAX_LEN, prompt_buckets=(16, 32)
    )


@pytest.fixture(scope="module")
def engine4(model):
    return _engine(model, 4)


def _run(engine, params, groups, tool_workers=4, budget=BUDGET, continue_in_slot=True):
    runner = EpisodeRunner(
        engine, SAMPLING, budget, tool_workers=tool_workers, continue_in_slot=continue_in_slot
    )
    try:
        return runner.run(params, jax.random.key(0), groups)
    finally:
        runner.close()


# --- the calculator --------------------------------------------------------------------------


def test_calculator_parser_is_bounded_and_never_evaluates_code():
    assert calculate("37*48") == 1776
    assert calculate("12*34+56*78") == 4776
    assert calculate("5-3*2") == -1
    assert calculate("123456789*987654321") == 123456789 * 987654321
    for bad in ["37*", "3 4", "(1)", "1" * 40, "-3", "", "2**3", "__import__('os')", "1e5"]:
        with pytest.raises(CalculatorError):
            calculate(bad)


def test_calculator_environment_calls_the_tool_and_scores_the_answer():
    tokenizer = build_arithmetic_tokenizer()
    source = CalculatorSource(CalculatorTask(chained=True, tool_share=0.5), tokenizer)
    enc = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    item = source.item(0)
    env = source.make_env()
    assert tokenizer.decode(env.reset(item)) == f"<bos>{item.text}"
    a, b, c, d = source.task.operands(0, "train")
    step = env.step(enc(f"({a}*{b})"))
    assert (tokenizer.decode(step.observation), step.done, step.status) == (
        f"={a * b}",
        False,
        "ok",
    )
    for malformed in ["(1*)", "abc)", "(2**3)", "(" + "9" * 40 + ")"]:
        step = env.step(enc(malformed))
        assert (tokenizer.decode(step.observation), step.done, step.status) == (
            "=error",
            False,
            "malformed",
        )
    assert env.step(enc(item.reference) + [tokenizer.eos_token_id]) == Step(reward=1.0, done=True)
    assert env.step(enc("7") + [tokenizer.eos_token_id]).reward == 0.0
    disabled = source.make_env(disabled=True)
    disabled.reset(item)
    assert tokenizer.decode(disabled.step(enc(f"({a}*{b})")).observation) == "=?"
    # Demonstrations: the loss on the model's pieces and <eos>, never on the tool's replies.
    tokens, mask = source.demonstrations(0, 8, tokenizer, 64)
    for row in range(8):
        text = tokenizer.decode(tokens[row], skip_special_tokens=True)
        trained = tokenizer.decode(tokens[row][mask[row]], skip_special_tokens=True)
        if "(" in text:
            assert trained.count("(") == 3 and "=" not in trained
        assert trained.endswith(str(source.task.answer(source.task.operands(row, "train"))))


# --- acceptance 1: exact masking ----------------------------------------------------------------


def test_trainer_sees_the_engines_and_the_environments_ids_and_masking_is_exact(model, engine4):
    engine, params = engine4
    recording = Recording(engine)
    groups = _groups()
    out = _run(recording, params, groups)
    trajectories = [t for ts in out for t in ts]
    assert max(t.turns for t in trajectories) >= 3 and sum(
        t.observation_tokens for t in trajectories
    )
    # Per episode: the engine's turn ids, the environment's observations between them.
    for t in trajectories:
        env = groups[t.episode].envs[t.sample]
        rebuilt, mask = [], []
        for k in range(t.turns):
            rid = request_id(t.episode, k, 0 if k == 0 else t.sample, BUDGET.max_turns)
            result, row = recording.results[rid, t.sample if k == 0 else 0]
            assert result.samples == (t.sample if k == 0 else 0,)  # handed out row by row
            assert list(result.prompt) == [*t.prompt_ids, *rebuilt]  # what the engine saw
            ids = result.tokens_gn[row, : int(result.mask_gn[row].sum())].tolist()
            if k < len(env.log):
                assert env.log[k][0] == ids  # what the environment was given
            rebuilt, mask = rebuilt + ids, mask + [True] * len(ids)
            if k + 1 < t.turns:
                rebuilt, mask = rebuilt + env.log[k][1], mask + [False] * len(env.log[k][1])
        assert (t.tokens, t.loss_mask) == (rebuilt, mask)
        observed = ~np.asarray(t.loss_mask)
        assert np.all(np.asarray(t.behaviour_logprobs)[observed] == 0)
        assert np.all(np.asarray(t.token_versions)[observed] == -1)
    rollouts = [t.to_rollout() for t in trajectories]
    batch = collate_rollouts(rollouts, prompt_len=16, completion_len=MAX_LEN, pad_id=0)
    for i, t in enumerate(trajectories):
        assert batch.prompt_ids_bp[i][batch.prompt_mask_bp[i]].tolist() == list(t.prompt_ids)
        n = int(batch.completion_length_b[i])
        assert batch.completion_ids_bt[i, :n].tolist() == t.tokens
        assert batch.completion_mask_bt[i].tolist() == t.loss_mask + [False] * (MAX_LEN - n)

    # Placeholders on observation tokens (log-probs, versions) never reach the batch.
    rng = np.random.default_rng(0)
    scrambled = []
    for r in rollouts:
        obs = ~r.loss_mask
        lp, v = r.behaviour_logprobs.copy(), r.token_versions.copy()
        lp[obs], v[obs] = rng.normal(size=obs.sum()) * 50, rng.integers(-9, 9, size=obs.sum())
        scrambled.append(
            r.__class__(**(r.__dict__ | {"behaviour_logprobs": lp, "token_versions": v}))
        )
    batch2 = collate_rollouts(scrambled, prompt_len=16, completion_len=MAX_LEN, pad_id=0)
    for a, b in zip(jax.tree.leaves(batch), jax.tree.leaves(batch2), strict=True):
        np.testing.assert_array_equal(a, b)

    # Every loss, with KL and entropy: the gradient wrt the logits is exactly zero at observation
    # (and padding) positions, and bit-identical when their placeholders change.
    observed_bt = np.zeros(batch.completion_mask_bt.shape, bool)
    for i, n in enumerate(batch.completion_length_b):
        observed_bt[i, :n] = ~batch.completion_mask_bt[i, :n]
    assert observed_bt.sum() > 10
    logits = jnp.asarray(rng.normal(size=(*observed_bt.shape, CONFIG.vocab_size)), jnp.float32)
    ref_lp = jnp.asarray(rng.normal(size=observed_bt.shape) - 4.0, jnp.float32)
    advantages = group_advantages(batch.reward_b, batch.group_id_b, valid_b=batch.valid_b)
    noise = jnp.asarray(rng.normal(size=observed_bt.shape) * 30, jnp.float32)

    def jitted_loss_and_grad(name):
        """One jitted program per loss (op by op, each loss compiled its ops anew): the run with
        the placeholders changed is the same program on other inputs."""
        loss_fn = make_loss(name, kl_coef=0.1, entropy_coef=0.01)

        def f(logits, behaviour, ref):
            lp, entropy = logprobs_from_logits(logits, jnp.asarray(batch.completion_ids_bt))
            inputs = PolicyLossInputs(
                lp, behaviour, advantages, batch.completion_mask_bt, ref, entropy
            )
            return loss_fn(inputs)[0]

        return jax.jit(jax.value_and_grad(f))

    behaviour = jnp.asarray(batch.behaviour_logprobs_bt)
    for name in ("aipo", "ppo_clip", "grpo", "dr_grpo", "dapo"):
        loss_and_grad = jitted_loss_and_grad(name)
        loss, grad = loss_and_grad(logits, behaviour, ref_lp)
        grad = np.asarray(grad)
        assert np.all(grad[observed_bt] == 0.0) and np.all(grad[~batch.completion_mask_bt] == 0.0)
        assert np.abs(grad[batch.completion_mask_bt]).max() > 0
        loss2, grad2 = loss_and_grad(
            logits, jnp.where(observed_bt, noise, behaviour), jnp.where(observed_bt, noise, ref_lp)
        )
        assert np.asarray(loss2).tobytes() == np.asarray(loss).tobytes()
        assert np.asarray(grad2).tobytes() == grad.tobytes()

    # Through the trainer, on-policy: observation tokens are attended where the engine put them
    # (log pi of every sampled token equals the engine's log mu), and a step's update does not
    # move by a bit when the observation placeholders change. One device: the masking is the
    # same on any mesh, and the one-device program compiles in two thirds of the time.
    trainer = Trainer(
        CONFIG,
        make_mesh(MeshConfig(("fsdp", "tp"), (1, 1), num_devices=1)),
        TRAINER_RULES,
        optax.sgd(0.1),
        loss=LossConfig(name="grpo"),
    )
    with jax.default_matmul_precision("highest"):
        state, metrics = trainer.rl_step(trainer.init(model), batch)
        noisy = batch.replace(
            behaviour_logprobs_bt=np.where(
                observed_bt, np.asarray(noise), batch.behaviour_logprobs_bt
            )
        )
        state2, metrics2 = trainer.rl_step(trainer.init(model), noisy)
    assert float(metrics["abs_log_ratio_max"]) < 1e-4
    assert float(metrics["num_tokens"]) == batch.completion_mask_bt.sum()
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(state2.params), strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    assert float(metrics["loss"]) == float(metrics2["loss"])


# --- acceptance 2: scheduling independence ------------------------------------------------------


def test_tokens_and_turns_independent_of_slots_arrival_order_and_tool_timing(model, engine4):
    def summary(out):
        return {
            (t.episode, t.sample): (tuple(t.tokens), tuple(t.loss_mask), t.turns, t.status)
            for ts in out
            for t in ts
        }

    engine32 = _engine(model, 32)
    runs, stats = {}, {}
    for slots, (engine, params) in ((4, engine4), (32, engine32)):
        for order in ("forward", "reversed"):
            groups = _groups()
            groups = groups if order == "forward" else groups[::-1]
            # One run continues each turn as a new request whose whole history is prefilled
            # again, instead of in the episode's own slot: the same tokens either way.
            in_slot = (slots, order) != (32, "reversed")
            before = dataclasses.asdict(engine.stats)
            runs[slots, order] = summary(_run(engine, params, groups, continue_in_slot=in_slot))
            after = dataclasses.asdict(engine.stats)
            stats[slots, order] = {k: after[k] - before[k] for k in after}
    runs["inline"] = summary(_run(engine4[0], engine4[1], _groups(), tool_workers=0))
    first = runs[4, "forward"]
    assert len({t[2] for t in first.values()}) >= 3  # episodes of different turn counts
    for name, run in runs.items():
        assert run == first, name
    # In its slot, a later turn runs only the new tokens (each turn's last token and the
    # observation) through the model, not the history again.
    slot, again = stats[32, "forward"], stats[32, "reversed"]
    assert slot["extend_tokens"] > 0 and again["extend_tokens"] == 0
    assert slot["prefill_tokens"] + slot["extend_tokens"] < again["prefill_tokens"]


# --- acceptance 6: bad input --------------------------------------------------------------------


def test_malformed_raising_slow_and_over_budget_episodes_end_with_their_status(engine4):
    engine, params = engine4
    release = threading.Event()
    modes = ("ok", "malformed", "raise", "slow", "flood", "ok")
    budget = EpisodeBudget(
        max_turns=4,
        max_turn_tokens=8,
        max_total_tokens=MAX_LEN,
        max_observation_tokens=16,
        tool_timeout_s=0.3,
    )
    start = time.monotonic()
    try:
        out = _run(engine, params, _groups(modes, release), budget=budget)
    finally:
        release.set()
    assert time.monotonic() - start < 30
    # A malformed call: an error observation (attended, not trained), the episode goes on.
    bad = [t for t in out[1] if t.step_statuses[:1] == ["malformed"]]
    assert bad and any(t.turns >= 2 for t in bad)
    for t in bad:
        if t.turns >= 2:
            first = t.loss_mask.index(False)
            assert t.tokens[first : first + 2] == [3, 3] and t.loss_mask[first : first + 2] == [
                False,
                False,
            ]
    # A tool that raises, one that times out, an observation past the budget: each episode whose
    # turn reached the tool ends with its status; the others were truncated by their turn budget.
    for mode, status in (("raise", "tool_error"), ("slow", "timeout"), ("flood", "truncated")):
        statuses = {t.status for t in out[modes.index(mode)]}
        assert statuses <= {status, "truncated"} and status in statuses, (mode, statuses)
    for t in out[modes.index("flood")]:
        assert t.observation_tokens == 0 and t.turns == 1
    # The well-behaved episodes of the same run finish as they do alone.
    alone = _run(engine, params, _groups())
    for e in (0, 5):
        assert [(t.tokens, t.status) for t in out[e]] == [(t.tokens, t.status) for t in alone[e]]


def test_over_budget_turns_and_total_tokens_truncate(engine4):
    engine, params = engine4
    tight = EpisodeBudget(
        max_turns=2, max_turn_tokens=8, max_total_tokens=20, max_observation_tokens=16
    )
    out = _run(engine, params, _groups(), budget=tight)
    trajectories = [t for ts in out for t in ts]
    assert all(t.turns <= 2 and len(t.prompt_ids) + len(t.tokens) <= 20 for t in trajectories)
    assert any(t.status == "truncated" and t.step_statuses for t in trajectories)
    with pytest.raises(ValueError, match="no room"):
        _run(engine, params, _groups(), budget=EpisodeBudget(max_total_tokens=4))


# --- streaming: episodes joining the running batch (tests/test_multiturn_modes.py: launches) ---


def test_streamed_episodes_join_the_running_batch_and_span_versions(engine4):
    """`EpisodeRunner.stream` (the streaming generator's driver): groups started between its
    yields join the running engine and get the tokens and turns they get in one `run` call (the
    noise is a function of episode, turn, sample and token only); with a new version before
    every device call, episodes span versions and each sampled token records its own
    (observations -1)."""
    engine, params = engine4
    runner = EpisodeRunner(engine, SAMPLING, BUDGET, tool_workers=0)
    whole = _run(engine, params, _groups(), tool_workers=0)

    def bump(version):
        return version + 1, params

    groups = _groups()
    for group in groups[:2]:
        runner.start(group)
    streamed, waiting = [], list(groups[2:])
    for trajectories in runner.stream(params, jax.random.key(0), update=bump):
        streamed.append(trajectories)
        if waiting:  # one more group joins after each finished one
            runner.start(waiting.pop(0))
    assert sorted(ts[0].episode for ts in streamed) == list(range(NUM_GROUPS))
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


def test_episode_jobs_are_checked_before_any_work():
    from jaxrl.loop.config import RLConfig
    from jaxrl.loop.feeds.episodes import check_episode_job

    source = CalculatorSource(CalculatorTask(), build_arithmetic_tokenizer())
    budget = EpisodeBudget(max_total_tokens=40)
    check_episode_job(RLConfig(max_new_tokens=40), budget, source)
    for schedule in ("fixed_lag", "free_running", "streaming"):  # tests/test_multiturn_modes.py
        check_episode_job(
            RLConfig(mode="async", schedule=schedule, max_new_tokens=40), budget, source
        )
    with pytest.raises(ValueError, match="role-split"):
        check_episode_job(
            RLConfig(mode="async", max_new_tokens=40), budget, source, ("trainer", "generator")
        )
    with pytest.raises(ValueError, match="make_env"):
        check_episode_job(RLConfig(max_new_tokens=40), budget, object())
    with pytest.raises(ValueError, match="max_new_tokens"):
        check_episode_job(RLConfig(max_new_tokens=32), budget, source)

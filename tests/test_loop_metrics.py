"""Every RL mode logs the same core metrics with one meaning: `time/step_s` tick to tick (the
previous step's log and save included), `data/prompts_trained` and `data/prompts_sampled` (with
`data/prompts_seen` = sampled), through the one trainer loop of `jaxrl.loop.controller`.

In process, on a tiny model, a few steps per mode: sync, fixed lag, free running, streaming, and
the role split's trainer side (`RemoteFeed`) with its generator processes stood in for by a
channel that samples in this process. To compile each program once, every mode samples with the
same engine on the trainer's device (async modes through the weight store and a push, as on a
mesh of their own); placement is not under test here.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import pytest

from bench.rl import IdTokenizer, RandomPrompts, _model_config, even_ids
from jaxrl.generation.executor import GeneratorExecutor
from jaxrl.generation.placement import colocated_sampler
from jaxrl.infra.mesh import MeshConfig, make_mesh
from jaxrl.infra.sharding import TRAINER_RULES
from jaxrl.loop.config import RLConfig, sampling_config
from jaxrl.loop.controller import Controller
from jaxrl.loop.feeds.lagged import sample_batch, version_for
from jaxrl.loop.feeds.remote import RemoteFeed
from jaxrl.loop.reward import RewardExecutor
from jaxrl.sync.in_process import WeightSync
from jaxrl.sync.store import GeneratorWeights
from jaxrl.train.trainer import OptimizerConfig, Trainer

STEPS, PROMPTS, SAMPLES = 3, 2, 2
LOG_S = 0.05  # each log call takes this long: the next step's time/step_s must include it
CORE = {
    "policy_version",
    "reward/mean",
    "loss",
    "time/step_s",
    "time/train_s",
    "time/trainer_idle_s",
    "time/generator_idle_s",
    "throughput/tokens_per_s",
    "data/prompts_trained",
    "data/prompts_sampled",
    "data/prompts_seen",
    "completion/truncated",
}


class _TimedIO:
    """Keeps metrics; each log takes LOG_S; saves the final step (its snapshot is taken)."""

    def __init__(self):
        self.records, self.saved, self.started = [], [], None

    def start(self, step):
        self.started = time.perf_counter()

    def log(self, step, metrics, headline):
        if step:
            self.records.append((time.perf_counter(), dict(metrics)))
        time.sleep(LOG_S)

    def save_due(self, step, force=False):
        return force

    def save(self, state, extra, *, force=False):
        self.saved.append(extra)

    def after_step(self, step):
        pass


class _InProcessChannel:
    """The role split's `RolloutChannel`, its generator processes replaced by sampling here."""

    def __init__(self, controller):
        self.controller = controller

    def put_json(self, name, value):
        pass

    def receive(self, index):
        ctl = self.controller
        start = time.perf_counter()
        params = ctl.weights.acquire(version_for(ctl.config, index), ctl.config.stall_timeout_s)
        batch = sample_batch(ctl, index, params)
        batch.metrics["time/generator_idle_s"] = time.perf_counter() - start
        return batch

    def forget(self, index):
        pass


@pytest.fixture(scope="module")
def parts():
    trainer = Trainer(
        _model_config(smoke=True),
        make_mesh(MeshConfig(("fsdp", "tp"), (1, 1), 0, 1)),
        TRAINER_RULES,
        OptimizerConfig(learning_rate=1e-5).make(STEPS),
    )
    tokenizer = IdTokenizer()
    sampler = colocated_sampler(trainer, tokenizer, num_slots=PROMPTS * SAMPLES, steps_per_call=4)
    return {
        "trainer": trainer,
        "state": trainer.init(trainer.init_params(0)),  # copied per run (a step donates it)
        "tokenizer": tokenizer,
        "sampler": sampler,
        "sync": WeightSync(trainer.param_shardings, trainer.param_shardings),
    }


def _run(parts, mode: str, schedule: str = "fixed_lag", remote: bool = False) -> _TimedIO:
    trainer, tokenizer = parts["trainer"], parts["tokenizer"]
    rl = RLConfig(
        mode=mode, schedule=schedule, lag=1, max_staleness=2, queue_size=2, total_steps=STEPS,
        num_prompts=PROMPTS, samples_per_prompt=SAMPLES, max_new_tokens=4, eval_size=0,
    )  # fmt: skip
    sampler = parts["sampler"]
    weights = None
    if mode == "async":
        weights = GeneratorWeights(parts["sync"], latest_only=schedule != "fixed_lag")
    io = _TimedIO()
    controller = Controller(
        rl,
        trainer,
        GeneratorExecutor(sampler, sampling_config(rl), SAMPLES, seed=0),
        RewardExecutor(even_ids, tokenizer),
        RandomPrompts(trainer.model_config.vocab_size),
        tokenizer,
        io,
        reward=even_ids,
        weights=weights,
        feed=(lambda ctl: RemoteFeed(ctl, _InProcessChannel(ctl), lead=True)) if remote else None,
    )
    controller.run(jax.tree.map(jnp.copy, parts["state"]))
    return io


@pytest.mark.parametrize(
    "mode, schedule, remote",
    [
        ("sync", "fixed_lag", False),
        ("async", "fixed_lag", False),
        ("async", "free_running", False),
        ("async", "streaming", False),
        ("async", "fixed_lag", True),
    ],
    ids=["sync", "fixed_lag", "free_running", "streaming", "role_split"],
)
def test_every_mode_logs_the_core_metrics_with_one_meaning(parts, mode, schedule, remote, capsys):
    io = _run(parts, mode, schedule, remote)
    times = [t for t, _ in io.records]
    records = [r for _, r in io.records]
    # `completion/truncated` (issue 57): the random model's samples run into max_new_tokens=4
    # (it rarely samples its EOS), which the first step warns about, once, naming the setting.
    assert all(r["completion/truncated"] > 0.5 for r in records)
    warnings = [x for x in capsys.readouterr().err.splitlines() if "[rl] warning" in x]
    assert len(warnings) == 1 and "max_new_tokens=4" in warnings[0], warnings
    assert warnings[0].endswith("raise RLConfig.max_new_tokens")
    assert [r["policy_version"] for r in records] == [1.0, 2.0, 3.0]
    for step, record in enumerate(records, start=1):
        assert CORE <= set(record), sorted(CORE - set(record))
        assert record["data/prompts_trained"] == step * PROMPTS
        assert record["data/prompts_seen"] == record["data/prompts_sampled"]
        if schedule in ("fixed_lag",):  # sync and fixed lag: every sampled prompt is trained
            assert record["data/prompts_sampled"] == step * PROMPTS
        else:  # free running and streaming may drop (or leave out) what they sampled
            assert record["data/prompts_sampled"] >= step * PROMPTS
    # Tick to tick: the steps' times add up to the wall time from the start to the last step's
    # end, and each step after the first includes the previous step's log.
    total = sum(r["time/step_s"] for r in records)
    assert total == pytest.approx(times[-1] - io.started, abs=0.02)
    assert all(r["time/step_s"] >= LOG_S for r in records[1:])
    assert len(io.saved) == 1 and io.saved[0]["prompts_trained"] == STEPS * PROMPTS

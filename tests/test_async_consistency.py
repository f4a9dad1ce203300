"""No rollout is sampled with half-updated weights: in a free-running async run (the generator
samples while the trainer pushes, each push split into many chunks), every consumed rollout's
behaviour log-probs are reproduced by a teacher-forced pass of exactly the weights of the policy
version it is stamped with, and by no other version's."""

from __future__ import annotations

import functools
import os

import gin
import jax
import numpy as np
from flax import nnx

import launch.rl
from jaxrl.infra.launcher import launch as run_launch
from jaxrl.job.specs import PolicySpec, TaskSpec, build_model_config, build_tokenizer
from jaxrl.models.transformer import Transformer
from jaxrl.sync.cross_process import make_weight_sync
from jaxrl.train.steps import completion_logprobs
from jaxrl.train.trainer import LossConfig, Trainer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, "configs", "rl", "arith_tiny.gin")
FREE_RUNNING = [
    "rl_main.sft = None",
    "TaskSpec.reward = 'rewards_for_tests:even_length'",
    "RLConfig.schedule = 'free_running'",
    "RLConfig.max_staleness = 2",
    "RLConfig.queue_size = 2",
    "RLConfig.total_steps = 8",
    "RLConfig.num_prompts = 4",
    "RLConfig.samples_per_prompt = 4",
    "RLConfig.oversample = 1",
    "RLConfig.eval_size = 0",
    "RLConfig.save_every_steps = 100",
    "OptimizerConfig.learning_rate = 1e-2",
    "OptimizerConfig.warmup_steps = 0",
]


def test_behaviour_logprobs_come_from_exactly_the_stamped_version(tmp_path, monkeypatch):
    params_by_version, consumed = {}, []
    rl_step = Trainer.rl_step

    def recording_rl_step(self, state, batch, ref_params=None):
        version = int(state.step)  # the params trained here are policy version `version`
        params_by_version[version] = jax.device_get(state.params)
        consumed.append((version, batch))
        return rl_step(self, state, batch, ref_params)

    monkeypatch.setattr(Trainer, "rl_step", recording_rl_step)
    # 16 KB chunks: a push of the 0.4M-parameter model takes dozens of steps on the generator.
    monkeypatch.setattr(
        launch.rl, "make_weight_sync", functools.partial(make_weight_sync, chunk_bytes=16 << 10)
    )
    flags = ["--gin_file", CONFIG, "--workdir", str(tmp_path / "run")]
    for p in FREE_RUNNING:
        flags += ["--gin_param", p]
    try:
        run_launch(launch.rl.rl_main, flags)
    finally:
        gin.clear_config()

    config = build_model_config(PolicySpec(), build_tokenizer(PolicySpec(), TaskSpec()))
    graphdef = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))[0]

    @jax.jit
    def logprobs(params, batch):
        model = nnx.merge(graphdef, params)
        return completion_logprobs(model, batch, LossConfig(), with_entropy=False)[0]

    assert len(consumed) == 8
    seen_versions = set()
    for trained_at, batch in consumed:
        valid = np.asarray(batch.valid_b)
        versions = set(np.asarray(batch.policy_version_b)[valid].tolist())
        assert len(versions) == 1, versions
        version = versions.pop()
        seen_versions.add(version)
        assert 0 <= trained_at - version <= 2  # max_staleness
        mask = np.asarray(batch.completion_mask_bt) & valid[:, None]
        behaviour = np.asarray(batch.behaviour_logprobs_bt)
        errors = {
            v: float(np.abs(np.asarray(logprobs(p, batch)) - behaviour)[mask].max())
            for v, p in params_by_version.items()
        }
        assert errors[version] <= 1e-5, (trained_at, version, errors)
        others = [e for v, e in errors.items() if v != version]
        assert min(others) > 1e-3, (trained_at, version, errors)  # the check tells versions apart
    assert len(seen_versions) >= 4, seen_versions

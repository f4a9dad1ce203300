"""The library as a library (issue 23): HF directory -> Trainer, sampling -> rollouts -> one RL
step, rewards see text without special tokens, the Controller refuses a misconfigured run, the
task registry, and the RL prompt stream after an SFT warm start."""

from __future__ import annotations

import os
import types

import gin
import jax
import numpy as np
import pytest
from flax import nnx

from jaxrl.generation.executor import GeneratedBatch, GeneratorExecutor
from jaxrl.generation.placement import colocated_sampler
from jaxrl.generation.sampling import SamplingConfig
from jaxrl.infra.mesh import MeshConfig, make_mesh
from jaxrl.job.specs import PolicySpec, TaskSpec, build_model_config, build_source
from jaxrl.loop.config import RLConfig, sampling_config
from jaxrl.loop.controller import Controller
from jaxrl.loop.reward import RewardExecutor
from jaxrl.models import hf
from jaxrl.models.transformer import Transformer
from jaxrl.rl import collate_rollouts, rollouts_from_samples
from jaxrl.tasks.source import PromptItem, encode_prompts, register_task
from jaxrl.tasks.tokenizer import build_arithmetic_tokenizer
from jaxrl.train.trainer import LossConfig, OptimizerConfig, Trainer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tokenizer():
    return build_arithmetic_tokenizer()


def test_hf_dir_to_trainer_then_one_rl_step(tmp_path, tokenizer):
    """`hf.load_model` output and `Trainer.from_hf` both give a state the trainer trains; its
    default, packed rows with each group's prompt once, trains what padded batches train."""
    config = build_model_config(PolicySpec(), tokenizer)
    path = str(tmp_path / "hf")
    hf.save_hf(Transformer(config, rngs=nnx.Rngs(3)), path, tokenizer=tokenizer)
    mesh = make_mesh(MeshConfig(("fsdp", "tp"), (2, 1), num_devices=2))
    optimizer = OptimizerConfig(learning_rate=1e-2, max_grad_norm=None)
    trainer, state = Trainer.from_hf(
        path, optimizer, total_steps=2, mesh=mesh, loss=LossConfig(name="grpo"), pack_length=0
    )
    for param, sharding in zip(
        jax.tree.leaves(state.params), jax.tree.leaves(trainer.param_shardings), strict=True
    ):
        assert param.sharding == sharding
    # The loader docs/API.md shows first: its Transformer goes straight into Trainer.init.
    from_model = trainer.init(hf.load_model(path))
    jax.tree.map(np.testing.assert_array_equal, from_model.params, state.params)

    sampler = colocated_sampler(trainer, tokenizer, prompt_buckets=(8, 16))
    assert sampler.prompt_buckets == (8, 16)
    items = [PromptItem("12+7=", "19"), PromptItem("3+45=", "48")]
    rows = [ids for ids in encode_prompts(tokenizer, items, False) for _ in range(4)]
    out = sampler.generate(state.params, rows, SamplingConfig(4), jax.random.key(0))
    rewards = np.arange(8) % 3  # any spread: non-zero advantages
    rollouts = rollouts_from_samples(rows, out, rewards, np.repeat([0, 1], 4), policy_version=0)
    for i, r in enumerate(rollouts):
        n = int(out.lengths_b[i])
        np.testing.assert_array_equal(r.completion_ids, out.tokens_bn[i, :n])
        np.testing.assert_array_equal(r.behaviour_logprobs, out.logprobs_bn[i, :n])
        assert r.reward == rewards[i] and list(r.prompt_ids) == rows[i]
    batch = collate_rollouts(rollouts, prompt_len=8, completion_len=4, pad_id=0)
    before = jax.device_get(state.params)
    state, metrics = trainer.rl_step(state, batch)
    assert np.isfinite(float(metrics["loss"])) and float(metrics["grad_norm"]) > 0
    moved = jax.tree.map(
        lambda a, b: float(np.max(np.abs(np.asarray(a) - b))), state.params, before
    )
    assert max(jax.tree.leaves(moved)) > 1e-4
    # The default: packed rows with each group's prompt once, as long as one group's prompt and
    # completions (8 + 4 x 4 tokens): the padded batch's loss and gradient.
    packed, packed_state = Trainer.from_hf(
        path, optimizer, total_steps=2, mesh=mesh, loss=LossConfig(name="grpo")
    )
    assert packed.pack_length == "auto" and packed.share_prompts
    assert packed.layout_batch(batch).tokens_rl.shape[1] == 24
    _, packed_metrics = packed.rl_step(packed_state, batch)
    # At the first step the policy is the sampler (ratio 1), so GRPO's loss is the batch's mean
    # advantage: zero up to rounding (~1e-8). Its gradient is not: compare both.
    np.testing.assert_allclose(float(packed_metrics["loss"]), float(metrics["loss"]), atol=1e-6)
    assert float(metrics["grad_norm"]) > 1e-3
    np.testing.assert_allclose(
        float(packed_metrics["grad_norm"]), float(metrics["grad_norm"]), rtol=1e-5
    )


def _generated(tokenizer, completion: str) -> GeneratedBatch:
    ids = tokenizer.encode(completion, add_special_tokens=False) + [tokenizer.eos_token_id]
    return GeneratedBatch(
        items=[PromptItem("40+42=", "82")],
        prompt_ids=[tokenizer.encode("40+42=")],
        completion_ids=[np.asarray(ids)],
        behaviour_logprobs=[np.zeros(len(ids), np.float32)],
        group_ids=np.zeros(1, np.int64),
        policy_version=0,
        batch_index=0,
        seconds=0.0,
    )


def test_rewards_see_text_without_special_tokens(tokenizer):
    seen = []

    def exact(prompts, completions, references):
        seen.extend(completions)
        return [float(c == r) for c, r in zip(completions, references, strict=True)]

    rollouts, metrics = RewardExecutor(exact, tokenizer).score(_generated(tokenizer, "82"))
    assert seen == ["82"] and metrics["reward/mean"] == 1.0
    # The stop token is still a trained token of the rollout; only the text drops it.
    assert rollouts[0].completion_ids[-1] == tokenizer.eos_token_id


class _ListIO:
    def __init__(self):
        self.records = []

    def start(self, step):
        pass

    def log(self, step, metrics, headline):
        self.records.append(metrics)

    def save_due(self, step, force=False):
        return False

    def save(self, state, extra, *, force=False):
        pass

    def after_step(self, step):
        pass


def _controller(config: RLConfig, tokenizer, *, generator_config=None, source=None, io=None):
    generator_config = generator_config or config
    generator = GeneratorExecutor(
        types.SimpleNamespace(prompt_buckets=(16,)),  # never called: construction only
        sampling_config(generator_config),
        generator_config.samples_per_prompt,
        seed=0,
    )
    return Controller(
        config,
        types.SimpleNamespace(loss=LossConfig()),
        generator,
        RewardExecutor("arithmetic_exact", tokenizer),
        source or build_source(TaskSpec(), tokenizer),
        tokenizer,
        io or _ListIO(),
        reward="arithmetic_exact",
    )


def test_controller_refuses_a_misconfigured_run(tokenizer):
    good = RLConfig(eval_size=4)
    _controller(good, tokenizer)  # the fixture itself is fine
    cases = [
        (RLConfig(num_prompts=0), {}, ValueError, "invalid RLConfig: RLConfig.num_prompts=0"),
        (RLConfig(schedule="fixed_lag", lag=3, max_staleness=1), {}, ValueError, "lag=3"),
        (good, {"generator_config": RLConfig(samples_per_prompt=4)}, ValueError, "samples"),
        (good, {"generator_config": RLConfig(max_new_tokens=9)}, ValueError, "max_new_tokens"),
        (RLConfig(temperature=0.7), {"generator_config": good}, ValueError, "temperature"),
        (good, {"source": object()}, TypeError, "PromptSource"),
        (good, {"io": object()}, TypeError, "ControllerIO"),
    ]
    for config, kwargs, error, match in cases:
        with pytest.raises(error, match=match):
            _controller(config, tokenizer, **kwargs)


class _Countdown:
    """A user source: item i asks for the digits of i reversed."""

    reward_name = "arithmetic_exact"

    def item(self, index):
        return PromptItem(f"rev {index}:", str(index)[::-1])

    def eval_items(self, limit):
        return [self.item(10**6 + i) for i in range(limit)]


def make_countdown(spec, tokenizer):
    return _Countdown()


def test_task_registry_selects_user_tasks_by_name(tokenizer):
    register_task("test_api_countdown", make_countdown, overwrite=True)
    spec = TaskSpec(name="test_api_countdown")
    spec.validate()
    assert build_source(spec, tokenizer).item(12).reference == "21"
    by_path = TaskSpec(name="test_api:make_countdown")  # tests/ is on sys.path under pytest
    by_path.validate()
    assert isinstance(build_source(by_path, tokenizer), _Countdown)
    with pytest.raises(ValueError, match="register_task"):
        TaskSpec(name="no_such_task").validate()
    with pytest.raises(ValueError, match="already registered"):
        register_task("arithmetic", make_countdown)


def test_first_rl_batch_after_sft_holds_no_demonstration(tmp_path, monkeypatch):
    """launch.rl with the SFT warm start of configs/rl/arith_tiny_sync.gin (a pool of 448
    demonstrations): batch 0 of RL, as the controller builds it, holds none of their prompts.
    (SFT and RL training are replaced by stubs: only the prompt stream is under test.)"""
    import launch.rl as rl_launch
    from jaxrl.infra.launcher import launch

    first = {}

    class FirstBatch(Controller):
        def run(self, state, extra=None):
            items, _ = self.prompts(0)
            first["prompts"] = [it.text for it in items]
            return state

    monkeypatch.setattr(rl_launch, "Controller", FirstBatch)
    monkeypatch.setattr(rl_launch, "initial_params", lambda *args: args[5].init_params(0))
    from launch import plot as plot_module

    monkeypatch.setattr(plot_module, "write_plot", lambda workdir: None)  # the stub logs nothing
    flags = ["--gin_file", os.path.join(REPO, "configs", "rl", "arith_tiny_sync.gin")]
    flags += ["--workdir", str(tmp_path / "run"), "--gin_param", "RLConfig.eval_size = 0"]
    try:
        launch(rl_launch.rl_main, flags)
    finally:
        gin.clear_config()
    tokenizer = build_arithmetic_tokenizer()
    source = build_source(TaskSpec(), tokenizer)
    demonstrations = {source.item(i).text for i in range(448)}
    assert len(first["prompts"]) == 16
    assert not set(first["prompts"]) & demonstrations, set(first["prompts"]) & demonstrations

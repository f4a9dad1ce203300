"""An 8-bit generator's mismatch (`jaxrl.generation.mismatch`, `GeneratorConfig.mismatch`): the
estimator, the scorer being the full-precision policy (and a native engine measuring none), the
behaviour log-probs the loss receives (the quantized engine's exactly; the full-precision ones
under the "uncorrected" control), the refusals, and `gen/mismatch_kl` in a sync run's metrics."""

from __future__ import annotations

import json
import os

import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.generation.engine_sampler import EngineSampler
from jaxrl.generation.executor import GeneratorExecutor, sampling_key
from jaxrl.generation.mismatch import MismatchScorer, mismatch_metrics
from jaxrl.generation.placement import GeneratorConfig
from jaxrl.generation.sampling import SamplingConfig, processed_logprobs
from jaxrl.loop.reward import RewardExecutor
from jaxrl.models.config import ModelConfig
from jaxrl.models.transformer import Transformer
from jaxrl.rl.rollout import collate_rollouts
from jaxrl.tasks.source import PromptItem

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = ModelConfig("llama", 64, 32, 64, 2, 4, 4, 8, max_position_embeddings=128)
PROMPTS = [[1, 5, 6, 7, 8, 9, 10, 11], [1, 20, 21], [1, 30, 31, 32, 33, 34]]
SAMPLING = SamplingConfig(8, temperature=0.7)


@pytest.fixture(scope="module")
def model():
    return Transformer(CONFIG, rngs=nnx.Rngs(0), init_std=0.3)


def _executor(model, weights, mismatch="off"):
    sampler, params = EngineSampler.for_model(model, num_slots=8, steps_per_call=4, weights=weights)
    return GeneratorExecutor(sampler, SAMPLING, 2, seed=0, mismatch=mismatch), params


def _generate(executor, params):
    items = [PromptItem(text=str(i), reference="0") for i in range(len(PROMPTS))]
    return executor.generate(params, items, PROMPTS, policy_version=3, batch_index=1)


def test_the_estimates():
    same = [np.array([-1.0, -2.0]), np.array([-0.5])]
    assert mismatch_metrics(same, same) == {
        "gen/mismatch_kl": 0.0, "gen/mismatch_log_ratio": 0.0, "gen/mismatch_abs_log_ratio_max": 0.0
    }  # fmt: skip
    behaviour, full = [np.array([-1.0, -2.0])], [np.array([-1.5, -1.0])]  # log r = -0.5, 1
    m = mismatch_metrics(behaviour, full)
    k3 = ((np.exp(-0.5) - 1 + 0.5) + (np.exp(1.0) - 1 - 1.0)) / 2
    assert m["gen/mismatch_kl"] == pytest.approx(k3) and m["gen/mismatch_kl"] > 0
    assert m["gen/mismatch_log_ratio"] == pytest.approx((0.5 - 1.0) / 2)
    assert m["gen/mismatch_abs_log_ratio_max"] == pytest.approx(1.0)


def test_the_scorer_is_the_full_precision_policy_and_native_has_no_mismatch(model):
    native, params = _executor(model, "native")
    generated = _generate(native, params)
    scorer = MismatchScorer(native.sampler.graphdef, SAMPLING.temperature)
    full = scorer.logprobs(params, generated.prompt_ids, generated.completion_ids)
    # Against an independent whole-sequence forward of the same weights (all logits).
    forward = jax.jit(
        lambda p, t: processed_logprobs(nnx.merge(native.sampler.graphdef, p)(t), SAMPLING)
    )
    for p, c, lp in zip(generated.prompt_ids, generated.completion_ids, full, strict=True):
        ref = np.asarray(forward(params, jnp.asarray([list(p) + list(c)])))[0]
        # float32 sums in another order (XLA:CPU's kernels differ by CPU): 1.1e-5 of -4.54 on an
        # AMD EPYC; the 8-bit policy below differs by more than 1e-3.
        np.testing.assert_allclose(
            lp, ref[np.arange(len(p) - 1, len(p) - 1 + len(c)), c], rtol=1e-5, atol=1e-5
        )
    # The negative control: a native engine's behaviour log-probs are the same policy's.
    none = mismatch_metrics(generated.behaviour_logprobs, full)
    quant, _ = _executor(model, "int8", "measure")
    measured = _generate(quant, params).metrics
    for name, m in (("native", none), ("int8", measured)):
        print(f"[mismatch] {name}: kl={m['gen/mismatch_kl']:.2e} "
              f"max|log r|={m['gen/mismatch_abs_log_ratio_max']:.2e}")  # fmt: skip
    assert none["gen/mismatch_abs_log_ratio_max"] < 1e-4 and none["gen/mismatch_kl"] < 1e-9
    assert measured["gen/mismatch_abs_log_ratio_max"] > 1e-3
    assert measured["gen/mismatch_kl"] > 100 * max(none["gen/mismatch_kl"], 1e-12)
    assert measured["time/mismatch_s"] > 0


def test_the_loss_gets_the_quantized_engines_logprobs_or_the_controls(model):
    measure, params = _executor(model, "int8", "measure")
    uncorrected, _ = _executor(model, "int8", "uncorrected")
    raw = measure.sampler.generate(
        params, PROMPTS, SAMPLING, sampling_key(0, 3, 1), num_samples=2
    )  # what the quantized engine returned, the same key as the executor's
    a, b = _generate(measure, params), _generate(uncorrected, params)
    scorer = measure.scorer
    full = scorer.logprobs(params, a.prompt_ids, a.completion_ids)
    lengths = raw.lengths_b
    rewarder = RewardExecutor(lambda prompts, texts, refs: [0.0] * len(texts), _Decoder())
    for generated, expected in ((a, [raw.logprobs_bn[i, : n] for i, n in enumerate(lengths)]),
                                (b, full)):  # fmt: skip
        assert all(np.array_equal(x, y) for x, y in zip(generated.completion_ids,
                   [raw.tokens_bn[i, :n] for i, n in enumerate(lengths)], strict=True))  # fmt: skip
        rollouts, metrics = rewarder.score(generated)
        assert metrics["gen/mismatch_kl"] == generated.metrics["gen/mismatch_kl"] > 0
        batch = collate_rollouts(rollouts, prompt_len=16, completion_len=8, pad_id=0)
        for i, lp in enumerate(expected):
            got = np.asarray(batch.behaviour_logprobs_bt)[i, : len(lp)]
            assert np.array_equal(got, np.asarray(lp, np.float32)), i
    assert not all(np.array_equal(x, y) for x, y in zip(a.behaviour_logprobs, full, strict=True))


class _Decoder:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))

    def batch_decode(self, rows, skip_special_tokens=True):
        return [self.decode(r) for r in rows]


def test_refusals(model, tmp_path):
    with pytest.raises(ValueError, match="expected one of"):
        GeneratorConfig(weights="int8", mismatch="sometimes").validate()
    with pytest.raises(ValueError, match="weights='native' has no mismatch"):
        GeneratorConfig(mismatch="measure").validate()
    GeneratorConfig(weights="int8", mismatch="uncorrected").validate()
    with pytest.raises(ValueError, match="samples the weights as given"):
        _executor(model, "native", "measure")
    from jaxrl.infra.launcher import launch
    from launch.rl import rl_main

    config = os.path.join(REPO, "configs", "rl", "arith_tiny.gin")
    flags = ["--gin_file", config, "--workdir", str(tmp_path / "run")]
    for p in ("RLConfig.schedule = 'streaming'", "GeneratorConfig.weights = 'int8'",
              "GeneratorConfig.mismatch = 'uncorrected'"):  # fmt: skip
        flags += ["--gin_param", p]
    try:
        with pytest.raises(SystemExit, match="streaming run's samples span versions"):
            launch(rl_main, flags)
    finally:
        gin.clear_config()
    assert not (tmp_path / "run" / "checkpoints").exists()  # before any device work


def test_a_sync_int8_run_logs_the_mismatch(tmp_path):
    from jaxrl.infra.launcher import launch
    from launch.rl import rl_main

    config = os.path.join(REPO, "configs", "rl", "arith_tiny_sync.gin")
    flags = ["--gin_file", config, "--workdir", str(tmp_path / "run")]
    params = ["rl_main.sft = None", "RLConfig.total_steps = 2", "RLConfig.num_prompts = 4",
              "RLConfig.eval_size = 0", "RLConfig.save_every_steps = 2",
              "GeneratorConfig.weights = 'int8'", "rl_main.plot = False"]  # fmt: skip
    for p in params:
        flags += ["--gin_param", p]
    try:
        launch(rl_main, flags)
    finally:
        gin.clear_config()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    steps = [r for r in records if r.get("step", 0) > 0 and "gen/mismatch_kl" in r]
    assert len(steps) == 2, records
    for r in steps:
        assert r["gen/mismatch_kl"] > 0 and r["gen/mismatch_abs_log_ratio_max"] > 1e-4, r
        # On-policy in sync mode: the trainer's ratio sees the same quantization.
        assert r["abs_log_ratio_max"] > 1e-4
    # What the run saved is the full-precision policy: no 8-bit leaf reaches a checkpoint.
    from jaxrl.job import workdir as run_dir

    config, _ = run_dir.load_model_spec(str(tmp_path / "run"))
    step, saved = run_dir.restore_params(str(tmp_path / "run"), config)
    leaves = jax.tree.leaves(saved)
    assert step == 2 and leaves and all(x.dtype == jnp.float32 for x in leaves)

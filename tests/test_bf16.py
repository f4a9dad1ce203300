"""Training with bf16 parameters (docs/precision.md): micro-batched SFT and RL steps
train bf16 params through float32 master weights in the optimizer state, a checkpoint resumes
bitwise (and one of the other param_dtype is refused by name), the weight push gives the
generator the trainer's params in the dtype it asks for, LoRA trains bf16 adapters on a frozen
bf16 base, and an update below bf16's resolution is kept by the master weights where a bf16
`p + u` drops it."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl.generation.placement import generator_param_shardings
from jaxrl.infra.checkpoint import CheckpointMismatchError
from jaxrl.infra.mesh import MeshConfig, make_mesh
from jaxrl.infra.run_io import RunIO
from jaxrl.infra.sharding import GENERATOR_RULES, TRAINER_RULES
from jaxrl.models.config import ModelConfig
from jaxrl.rl import Rollout, collate_rollouts
from jaxrl.sync.cross_process import make_weight_sync
from jaxrl.sync.store import GeneratorWeights
from jaxrl.train import lora as lora_lib
from jaxrl.train.state import (
    MasterWeightsState,
    OptimizerConfig,
    apply_gradients,
    init_state,
    with_master_weights,
)
from jaxrl.train.trainer import Trainer

OPTIMIZER = OptimizerConfig(learning_rate=1e-2, warmup_steps=0)


# One layer, E 64: every program compiles in a few seconds on CPU.
CONFIG = ModelConfig(
    "llama", 64, 64, 128, 1, 4, 2, 16, max_position_embeddings=64, param_dtype="bfloat16",
    dtype="bfloat16",
)  # fmt: skip


@pytest.fixture(scope="module")
def setup():
    """A bf16 trainer (FSDP over 2 devices, 2 micro-batches, AIPO) and random bf16 params
    (host-drawn: no init program to compile)."""
    mesh = make_mesh(MeshConfig(("fsdp", "tp"), (2, 1), num_devices=2))
    trainer = Trainer(CONFIG, mesh, TRAINER_RULES, OPTIMIZER.make(10), grad_accum_steps=2)
    rng = np.random.default_rng(0)
    params = jax.tree.map(
        lambda a: (0.1 * rng.standard_normal(a.shape)).astype(a.dtype), trainer.abstract_params
    )
    return trainer, params


def _sft_batch(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "tokens_bs": rng.integers(3, 60, (4, 12)).astype(np.int32),
        "loss_mask_bs": np.tile(np.arange(12) >= 6, (4, 1)),
    }


def _rl_batch(seed: int):
    """8 rollouts in 2 groups with spread rewards (non-zero advantages)."""
    rng = np.random.default_rng(seed)
    rollouts = [
        Rollout(
            prompt_ids=rng.integers(3, 60, 5).astype(np.int32),
            completion_ids=rng.integers(3, 60, 1 + i % 4).astype(np.int32),
            behaviour_logprobs=np.full(1 + i % 4, -4.0, np.float32),
            policy_version=0,
            reward=float(i % 3),
            group_id=i // 4,
        )
        for i in range(8)
    ]
    return collate_rollouts(rollouts, prompt_len=8, completion_len=4, pad_id=0)


def _leaves(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


def _dtypes(tree) -> set:
    return {x.dtype for x in jax.tree.leaves(tree)}


def _check_master(state) -> None:
    """bf16 params that are exactly the cast of float32 master weights; Adam's moments fp32."""
    assert isinstance(state.opt_state, MasterWeightsState)
    assert _dtypes(state.params) == {jnp.dtype(jnp.bfloat16)}
    assert _dtypes(state.opt_state.master) == {jnp.dtype(jnp.float32)}
    moments = [x for x in jax.tree.leaves(state.opt_state.inner) if x.ndim]
    assert moments and {x.dtype for x in moments} == {jnp.dtype(jnp.float32)}
    for w, p in zip(_leaves(state.opt_state.master), _leaves(state.params), strict=True):
        assert np.array_equal(w.astype(jnp.bfloat16), p)


def test_bf16_params_train_in_sft_and_rl_steps(setup):
    trainer, params0 = setup
    assert trainer.master_weights
    state = trainer.init(params0)
    _check_master(state)
    for step in range(2):
        state, metrics = trainer.sft_step(state, _sft_batch(step))
        assert np.isfinite(float(metrics["loss"])) and float(metrics["grad_norm"]) > 0
    for step in range(2):
        state, metrics = trainer.rl_step(state, _rl_batch(step))
        assert np.isfinite(float(metrics["loss"])) and float(metrics["grad_norm"]) > 0
    assert int(state.step) == 4
    _check_master(state)
    before, after = _leaves(params0), _leaves(state.params)
    assert all(not np.array_equal(a, b) for a, b in zip(after, before, strict=True))
    # The master weights hold what bf16 cannot: they are not all bf16 numbers.
    master = _leaves(state.opt_state.master)
    assert any(not np.array_equal(w, w.astype(jnp.bfloat16).astype(np.float32)) for w in master)


def test_fp32_params_with_bf16_compute_have_no_master_copy():
    config = dataclasses.replace(CONFIG, param_dtype="float32")  # compute stays bf16
    mesh = make_mesh(MeshConfig(("fsdp", "tp"), (1, 1), num_devices=1))
    trainer = Trainer(config, mesh, TRAINER_RULES, optax.adam(1e-3))
    assert not trainer.master_weights
    abstract = trainer.abstract_state()
    assert not isinstance(abstract.opt_state, MasterWeightsState)
    assert _dtypes(abstract.params) == {jnp.dtype(jnp.float32)}


def test_updates_below_bf16_resolution_are_kept_by_the_master_weights():
    """SGD steps of 1e-3 on a weight of 1.0 (bf16 spacing below 1: 2^-8 ~ 0.0039): 20 of them
    move it to 0.98 in the master weights and 0.98046875 (its bf16 cast) in the params; applied
    to the bf16 param directly each rounds back to 1.0 and the weight never moves."""
    params = {"w": jnp.ones((3,), jnp.bfloat16)}
    grads = {"w": jnp.full((3,), 1e-3, jnp.bfloat16)}
    plain = init_state(params, optax.sgd(1.0))
    master = init_state(params, with_master_weights(optax.sgd(1.0)))
    for _ in range(20):
        plain, _ = apply_gradients(plain, grads, optax.sgd(1.0))
        master, _ = apply_gradients(master, grads, with_master_weights(optax.sgd(1.0)))
    assert np.all(np.asarray(plain.params["w"], np.float32) == 1.0)
    np.testing.assert_allclose(np.asarray(master.opt_state.master["w"]), 0.98, rtol=1e-4)
    assert master.params["w"].dtype == jnp.bfloat16
    assert np.all(np.asarray(master.params["w"], np.float32) == 0.98046875)


def test_bf16_resume_from_a_checkpoint_is_bitwise(setup, tmp_path):
    trainer, params0 = setup
    straight = trainer.init(params0)
    for step in range(3):
        straight, _ = trainer.sft_step(straight, _sft_batch(10 + step))

    def run_io():
        return RunIO(
            str(tmp_path / "run"), total_steps=3, save_every_steps=1, keep_last_n=1, desc="bf16"
        )

    state, _ = trainer.sft_step(trainer.init(params0), _sft_batch(10))
    io = run_io()
    io.save(state, {"data_position": 1}, force=True)
    io.close()
    del state
    io = run_io()
    state, extra = io.restore(trainer.abstract_state())
    fp32_config = dataclasses.replace(CONFIG, param_dtype="float32")
    fp32 = Trainer(fp32_config, trainer.mesh, TRAINER_RULES, OPTIMIZER.make(10))
    with pytest.raises(CheckpointMismatchError, match="param_dtype differs"):
        io.restore(fp32.abstract_state())
    io.close()
    assert int(state.step) == 1 and extra["data_position"] == 1
    _check_master(state)  # the checkpoint holds the float32 master weights, not just their cast
    for step in range(1, 3):
        state, _ = trainer.sft_step(state, _sft_batch(10 + step))
    for a, b in zip(_leaves(state), _leaves(straight), strict=True):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("generator_dtype", [None, "float32"])
def test_push_gives_the_generator_the_trainer_params(setup, generator_dtype):
    """Async mode's push (trainer devices 0-1 -> generator devices 4-5): the bf16 params as they
    are (`generator_dtype` None, what "auto" gives on CPU) or cast exactly to float32."""
    trainer, params0 = setup
    state = trainer.init(params0)
    gen_mesh = make_mesh(MeshConfig(("dp", "tp"), (2, 1), first_device=4, num_devices=2))
    shardings = generator_param_shardings(trainer, gen_mesh, GENERATOR_RULES)
    sync = make_weight_sync(trainer.param_shardings, shardings, generator_dtype=generator_dtype)
    weights = GeneratorWeights(sync, latest_only=False)
    weights.publish(state.params, 1)
    pushed = weights.acquire(1).params
    want = jnp.dtype(generator_dtype or jnp.bfloat16)
    for got, p, sharding in zip(
        jax.tree.leaves(pushed),
        _leaves(state.params),
        jax.tree.leaves(shardings),
        strict=True,
    ):
        assert got.dtype == want and got.sharding.is_equivalent_to(sharding, got.ndim)
        assert np.array_equal(np.asarray(got), p.astype(want))
    weights.free()


def test_lora_trains_bf16_adapters_on_a_frozen_bf16_base(setup):
    trainer, params0 = setup
    lora = lora_lib.LoraConfig(rank=4, alpha=8.0, target_kernels="q|v")
    lora_trainer = Trainer(CONFIG, trainer.mesh, TRAINER_RULES, optax.adam(1e-2), lora=lora)
    assert lora_trainer.master_weights  # the adapters are bf16, as the kernels they adapt
    state = lora_trainer.init(params0)
    for step in range(2):
        state, metrics = lora_trainer.sft_step(state, _sft_batch(step))
        assert np.isfinite(float(metrics["loss"])) and float(metrics["grad_norm"]) > 0
    _check_master(state)
    base = _leaves(lora_trainer.base_params)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(base, _leaves(params0), strict=True))
    b_leaves = [
        np.asarray(x)
        for path, x in jax.tree_util.tree_leaves_with_path(state.params)
        if jax.tree_util.keystr(path).endswith("_lora_b']")
    ]
    assert len(b_leaves) == 2 and all(np.any(b) for b in b_leaves)

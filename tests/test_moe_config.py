"""The tiny mixture-of-experts policy (`arith_tiny_moe`, configs/rl/arith_tiny_moe*.gin): the
preset is arith_tiny with 8 experts, top 2, whose active parameters match arith_tiny's; the
configs bind it; the async config's trainer mesh splits its experts (its learning runs:
docs/models.md, "A tiny MoE policy")."""

from __future__ import annotations

import os

import gin
import jax
import optax
from flax import nnx

from jaxrl.infra.config import from_gin, parse_gin
from jaxrl.infra.mesh import MeshConfig, make_mesh
from jaxrl.infra.sharding import TRAINER_RULES
from jaxrl.job.specs import PolicySpec, TaskSpec, build_model_config, build_tokenizer
from jaxrl.models.transformer import Transformer
from jaxrl.train.trainer import LossConfig, Trainer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = [os.path.join(REPO, "configs", "rl", f"arith_tiny_moe{s}.gin") for s in ("", "_sync")]


def _config(preset: str):
    tokenizer = build_tokenizer(PolicySpec(preset=preset), TaskSpec())
    return build_model_config(PolicySpec(preset=preset), tokenizer), tokenizer


def _active_params(c) -> int:
    """Parameters a token uses: the experts it is not routed to left out."""
    idle = c.num_experts - c.num_experts_per_tok
    return c.num_params() - len(c.moe_layers) * idle * 3 * c.hidden_size * c.moe_intermediate_size


def test_preset_is_arith_tiny_with_8_experts_top_2():
    moe, _ = _config("arith_tiny_moe")
    dense, _ = _config("arith_tiny")
    assert moe.model_type == "qwen3_moe" and moe.moe_layers == (0, 1)
    assert (moe.num_experts, moe.num_experts_per_tok, moe.norm_topk_prob) == (8, 2, True)
    assert moe.router_aux_loss_coef == 0.01 and LossConfig().router_aux_coef(moe) == 0.01
    # The attention, embedding and sizes of arith_tiny; a token's two experts are its MLP's width.
    for field in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                  "head_dim", "max_position_embeddings", "eos_token_id"):  # fmt: skip
        assert getattr(moe, field) == getattr(dense, field), field
    assert moe.num_experts_per_tok * moe.moe_intermediate_size == dense.intermediate_size
    active, total = _active_params(moe), moe.num_params()
    print(f"arith_tiny {dense.num_params()}, arith_tiny_moe {total} ({active} active)")
    assert abs(active - dense.num_params()) <= 0.01 * dense.num_params()
    assert total > 3 * dense.num_params()


def test_configs_bind_the_preset():
    import launch.rl  # noqa: F401  (registers the launch configs in gin)

    for path, mode in zip(CONFIGS, ("async", "sync"), strict=True):
        try:
            parse_gin([path], [])
            assert from_gin(PolicySpec).preset == "arith_tiny_moe", path
            assert gin.query_parameter("RLConfig.mode") == mode, path
        finally:
            gin.clear_config()


def test_experts_split_over_the_trainer_mesh():
    """configs/rl/arith_tiny_moe.gin's trainer mesh (fsdp 2 x tp 2): 4 whole experts per fsdp
    shard, each split along its width over tp (train steps on such a split:
    tests/test_moe.py::test_experts_sharded_match_one_device, tests/test_moe_training.py)."""
    config, _ = _config("arith_tiny_moe")
    mesh = make_mesh(MeshConfig(("fsdp", "tp"), (2, 2), num_devices=4))
    trainer = Trainer(config, mesh, TRAINER_RULES, optax.adam(1e-3))
    make = lambda: nnx.to_pure_dict(nnx.state(Transformer(config, rngs=nnx.Rngs(0))))
    state = trainer.init(jax.jit(make)())
    gate = state.params["layers"][0]["mlp"]["gate_kernel"]
    assert gate.shape == (8, 128, 192)
    assert tuple(gate.sharding.spec) == ("fsdp", None, "tp")
    assert gate.addressable_shards[0].data.shape == (4, 128, 96)

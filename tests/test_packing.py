"""Padding-free batches (`jaxrl.rl.packing`): packed and padded batches give the same RL and SFT
loss and gradients through `Trainer` (sharded, with gradient accumulation: several packing
groups), attention never crosses a segment, and the packer's layout and errors."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from jaxrl.infra.mesh import MeshConfig, make_mesh
from jaxrl.infra.sharding import TRAINER_RULES
from jaxrl.models.config import ModelConfig
from jaxrl.models.transformer import Transformer
from jaxrl.rl import Rollout, collate_rollouts
from jaxrl.rl.packing import (
    PackedRolloutBatch,
    auto_row_length,
    bucket_rows,
    first_fit_rows,
    pack_rollout_batch,
    pack_sft_batch,
    segment_mask,
)
from jaxrl.train.trainer import LossConfig, Trainer

CONFIG = ModelConfig("llama", 64, 32, 64, 2, 4, 2, 8, max_position_embeddings=64)
PROMPT_LEN, COMPLETION_LEN = 8, 7


def _params() -> dict:
    model = Transformer(CONFIG, rngs=nnx.Rngs(0), init_std=0.3)
    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model)))


def _rollout_batch(batch_size: int = 16, invalid: int = 2):
    """Ragged rollouts (prompts 1..8, completions 1..7 tokens), the last `invalid` rows padding,
    behaviour log-probs that put AIPO ratios on both sides of rho."""
    rng = np.random.default_rng(0)
    rollouts = []
    for i in range(batch_size - invalid):
        prompt = rng.integers(3, CONFIG.vocab_size, size=int(rng.integers(1, PROMPT_LEN + 1)))
        length = int(rng.integers(1, COMPLETION_LEN + 1))
        behaviour = rng.normal(-4.0, 1.0, size=length).astype(np.float32)
        completion = rng.integers(3, CONFIG.vocab_size, size=length)
        rollouts.append(Rollout(prompt, completion, behaviour, 0, float(rng.random()), i // 2))
    return collate_rollouts(
        rollouts,
        prompt_len=PROMPT_LEN,
        completion_len=COMPLETION_LEN,
        pad_id=0,
        batch_size=batch_size,
    )


def _step(trainer: Trainer, kind: str, batch):
    """(metrics, gradient): one step from `_params()` under SGD of rate 1."""
    params = _params()
    with jax.default_matmul_precision("highest"):
        state = trainer.init(params)
        if kind == "rl":
            state, metrics = trainer.rl_step(state, batch)
        else:
            state, metrics = trainer.sft_step(state, batch)
    grad = jax.tree.map(lambda p, q: p - np.asarray(q), params, state.params)
    return jax.device_get(metrics), grad


def _assert_same(padded, packed, keys):
    (m_pad, g_pad), (m_pack, g_pack) = padded, packed
    for key in keys:
        np.testing.assert_allclose(float(m_pack[key]), float(m_pad[key]), rtol=1e-5, err_msg=key)
    norm = lambda tree: float(np.sqrt(sum(np.sum(x.astype(np.float64) ** 2) for x in tree)))  # noqa: E731
    leaves_pad, leaves_pack = jax.tree.leaves(g_pad), jax.tree.leaves(g_pack)
    relative = norm([a - b for a, b in zip(leaves_pad, leaves_pack, strict=True)]) / norm(
        leaves_pad
    )
    print(f"gradient: |packed - padded| / |padded| = {relative:.2e}")
    assert relative <= 1e-5
    assert min(float(np.abs(g).max()) for g in leaves_pad) > 0


@pytest.mark.parametrize("loss_name", ["aipo", "grpo"])
def test_packed_rl_step_equals_padded(loss_name):
    """2 x 2 trainer mesh (2 data-parallel shards) x 2 micro-batches = 4 packing groups; both
    a token-normalised (AIPO) and a sequence-normalised (GRPO) loss, with an entropy bonus."""
    batch = _rollout_batch()
    mesh = make_mesh(MeshConfig(("fsdp", "tp"), (2, 2)))
    loss = LossConfig(name=loss_name, entropy_coef=0.01)

    def trainer(pack_length):
        return Trainer(
            CONFIG,
            mesh,
            TRAINER_RULES,
            optax.sgd(1.0),
            grad_accum_steps=2,
            loss=loss,
            pack_length=pack_length,
        )

    packed_batch = pack_rollout_batch(batch, 24, groups=4)
    padded_tokens = batch.batch_size * (PROMPT_LEN + COMPLETION_LEN)
    packed_tokens = packed_batch.tokens_rl.size
    print(f"tokens through the model: padded {padded_tokens}, packed {packed_tokens}")
    assert packed_tokens < padded_tokens
    keys = ["loss", "entropy", "grad_norm"]
    _assert_same(_step(trainer(0), "rl", batch), _step(trainer(24), "rl", batch), keys)


def test_packed_sft_step_equals_padded():
    rng = np.random.default_rng(1)
    tokens = rng.integers(3, CONFIG.vocab_size, size=(16, 16)).astype(np.int32)
    loss_mask = np.zeros((16, 16), bool)
    for i in range(16):  # prompt of 2..6 tokens, answer of 1..5, then padding
        prompt, answer = int(rng.integers(2, 7)), int(rng.integers(1, 6))
        loss_mask[i, prompt : prompt + answer] = True
        tokens[i, prompt + answer :] = 0
    batch = {"tokens_bs": tokens, "loss_mask_bs": loss_mask}
    mesh = make_mesh(MeshConfig(("fsdp", "tp"), (2, 1), num_devices=2))

    def trainer(pack_length):
        return Trainer(
            CONFIG,
            mesh,
            TRAINER_RULES,
            optax.sgd(1.0),
            grad_accum_steps=2,
            pack_length=pack_length,
        )

    packed = pack_sft_batch(batch, 16, groups=4)
    print(f"SFT rows: padded {tokens.shape}, packed {packed['tokens_bs'].shape}")
    assert packed["tokens_bs"].size < tokens.size
    keys = ["loss", "token_confident_fraction"]
    # "auto": rows as wide as the batch's, 16 tokens
    _assert_same(_step(trainer(0), "sft", batch), _step(trainer("auto"), "sft", batch), keys)


def test_attention_does_not_cross_segments():
    """Changing every token of one segment leaves the other segments' logits bit-identical (and
    changes its own)."""
    packed = pack_rollout_batch(_rollout_batch(invalid=0), 32)
    model = Transformer(CONFIG, rngs=nnx.Rngs(0), init_std=0.3)
    forward = jax.jit(lambda t: model.hidden_states(t, packed.positions_rl, mask)[0])
    mask = segment_mask(packed.segment_rl)
    row = int(np.argmax(packed.segment_rl.max(axis=1)))  # the row with most segments
    assert packed.segment_rl[row].max() >= 3
    target = packed.segment_rl == 2
    target[np.arange(len(target)) != row] = False
    changed = np.where(target, (packed.tokens_rl + 1) % CONFIG.vocab_size, packed.tokens_rl)
    before, after = np.asarray(forward(packed.tokens_rl)), np.asarray(forward(changed))
    others = ~target & (packed.segment_rl > 0)
    np.testing.assert_array_equal(before[others], after[others])
    assert np.abs(before[target] - after[target]).max() > 1e-2


def test_layout_and_errors():
    batch = _rollout_batch(batch_size=8, invalid=1)
    packed = pack_rollout_batch(batch, 20, groups=2)
    assert isinstance(packed, PackedRolloutBatch)
    lengths = batch.prompt_mask_bp.sum(1) + batch.completion_mask_bt.sum(1)
    # every valid rollout's tokens appear once, as one segment, prompt then completion
    for i in range(7):
        prompt = batch.prompt_ids_bp[i][batch.prompt_mask_bp[i]]
        completion = batch.completion_ids_bt[i][batch.completion_mask_bt[i]]
        rows = packed.tokens_rl[(i // 4) * len(packed.tokens_rl) // 2 :]
        start = packed.predict_index_bt[i, 0] - len(prompt) + 1
        flat = rows.reshape(-1)
        np.testing.assert_array_equal(flat[start : start + lengths[i]], np.r_[prompt, completion])
    assert packed.segment_rl.astype(bool).sum() == lengths[:7].sum()
    np.testing.assert_array_equal(packed.completion_ids_bt, batch.completion_ids_bt)
    assert first_fit_rows([5, 3, 4, 2, 0], 7) == [[0, 3], [2, 1]]
    assert [bucket_rows(n) for n in (1, 8, 9, 17, 33, 100)] == [1, 8, 9, 18, 36, 104]
    with pytest.raises(ValueError, match="more than the pack length 10; set the pack length"):
        pack_rollout_batch(batch, 10)
    with pytest.raises(ValueError, match="does not split into 3 packing groups"):
        pack_rollout_batch(batch, 20, groups=3)
    mesh = make_mesh(MeshConfig(("fsdp", "tp"), (1, 1)))
    for bad in (-1, "padded"):
        with pytest.raises(ValueError, match=f"pack_length={bad!r}: use 0"):
            Trainer(CONFIG, mesh, TRAINER_RULES, optax.sgd(1.0), pack_length=bad)


def test_auto_rows_hold_one_group_at_full_length_at_most_four_padded_rows():
    """`pack_length="auto"`: P + G * T for the batch's largest group (padding rows not counted),
    capped at 4 x (P + T); the splash kernel cannot pack, so there "auto" trains padded."""
    batch = _rollout_batch(batch_size=8, invalid=1)  # groups of 2: i // 2
    assert auto_row_length(batch) == PROMPT_LEN + 2 * COMPLETION_LEN
    wide = _rollout_batch(batch_size=16, invalid=1)
    wide = dataclasses.replace(wide, group_id_b=np.zeros(16, np.int32))  # one group of 15
    assert auto_row_length(wide) == 4 * (PROMPT_LEN + COMPLETION_LEN)
    mesh = make_mesh(MeshConfig(("fsdp", "tp"), (1, 1)))
    trainer = Trainer(CONFIG, mesh, TRAINER_RULES, optax.sgd(1.0), pack_length="auto")
    assert trainer.share_prompts and trainer.layout_batch(batch).tokens_rl.shape[1] == 22
    pallas = dataclasses.replace(CONFIG, attention_impl="pallas")
    trainer = Trainer(pallas, mesh, TRAINER_RULES, optax.sgd(1.0), pack_length="auto")
    assert trainer.pack_length == 0 and not trainer.share_prompts

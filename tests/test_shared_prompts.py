"""Shared-prompt training (`Trainer(share_prompts=...)`, `jaxrl.rl.packing`): each group's prompt
packed once before its completions gives the repeated-prompt step's loss and gradients (ragged
groups, several groups per row, groups cut by micro-batches, FSDP x TP, the KL reference pass;
scanned + rematerialised layers; LoRA), a completion never sees another completion of its group,
and XLA's FLOPs of the step fall by the share of prompt tokens no longer repeated."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxrl.infra.mesh import MeshConfig, make_mesh
from jaxrl.infra.sharding import TRAINER_RULES
from jaxrl.models.config import ModelConfig
from jaxrl.models.transformer import Transformer
from jaxrl.rl import Rollout, collate_rollouts
from jaxrl.rl.packing import pack_rollout_batch, segment_mask
from jaxrl.train import lora as lora_lib
from jaxrl.train.steps import completion_logprobs
from jaxrl.train.trainer import LossConfig, Trainer

CONFIG = ModelConfig("llama", 64, 32, 64, 2, 4, 2, 8, max_position_embeddings=64)
PROMPT_LEN, COMPLETION_LEN, PACK = 10, 7, 40
GROUP_SIZES = (3, 5, 2, 4, 1, 3, 4)  # 22 rollouts; groups straddle the 4 packing groups of 6


def _rollout_batch(sizes=GROUP_SIZES, batch_size: int = 24):
    """Ragged groups: prompts of 2..10 tokens shared by a group's samples, completions of 1..7
    tokens, behaviour log-probs on both sides of the policy's; the last rows fill the bucket."""
    rng = np.random.default_rng(0)
    rollouts = []
    for group, size in enumerate(sizes):
        prompt = rng.integers(3, CONFIG.vocab_size, size=int(rng.integers(2, PROMPT_LEN + 1)))
        for _ in range(size):
            length = int(rng.integers(1, COMPLETION_LEN + 1))
            completion = rng.integers(3, CONFIG.vocab_size, size=length)
            behaviour = rng.normal(-4.0, 1.0, size=length).astype(np.float32)
            rollouts.append(Rollout(prompt, completion, behaviour, 0, float(rng.random()), group))
    return collate_rollouts(
        rollouts,
        prompt_len=PROMPT_LEN,
        completion_len=COMPLETION_LEN,
        pad_id=0,
        batch_size=batch_size,
    )


@functools.cache
def _params(config: ModelConfig, seed: int) -> dict:
    model = Transformer(config, rngs=nnx.Rngs(seed), init_std=0.3)
    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model)))


def _step(config, share: bool, lora, mesh_shape, grad_accum_steps):
    """(metrics, gradient) of one SGD(1) step of GRPO + entropy bonus + KL to a reference (a
    second random model; with LoRA the base), `grad_accum_steps` micro-batches on an FSDP x TP
    mesh of `mesh_shape`."""
    mesh = make_mesh(MeshConfig(("fsdp", "tp"), mesh_shape, num_devices=int(np.prod(mesh_shape))))
    trainer = Trainer(
        config,
        mesh,
        TRAINER_RULES,
        optax.sgd(1.0),
        grad_accum_steps=grad_accum_steps,
        loss=LossConfig(name="grpo", entropy_coef=0.01, kl_coef=0.1),
        lora=lora,
        pack_length=PACK,
        share_prompts=share,
    )
    assert trainer.share_prompts == share
    params = _params(config, 0)
    with jax.default_matmul_precision("highest"):
        state = trainer.init(params)
        ref = None
        if lora is None:
            ref = jax.device_put(_params(config, 1), trainer.param_shardings)
        else:  # B = 0 at init would zero every A's gradient: start from random adapters
            rng = np.random.default_rng(2)
            adapters = jax.tree.map(
                lambda x: (0.3 * rng.standard_normal(x.shape)).astype(x.dtype), state.params
            )
            state = state.replace(params=jax.device_put(adapters, trainer.param_shardings))
        before = jax.device_get(state.params)
        state, metrics = trainer.rl_step(state, _rollout_batch(), ref)
    grad = jax.tree.map(lambda p, q: p - np.asarray(q), before, jax.device_get(state.params))
    return jax.device_get(metrics), grad


@pytest.mark.parametrize(
    "variant",
    [
        # scanned, rematerialised layers; FSDP 2 x TP 2, 2 micro-batches: 4 packing groups
        "scan_remat_fsdp_tp",
        # LoRA (adapters on every projection; unrolled layers, as LoRA runs are); FSDP 2
        "lora",
    ],
)
def test_shared_step_equals_repeated(variant):
    if variant == "lora":
        config, lora, mesh_shape, accum = CONFIG, lora_lib.LoraConfig(rank=2, alpha=4.0), (2, 1), 1
    else:
        config = ModelConfig(
            "llama", 64, 32, 64, 2, 4, 2, 8, max_position_embeddings=64,
            scan_layers=True, remat_policy="full",
        )  # fmt: skip
        lora, mesh_shape, accum = None, (2, 2), 2
    m_rep, g_rep = _step(config, False, lora, mesh_shape, accum)
    m_sh, g_sh = _step(config, True, lora, mesh_shape, accum)
    for key in ("loss", "entropy", "kl", "grad_norm"):
        print(f"{key}: repeated {float(m_rep[key]):.8g}, shared {float(m_sh[key]):.8g}")
        np.testing.assert_allclose(float(m_sh[key]), float(m_rep[key]), rtol=1e-5, err_msg=key)
    leaves_rep = jax.tree_util.tree_leaves_with_path(g_rep)
    leaves_sh = jax.tree.leaves(g_sh)
    worst = 0.0
    for (path, a), b in zip(leaves_rep, leaves_sh, strict=True):
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        assert np.abs(a64).max() > 0, f"{jax.tree_util.keystr(path)}: zero gradient"
        worst = max(worst, np.linalg.norm(a64 - b64) / np.linalg.norm(a64))
    print(
        f"{variant}: {len(leaves_sh)} gradients, worst |shared - repeated| / |repeated| {worst:.2e}"
    )
    assert worst <= 1e-5


def _assert_predicts_from_its_prompt(batch, packed, groups: int) -> None:
    """Completion token 0 of each rollout is predicted from its prompt's last token, token t > 0
    from its own token t - 1, at the repeated layout's positions."""
    prompts, completions = batch.prompt_mask_bp.sum(1), batch.completion_mask_bt.sum(1)
    flat = packed.tokens_rl.reshape(groups, -1)
    positions = packed.positions_rl.reshape(groups, -1)
    per = batch.batch_size // groups
    for i in np.flatnonzero(batch.valid_b):
        g, n, index = i // per, completions[i], packed.predict_index_bt[i]
        assert flat[g, index[0]] == batch.prompt_ids_bp[i, -1]
        np.testing.assert_array_equal(flat[g, index[1:n]], batch.completion_ids_bt[i, : n - 1])
        np.testing.assert_array_equal(positions[g, index[:n]], prompts[i] - 1 + np.arange(n))


def test_layout_shares_each_prompt_once():
    batch = _rollout_batch()
    repeated = pack_rollout_batch(batch, PACK, groups=4)
    shared = pack_rollout_batch(batch, PACK, groups=4, share_prompts=True)
    prompts, completions = batch.prompt_mask_bp.sum(1), batch.completion_mask_bt.sum(1)
    # Packing group g holds rollouts 6g..6g+5; a group's prompt appears once per packing group
    # that holds some of its samples (all fit one row here).
    groups = np.asarray(batch.group_id_b)
    firsts = [
        i
        for g in range(4)
        for i in range(6 * g, 6 * g + 6)
        if batch.valid_b[i] and (i == 6 * g or groups[i] != groups[i - 1])
    ]
    expected = prompts[firsts].sum() + completions[batch.valid_b].sum()
    assert (shared.segment_rl > 0).sum() == expected < (repeated.segment_rl > 0).sum()
    _assert_predicts_from_its_prompt(batch, shared, 4)
    # Rows just long enough for the longest rollout: groups are cut into several units, each
    # with its own copy of the prompt, and every completion still reads its prompt.
    longest = int((prompts + completions)[batch.valid_b].max())
    tight = pack_rollout_batch(batch, longest, groups=4, share_prompts=True)
    assert (tight.segment_rl > 0).sum() > expected
    _assert_predicts_from_its_prompt(batch, tight, 4)
    with pytest.raises(ValueError, match=f"set the pack length to at least {longest} "):
        pack_rollout_batch(batch, longest - 1, share_prompts=True)
    with pytest.raises(ValueError, match="needs pack_length > 0"):
        Trainer(CONFIG, make_mesh(MeshConfig(("fsdp", "tp"), (1, 1), num_devices=1)),
                TRAINER_RULES, optax.sgd(1.0), share_prompts=True)  # fmt: skip
    with pytest.raises(ValueError, match="sees key validity only"):
        Trainer(CONFIG.replace(attention_impl="pallas"),
                make_mesh(MeshConfig(("fsdp", "tp"), (1, 1), num_devices=1)),
                TRAINER_RULES, optax.sgd(1.0), pack_length=64)  # fmt: skip


def test_completion_never_attends_to_its_siblings():
    """Every token of completion j changed: the log-probs of the other completions of its group
    (which share its prompt's keys and values in one row) are bitwise unchanged; j's change."""
    batch = _rollout_batch()
    graphdef, state = nnx.split(Transformer(CONFIG, rngs=nnx.Rngs(0), init_std=0.3))

    @jax.jit
    def logprobs(state, packed):
        return completion_logprobs(nnx.merge(graphdef, state), packed, LossConfig(), False)[0]

    j = 4  # the second sample of the group of 5 (rollouts 3..7)
    group = np.flatnonzero(np.asarray(batch.group_id_b) == batch.group_id_b[j])
    changed = np.asarray(batch.completion_ids_bt).copy()
    changed[j] = (changed[j] + 1) % CONFIG.vocab_size
    before = pack_rollout_batch(batch, 64, share_prompts=True)
    after = pack_rollout_batch(batch.replace(completion_ids_bt=changed), 64, share_prompts=True)
    # one row holds the group's prompt once, then its completions
    row = before.predict_index_bt[group, 0] // 64
    assert len(set(row)) == 1 and len(set(before.predict_index_bt[group, 0])) == 1
    mask = np.asarray(segment_mask(jnp.asarray(before.segment_rl), jnp.asarray(before.prefix_rl)))
    lp_before, lp_after = np.asarray(logprobs(state, before)), np.asarray(logprobs(state, after))
    valid = batch.completion_mask_bt
    others = [i for i in range(batch.batch_size) if i != j and batch.valid_b[i]]
    np.testing.assert_array_equal(lp_before[others], lp_after[others])
    assert np.abs(lp_before[j] - lp_after[j])[valid[j]].min() > 1e-3
    # and the mask says so: completion j's keys are seen by j's own queries only
    assert valid[j].sum() >= 2
    r, c = divmod(int(before.predict_index_bt[j, 1]), 64)  # completion j's first token
    cols_j = np.flatnonzero(before.segment_rl[r] == before.segment_rl[r, c])
    assert len(cols_j) == valid[j].sum()
    np.testing.assert_array_equal(np.flatnonzero(mask[r][:, cols_j].any(axis=1)), cols_j)


def test_step_flops_fall_by_the_prompt_share():
    """128-token prompts, G = 8, 32-token completions, 15 groups, rows of 1920 tokens (10 full
    rows repeated, 3 shared): XLA's FLOPs of the train step fall by (G - 1) / G x prompt tokens /
    all tokens = 7/8 x 128/160 = 0.7, within 10%."""
    config = ModelConfig("llama", 128, 64, 128, 2, 4, 2, 16, max_position_embeddings=256)
    g, prompt_len, completion_len, groups = 8, 128, 32, 15
    rng = np.random.default_rng(0)
    rollouts = [
        Rollout(
            prompt,
            rng.integers(3, 128, completion_len),
            np.full(completion_len, -4.0, np.float32),
            0,
            float(rng.random()),
            k,
        )
        for k in range(groups)
        for prompt in [rng.integers(3, 128, prompt_len)]
        for _ in range(g)
    ]
    batch = collate_rollouts(
        rollouts, prompt_len=prompt_len, completion_len=completion_len, pad_id=0
    )
    mesh = make_mesh(MeshConfig(("fsdp", "tp"), (1, 1), num_devices=1))
    flops = {}
    for share in (False, True):
        trainer = Trainer(
            config, mesh, TRAINER_RULES, optax.sgd(1.0), loss=LossConfig(name="grpo"),
            pack_length=1920, share_prompts=share,
        )  # fmt: skip
        packed = pack_rollout_batch(batch, 1920, share_prompts=share)
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), packed)
        cost = trainer.lower_rl_step(abstract).cost_analysis()
        flops[share] = float((cost[0] if isinstance(cost, list) else cost)["flops"])
        print(
            f"share_prompts={share}: rows {packed.tokens_rl.shape}, {flops[share] / 1e9:.3f} GFLOP"
        )
    predicted = (g - 1) / g * prompt_len / (prompt_len + completion_len)
    fall = 1 - flops[True] / flops[False]
    print(f"FLOPs fall {fall:.4f}, predicted {predicted:.4f}")
    assert abs(fall - predicted) <= 0.1 * predicted

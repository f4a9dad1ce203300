"""Each named loss preset against a NumPy reference of its published formula (value and gradient).

The path under test is the one the trainer takes: `LossConfig(name=...)` resolves the preset's
advantage estimator and loss (normaliser, clip range, rho), nothing else set.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.rl import PolicyLossInputs, make_advantage_estimator
from jaxrl.train.trainer import LossConfig

EPS_STD = 1e-6  # the advantage estimators' default eps


@pytest.fixture(scope="module")
def batch():
    """3 groups of 4 samples; completions of 1-6 tokens in a T=8 buffer; ratios on every side of
    1 +- 0.2, of 1.28 (DAPO's eps_high) and of rho = 4, none on a boundary."""
    rng = np.random.default_rng(7)
    g, n, t = 3, 4, 8
    b = g * n
    group = np.repeat(np.arange(g), n)
    reward = rng.choice([0.0, 0.5, 1.0], size=b)
    reward[:n] = [0.0, 1.0, 1.0, 0.2]  # groups with distinct spreads, so std scaling matters
    lengths = rng.integers(1, 7, size=b)
    mask = np.arange(t)[None, :] < lengths[:, None]
    logpi = -rng.uniform(0.1, 3.0, size=(b, t))
    ratio = rng.choice([0.5, 0.9, 1.05, 1.25, 1.5, 5.0], size=(b, t))
    logmu = logpi - np.log(ratio)
    f32 = lambda x: np.asarray(x, np.float32)
    return dict(
        reward=f32(reward),
        group=group.astype(np.int32),
        mask=mask,
        logpi=f32(np.where(mask, logpi, np.nan)),  # padding holds garbage
        logmu=f32(np.where(mask, logmu, -np.inf)),
    )


def _jax_loss_and_grad(config: LossConfig, d):
    advantage = make_advantage_estimator(config.advantage_name)
    adv_b = advantage(jnp.asarray(d["reward"]), jnp.asarray(d["group"]))
    loss_fn = config.make_loss()

    def f(logpi):
        inputs = PolicyLossInputs(
            logprobs_bt=logpi,
            behaviour_logprobs_bt=jnp.asarray(d["logmu"]),
            advantages_b=adv_b,
            mask_bt=jnp.asarray(d["mask"]),
        )
        return loss_fn(inputs)[0]

    loss, grad = jax.value_and_grad(f)(jnp.asarray(d["logpi"]))
    return float(loss), np.where(d["mask"], np.asarray(grad), 0.0)


# --- NumPy references, written from the papers -------------------------------------------------


def _group_adv(d, std: bool):
    r, gid = d["reward"].astype(np.float64), d["group"]
    adv = np.zeros_like(r)
    for g in np.unique(gid):
        rg = r[gid == g]
        a = rg - rg.mean()
        adv[gid == g] = a / (rg.std() + EPS_STD) if std else a  # population std (ddof=0)
    return adv


def _ppo_terms(d, adv, eps_low, eps_high):
    """Per-token -min(r A, clip(r) A) and its derivative wrt log pi (0 where the clip binds)."""
    m = d["mask"]
    logpi = np.where(m, d["logpi"], 0).astype(np.float64)
    ratio = np.exp(logpi - np.where(m, d["logmu"], 0).astype(np.float64))
    a = adv[:, None]
    unclipped, clipped = ratio * a, np.clip(ratio, 1 - eps_low, 1 + eps_high) * a
    loss_bt = -np.minimum(unclipped, clipped)
    dloss_bt = np.where(unclipped <= clipped, -ratio * a, 0.0)
    return np.where(m, loss_bt, 0), np.where(m, dloss_bt, 0)


def ref_grpo(d):
    """DeepSeekMath eq. 3: (1/G) sum_i (1/|o_i|) sum_t -min(...), A = (r - mean) / std."""
    loss_bt, dloss_bt = _ppo_terms(d, _group_adv(d, std=True), 0.2, 0.2)
    w_bt = d["mask"] / d["mask"].sum(1, keepdims=True) / len(loss_bt)
    return np.sum(w_bt * loss_bt), w_bt * dloss_bt


def ref_dr_grpo(d):
    """Dr. GRPO: sum_i sum_t -min(...) / (G * T_max), A = r - mean (no std)."""
    loss_bt, dloss_bt = _ppo_terms(d, _group_adv(d, std=False), 0.2, 0.2)
    w = 1.0 / (loss_bt.shape[0] * loss_bt.shape[1])
    return np.sum(w * loss_bt), w * dloss_bt


def ref_dapo(d):
    """DAPO eq. 8: sum_i sum_t -min(r A, clip(r, 0.8, 1.28) A) / sum_i |o_i|, A = (r - mean)/std."""
    loss_bt, dloss_bt = _ppo_terms(d, _group_adv(d, std=True), 0.2, 0.28)
    w = 1.0 / d["mask"].sum()
    return np.sum(w * loss_bt), w * dloss_bt


def ref_aipo(d):
    """LlamaRL AIPO: per token -min(pi/mu, rho) A log pi (weight not differentiated), rho = 4,
    token mean, A = r - mean."""
    m = d["mask"]
    logpi = np.where(m, d["logpi"], 0).astype(np.float64)
    ratio = np.exp(logpi - np.where(m, d["logmu"], 0).astype(np.float64))
    a = _group_adv(d, std=False)[:, None]
    weight = np.minimum(ratio, 4.0)
    w = 1.0 / m.sum()
    return np.sum(w * np.where(m, -weight * a * logpi, 0)), w * np.where(m, -weight * a, 0)


REFERENCES = {"grpo": ref_grpo, "dr_grpo": ref_dr_grpo, "dapo": ref_dapo, "aipo": ref_aipo}


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_preset_matches_published_formula(batch, name):
    loss, grad = _jax_loss_and_grad(LossConfig(name=name), batch)
    want_loss, want_grad = REFERENCES[name](batch)
    np.testing.assert_allclose(loss, want_loss, rtol=2e-5, atol=1e-7)
    np.testing.assert_allclose(grad, want_grad, rtol=2e-5, atol=1e-8)


def test_presets_are_distinguishable(batch):
    """Negative control: the references differ from each other on this batch by far more than
    the tolerance, so a preset resolved to another's settings fails the test above."""
    values = {name: ref(batch)[0] for name, ref in REFERENCES.items()}
    names = sorted(values)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            assert abs(values[a] - values[b]) > 1e-3 * max(abs(values[a]), 1e-3), (a, b, values)
    # The trap of the old `LossConfig(name="grpo")`: token normaliser and no std scaling.
    loss_bt, _ = _ppo_terms(batch, _group_adv(batch, std=False), 0.2, 0.2)
    old_grpo = loss_bt.sum() / batch["mask"].sum()
    assert abs(old_grpo - values["grpo"]) > 1e-2 * abs(values["grpo"])


def test_preset_settings_and_overrides():
    assert LossConfig(name="grpo").advantage_name == "group_mean_std"
    assert LossConfig(name="dr_grpo").advantage_name == "group_mean"
    assert LossConfig().advantage_name == "group_mean"  # aipo, the default
    dapo = LossConfig(name="dapo").make_loss()
    assert (dapo.clip_eps, dapo.clip_eps_high, dapo.normaliser) == (0.2, 0.28, "tokens")
    aipo = LossConfig().make_loss()
    assert (aipo.rho, aipo.normaliser) == (4.0, "tokens")
    # Overrides win over the preset.
    grpo = LossConfig(name="grpo", normaliser="tokens", advantage="group_mean")
    assert grpo.make_loss().normaliser == "tokens" and grpo.advantage_name == "group_mean"
    # A field the loss does not take is refused, naming it.
    with pytest.raises(TypeError, match="rho"):
        LossConfig(name="grpo", rho=2.0).validate()
    with pytest.raises(TypeError, match="clip_eps"):
        LossConfig(name="aipo", clip_eps=0.3).validate()

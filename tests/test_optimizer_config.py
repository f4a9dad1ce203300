"""OptimizerConfig: `max_grad_norm=None` is plain AdamW (NumPy reference); the AdamW fields."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.train.trainer import OptimizerConfig

LR, B1, B2, EPS, WD = 1e-2, 0.8, 0.95, 1e-6, 0.1


def numpy_adamw(params, grads_per_step):
    """AdamW (decoupled weight decay, bias-corrected moments), float64."""
    p = {k: v.astype(np.float64) for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v = {k: np.zeros_like(x) for k, x in p.items()}
    for t, grads in enumerate(grads_per_step, start=1):
        for k in p:
            g = grads[k].astype(np.float64)
            m[k] = B1 * m[k] + (1 - B1) * g
            v[k] = B2 * v[k] + (1 - B2) * g * g
            m_hat, v_hat = m[k] / (1 - B1**t), v[k] / (1 - B2**t)
            p[k] = p[k] - LR * (m_hat / (np.sqrt(v_hat) + EPS) + WD * p[k])
    return p


def _run(config: OptimizerConfig, params, grads_per_step):
    opt = config.make(total_steps=10)
    state = opt.init(params)
    for grads in grads_per_step:
        updates, state = opt.update(grads, state, params)
        params = jax.tree.map(lambda p, u: p + u, params, updates)
    return params


def _data():
    rng = np.random.default_rng(0)
    params = {"w": rng.normal(size=(3, 4)).astype(np.float32), "b": np.ones(4, np.float32)}
    # Gradients with a global norm ~40: clipping at 1 would change every update.
    grads = [
        {k: (10 * rng.normal(size=v.shape)).astype(np.float32) for k, v in params.items()}
        for _ in range(3)
    ]
    return params, grads


def test_no_clipping_is_plain_adamw():
    params, grads = _data()
    fields = dict(learning_rate=LR, b1=B1, b2=B2, eps=EPS, weight_decay=WD)
    got = _run(OptimizerConfig(max_grad_norm=None, **fields), params, grads)
    want = numpy_adamw(params, grads)
    for k in want:
        np.testing.assert_allclose(np.asarray(got[k]), want[k], rtol=1e-5, atol=1e-6)
    # Negative control: the default clips at 1.0, and its update is not AdamW's on raw grads.
    clipped = _run(OptimizerConfig(**fields), params, grads)
    assert np.max(np.abs(np.asarray(clipped["w"]) - want["w"])) > 1e-3


def test_no_clipping_has_no_norm_pass():
    """The optimizer's update holds one sqrt per leaf (AdamW's denominator) and, with clipping,
    one more for the global norm."""
    params, grads = _data()

    def sqrt_count(config):
        opt = config.make(10)
        jaxpr = jax.make_jaxpr(opt.update)(grads[0], opt.init(params), params)
        return str(jaxpr).count("sqrt")

    leaves = len(jax.tree.leaves(params))
    assert sqrt_count(OptimizerConfig(max_grad_norm=None)) == leaves
    assert sqrt_count(OptimizerConfig(max_grad_norm=1.0)) == leaves + 1


def test_bad_values_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="use None for no clipping"):
        OptimizerConfig(max_grad_norm=0.0)
    with pytest.raises(ValueError, match="eps"):
        OptimizerConfig(eps=0.0)
    with pytest.raises(ValueError, match="b2"):
        OptimizerConfig(b2=1.0)
    assert jnp.isfinite(OptimizerConfig().schedule_fn(10)(0))

"""Shared pieces of the fused-attention kernel tests (`tests/test_gpu_attention.py`,
`tests/test_tpu_attention.py`): the output and q / key / value gradients of an attention
function, random inputs, `[B, T]` segment / prefix ids from runs, relative errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def value_and_grads(attention):
    """out and d(sum(out * w))/d(q, k, v) of `attention(q, k, v, segment, prefix)`, jitted."""

    @jax.jit
    def run(q, k, v, segment, prefix, w):
        def loss(q, k, v):
            out = attention(q, k, v, segment, prefix)
            return (out * w).sum(), out

        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
        return out, grads

    return run


def inputs(seed, b, t, h, kv, d):
    """q, key, value and the loss weights w, fp32 normal."""
    rng = np.random.default_rng(seed)
    q, w = (jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32) for _ in range(2))
    k, v = (jnp.asarray(rng.normal(size=(b, t, kv, d)), jnp.float32) for _ in range(2))
    return q, k, v, w


def rows(t: int, *runs_per_row):
    """[B, t] segment and prefix from rows of (length, segment, prefix) runs; the rest 0."""
    n = len(runs_per_row)
    segment, prefix = np.zeros((n, t), np.int32), np.zeros((n, t), np.int32)
    for r, runs in enumerate(runs_per_row):
        col = 0
        for length, seg, pre in runs:
            segment[r, col : col + length], prefix[r, col : col + length] = seg, pre
            col += length
        assert col <= t
    return jnp.asarray(segment), jnp.asarray(prefix)


def rel_err(a, b) -> float:
    return float(jnp.abs(a - b).max() / jnp.abs(b).max())


def kernel_errors(got, want) -> dict:
    """Relative errors of out, dq, dk, dv (`value_and_grads` results); gradients finite."""
    (out, grads), (out_ref, grads_ref) = got, want
    errs = {"out": rel_err(out, out_ref)}
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref, strict=True):
        assert bool(jnp.isfinite(g).all()), name
        errs[name] = rel_err(g, g_ref)
    return errs

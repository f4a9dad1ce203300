"""Which attention a traced program runs: the selection rule by the platform a program is
compiled for (`decode_attention_form`, `kernel_platform`, `flash_kernels`, `in_place_decode`),
and the CPU forms (`host_attention`, `host_decode_attention`) laid out for XLA:CPU.

`jaxrl.models.transformer` re-exports the public names; docs/models.md ("Attention") has the
table of forms by platform and `ModelConfig.attention_impl`.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp

from jaxrl.models import decode_kernel, decode_kernel_tpu
from jaxrl.models.config import ModelConfig

_DECODE_FORM = contextvars.ContextVar("decode_attention_form", default="auto")
DECODE_FORMS = ("auto", "host", "xla", "pallas_gpu", "pallas_tpu")


@contextlib.contextmanager
def decode_attention_form(form: str):
    """Which formulation attention traces to, for the programs traced inside the block:

    - "auto" (the default): the platform the program is compiled for decides (its mesh's
      devices, else the default backend; `decode_kernel.platform`): the CPU forms on a CPU,
      "pallas_gpu" on a GPU, "pallas_tpu" on a TPU. Plans compile GPU and TPU programs from a
      CPU process and get the target's form.
    - "host": the CPU forms, `host_attention` (training, prefill) and `host_decode_attention`
      (one query per row).
    - "xla": `jax.nn.dot_product_attention`.
    - "pallas_gpu": the Pallas Triton kernels (`flash_kernels`): `gpu_attention`'s fused
      self-attention over a `SegmentMask` (training) and `decode_kernel`'s decode steps, which
      write the cache in place (the engine then decodes over the whole cache, not a copied
      prefix); Pallas interpret mode off a GPU, which is how the tests check them on the CPU.
    - "pallas_tpu": the Pallas Mosaic kernels: `tpu_attention`'s fused self-attention over a
      `SegmentMask` (training, prefill) and `decode_kernel_tpu`'s decode steps, in place as on
      a GPU (the engine decodes over the whole cache). Interpret mode off a TPU.

    `ModelConfig.attention_impl` chooses within a platform ("xla", "cudnn", "pallas", None: the
    platform's own). The kernel forms apply with None or "pallas"; "xla" keeps the XLA forms
    (a prefix of the cache copied out per call) on GPUs and TPUs alike. Read when a program is
    traced: one traced before keeps its form (JAX caches traces per function)."""
    if form not in DECODE_FORMS:
        raise ValueError(f"decode attention form {form!r}; use one of {DECODE_FORMS}")
    token = _DECODE_FORM.set(form)
    try:
        yield
    finally:
        _DECODE_FORM.reset(token)


def host_form() -> bool:
    """Whether attention traces to the CPU forms (`decode_attention_form`)."""
    form = _DECODE_FORM.get()
    # "auto": the platform the program is compiled for (its mesh's devices), not the process's
    # default backend: plans compile TPU and GPU programs from a CPU process.
    return form == "host" or (form == "auto" and decode_kernel.platform() == "cpu")


def kernel_platform() -> str | None:
    """The platform whose Pallas kernels attention traced now may use (`decode_attention_form`):
    "gpu" for "pallas_gpu" or "auto" in a GPU program, "tpu" for "pallas_tpu" or "auto" in a TPU
    program (the installed mesh's devices, or with no mesh the default backend), else None."""
    form = _DECODE_FORM.get()
    if form == "auto":
        target = decode_kernel.platform()
        return target if target in ("gpu", "tpu") else None
    return {"pallas_gpu": "gpu", "pallas_tpu": "tpu"}.get(form)


def decode_in_place() -> bool:
    """Whether decode steps traced now use an in-place kernel form: "pallas_gpu" or
    "pallas_tpu", or "auto" in a GPU or TPU program (`kernel_platform`)."""
    return kernel_platform() is not None


def fresh_cache(cache, cache_index, length: int) -> bool:
    """No cache, or one of exactly `length` positions written from position 0 (a prefill into a
    fresh cache): whole-sequence self-attention either way."""
    if cache is None:
        return True
    first = jax.tree.leaves(cache)[0]  # [L,] B, C, K, D
    return isinstance(cache_index, int) and cache_index == 0 and first.shape[-3] == length


def flash_kernels(config: ModelConfig) -> bool:
    """Whether whole-sequence self-attention traced now (training, the engine's prefill) runs a
    fused kernel over the per-token mask: `gpu_attention` (Triton) in a GPU program or the
    "pallas_gpu" form, `tpu_attention` (Mosaic) in a TPU program or the "pallas_tpu" form
    (interpret mode off the target), with `attention_impl` None (the platform's own) or
    "pallas"."""
    return kernel_platform() is not None and config.attention_impl in (None, "pallas")


def in_place_decode(config: ModelConfig, length: int) -> bool:
    """Whether decode steps traced now against a cache of `length` positions run an in-place
    kernel (`decode_kernel` on a GPU, `decode_kernel_tpu` on a TPU: `kernel_platform`), with
    `attention_impl` None or "pallas" and a cache the kernel tiles (`decode_kernel.blocks_for`
    and a power-of-2 head dim on a GPU, `decode_kernel_tpu.supports` on a TPU). Elsewhere (a
    rule, not an error) the XLA form runs and the engine decodes over a copied prefix."""
    target = kernel_platform()
    if target is None or config.attention_impl not in (None, "pallas"):
        return False
    d = config.head_dim
    if target == "tpu":
        return decode_kernel_tpu.supports(length, d)
    return decode_kernel.blocks_for(length) is not None and d & (d - 1) == 0


def in_place_decode_step(config: ModelConfig, cache, mask_bts: jax.Array) -> bool:
    """Whether a step against `cache` (one layer's, or stacked) runs an in-place kernel: one
    query per row, a mask over the whole cache and `in_place_decode` for its length."""
    if cache is None or mask_bts.shape[1] != 1:
        return False
    rows, length = cache[0].shape[-4:-2]
    return (
        mask_bts.shape[-1] == length
        and rows >= mask_bts.shape[0]
        and in_place_decode(config, length)
    )


def decode_step_attention(q_b1hd, k_bskd, v_bskd, mask_b1s, implementation) -> jax.Array:
    """One query token per row against the cache (`mask_b1s`: the keys each row may see)."""
    if host_form():
        return host_decode_attention(q_b1hd, k_bskd, v_bskd, mask_b1s)
    return jax.nn.dot_product_attention(
        q_b1hd, k_bskd, v_bskd, mask=mask_b1s[:, None, :, :], implementation=implementation
    )


def host_decode_attention(q_b1hd, k_bskd, v_bskd, mask_b1s) -> jax.Array:
    """Decode attention (grouped-query, G = H / K query heads per KV head) in the form XLA:CPU
    runs fastest, fp32 throughout; the maths of `jax.nn.dot_product_attention`:

        logits[b, s, k, g] = sum_d q[b, k, g, d] key[b, s, k, d] / sqrt(D)   (masked: fp32 min)
        out[b, k, g, :]    = sum_s softmax_s(logits)[b, s, k, g] value[b, s, k, :]

    The logits are one `[S, K*D] x [K*D, K*G]` matmul per row against a block-diagonal query
    (zero off its K diagonal blocks: K-fold redundant multiply-adds, cheap while K*D is small),
    and the output a multiply fused into its reduction over S. XLA:CPU runs the natural batched
    matrix-vector products (one per row and KV head) slower (figures: docs/benchmarks.md,
    "Measurements behind design choices"). Accelerators keep `jax.nn.dot_product_attention`.
    """
    f32 = jnp.float32
    b, _, h, d = q_b1hd.shape
    s, kv = k_bskd.shape[1], k_bskd.shape[2]
    g = h // kv
    q_bkgd = q_b1hd.reshape(b, kv, g, d).astype(f32) * (d**-0.5)
    q_bxy = jnp.einsum("bkgd,kj->bkdjg", q_bkgd, jnp.eye(kv, dtype=f32)).reshape(b, kv * d, kv * g)
    logits_bsy = jnp.einsum("bsx,bxy->bsy", k_bskd.reshape(b, s, kv * d).astype(f32), q_bxy)
    visible_bs11 = mask_b1s[:, 0, :, None, None]
    logits_bskg = jnp.where(visible_bs11, logits_bsy.reshape(b, s, kv, g), jnp.finfo(f32).min)
    weights_bskg = jax.nn.softmax(logits_bskg, axis=1)
    out_bkgd = (weights_bskg[..., None] * v_bskd[:, :, :, None, :].astype(f32)).sum(1)
    return out_bkgd.reshape(b, 1, h, d).astype(q_b1hd.dtype)


def host_attention(q_bthd, k_bskd, v_bskd, mask_bts) -> jax.Array:
    """Attention of T queries per row over S keys (training, prefill; grouped-query, G = H / K)
    in the layout XLA:CPU runs without strided copies, fp32 throughout; the maths of
    `jax.nn.dot_product_attention`:

        logits[b, k, g, t, s] = sum_d q[b, t, k, g, d] key[b, s, k, d] / sqrt(D)  (masked: fp32 min)
        out[b, t, k, g, :]    = sum_s softmax_s(logits)[b, k, g, t, s] value[b, s, k, :]

    The G query heads of a KV head are stacked along the query axis (`[B, K, G*T, D]`), so both
    products are plain batched matmuls (batch `B, K`) and the softmax runs over the minor axis.
    `jax.nn.dot_product_attention` maps over G and lays its logits out `[G, B, K, T, S]`; on the
    CPU its forward and backward passes spent more time in layout copies of those logits than in
    the attention's matmuls (figures: docs/benchmarks.md, "Measurements behind design choices").
    """
    f32 = jnp.float32
    b, t, h, d = q_bthd.shape
    s, kv = k_bskd.shape[1], k_bskd.shape[2]
    g = h // kv
    q_bkxd = (q_bthd.astype(f32) * (d**-0.5)).reshape(b, t, kv, g, d)
    q_bkxd = q_bkxd.transpose(0, 2, 3, 1, 4).reshape(b, kv, g * t, d)
    k_bksd = k_bskd.astype(f32).transpose(0, 2, 1, 3)
    v_bksd = v_bskd.astype(f32).transpose(0, 2, 1, 3)
    logits_bkgts = jnp.einsum("bkxd,bksd->bkxs", q_bkxd, k_bksd).reshape(b, kv, g, t, s)
    logits_bkgts = jnp.where(mask_bts[:, None, None], logits_bkgts, jnp.finfo(f32).min)
    weights_bkxs = jax.nn.softmax(logits_bkgts, axis=-1).reshape(b, kv, g * t, s)
    out_bkxd = jnp.einsum("bkxs,bksd->bkxd", weights_bkxs, v_bksd)
    out_bthd = out_bkxd.reshape(b, kv, g, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, h, d)
    return out_bthd.astype(q_bthd.dtype)

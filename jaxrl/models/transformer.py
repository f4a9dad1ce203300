"""Decoder-only LM (Llama 3 / Qwen2 / Qwen3) in Flax NNX.

Sharding: every parameter is an `nnx.Param` whose `out_sharding` metadata holds *logical* axis
names (`jaxrl.infra.sharding`), created with `eager_sharding=False`. The model itself never
touches a mesh: a per-role rules table maps the logical names onto mesh axes
(`nnx.get_partition_spec` under `flax.core.spmd.logical_axis_rules`), and params are born
sharded by a jitted init with `out_shardings`. We prefer this to flax 0.12's eager sharding
(which needs mesh axis names in the model and a mesh at construction) because the same model
code must be laid out differently on the trainer mesh (FSDP x TP) and the generator mesh
(TP x replicas), and abstract shapes must be computable without devices.

Shapes: B batch, T query length, S key length, E hidden, H query heads, K kv heads, D head dim,
F mlp width, V vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxrl.infra import sharding as ax
from jaxrl.infra.sharding import logical_param as _param
from jaxrl.models import decode_kernel, decode_kernel_tpu, remat, tpu_attention
from jaxrl.models.attention_forms import (  # noqa: F401  (public here: decode_attention_form, ...)
    DECODE_FORMS,
    decode_attention_form,
    decode_in_place,
    decode_step_attention,
    flash_kernels,
    fresh_cache,
    host_attention,
    host_decode_attention,
    host_form,
    in_place_decode,
    in_place_decode_step,
    kernel_platform,
)
from jaxrl.models.config import ModelConfig
from jaxrl.models.gpu_attention import flash_self_attention
from jaxrl.models.masks import SegmentMask, causal_mask  # noqa: F401  (causal_mask: public here)
from jaxrl.models.moe import ROUTING_DTYPE, MoEMLP, RouterStats, RoutingInfo, load_balancing_loss
from jaxrl.models.pallas_attention import splash_self_attention
from jaxrl.models.rope import apply_rope, inverse_frequencies, rope_cos_sin

# One layer's cache: (keys_bskd, values_bskd), S = the preallocated cache length. The model's
# cache is a tuple of those per layer, or, with `scan_layers`, one pair stacked on a leading
# layer axis: (keys_lbskd, values_lbskd).
LayerCache = tuple[jax.Array, jax.Array]
KVCache = tuple[LayerCache, ...] | LayerCache
_PROJ_NAMES = {"q": remat.QUERY_PROJ, "k": remat.KEY_PROJ, "v": remat.VALUE_PROJ}


class RMSNorm(nnx.Module):
    """`weight * x / sqrt(mean(x^2) + eps)`, the statistics in float32."""

    def __init__(self, dim: int, eps: float, config: ModelConfig, rngs: nnx.Rngs, axis: str):
        self.eps = eps
        self.dtype = config.jnp_dtype
        self.weight = _param(rngs, (dim,), (axis,), config.jnp_param_dtype, None)

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...].astype(self.dtype) * normed.astype(self.dtype)


class Attention(nnx.Module):
    """Grouped-query attention with RoPE, optional q/k/v/o biases and q/k RMSNorm (Qwen3)."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs, std: float):
        c = config
        e, h, k, d, pd = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.jnp_param_dtype
        self.config = c
        self.q_kernel = _param(rngs, (e, h, d), (ax.EMBED, ax.Q_HEADS, ax.HEAD_DIM), pd, std)
        self.k_kernel = _param(rngs, (e, k, d), (ax.EMBED, ax.KV_HEADS, ax.HEAD_DIM), pd, std)
        self.v_kernel = _param(rngs, (e, k, d), (ax.EMBED, ax.KV_HEADS, ax.HEAD_DIM), pd, std)
        self.o_kernel = _param(rngs, (h, d, e), (ax.Q_HEADS, ax.HEAD_DIM, ax.EMBED), pd, std)
        if c.qkv_bias:
            self.q_bias = _param(rngs, (h, d), (ax.Q_HEADS, ax.HEAD_DIM), pd, 0.0)
            self.k_bias = _param(rngs, (k, d), (ax.KV_HEADS, ax.HEAD_DIM), pd, 0.0)
            self.v_bias = _param(rngs, (k, d), (ax.KV_HEADS, ax.HEAD_DIM), pd, 0.0)
        if c.o_bias:
            self.o_bias = _param(rngs, (e,), (ax.EMBED,), pd, 0.0)
        if c.qk_norm:
            self.q_norm = RMSNorm(d, c.rms_norm_eps, c, rngs, ax.HEAD_DIM)
            self.k_norm = RMSNorm(d, c.rms_norm_eps, c, rngs, ax.HEAD_DIM)

    def _project(self, x_bte, name: str, heads_axis: str) -> jax.Array:
        dtype = self.config.jnp_dtype
        kernel_ehd = getattr(self, f"{name}_kernel")[...].astype(dtype)
        y = _matmul(x_bte, kernel_ehd)
        if self.config.qkv_bias:
            y = y + getattr(self, f"{name}_bias")[...].astype(dtype)
        y = ax.constrain(y, (ax.ACT_BATCH, ax.ACT_LENGTH, heads_axis, ax.ACT_HEAD_DIM))
        return checkpoint_name(y, _PROJ_NAMES[name])

    def __call__(
        self,
        x_bte: jax.Array,
        cos_btd: jax.Array,
        sin_btd: jax.Array,
        mask_bts: jax.Array,
        cache: LayerCache | None = None,
        cache_index: jax.Array | None = None,
    ) -> tuple[jax.Array, LayerCache | None]:
        """Attends `x` to itself, or to the cache after writing `x`'s keys at `cache_index`.

        `mask_bts[b, t, s]` is True where query t may attend key s (causal and not padding).
        `cache_index` is one position for every row (a scalar) or one per row (`[B]`, the
        generation engine's slots, each at its own length).
        """
        c = self.config
        q = self._project(x_bte, "q", ax.ACT_HEADS)
        k = self._project(x_bte, "k", ax.ACT_KV_HEADS)
        v = self._project(x_bte, "v", ax.ACT_KV_HEADS)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, cos_btd, sin_btd)
        k = apply_rope(k, cos_btd, sin_btd)
        if isinstance(mask_bts, SegmentMask):
            # Whole-sequence self-attention through the fused GPU or TPU kernel: `hidden_states`
            # keeps the per-token mask only for them (`flash_kernels`); no [B, H, T, T] scores.
            # With a cache (the engine's prefill: a fresh cache as long as the prompts, written
            # from 0) the keys and values are the cache's, as a decode step reads them.
            if cache is not None:
                k = _write_cache(cache[0], k, cache_index)
                v = _write_cache(cache[1], v, cache_index)
                cache = (k, v)
            flash = (
                tpu_attention.flash_self_attention
                if kernel_platform() == "tpu"
                else flash_self_attention
            )
            out = flash(q, k.astype(q.dtype), v.astype(q.dtype), mask_bts)
            return self._output(out), cache
        if cache is not None and q.shape[1] == 1 and in_place_decode_step(c, cache, mask_bts):
            # Decode on a GPU or TPU: the new keys / values land in the cache by one scatter and
            # the kernel reads each row's keys where they lie (`decode_kernel`, Triton;
            # `decode_kernel_tpu`, Mosaic). A 3-tuple cache is the whole stacked cache and this
            # layer's index (scanned layers).
            layer = cache[2] if len(cache) == 3 else None
            keys = decode_kernel.write_rows(cache[0], k, cache_index, layer)
            values = decode_kernel.write_rows(cache[1], v, cache_index, layer)
            kernel = decode_kernel if kernel_platform() == "gpu" else decode_kernel_tpu
            out = kernel.decode_attention(q, keys, values, mask_bts[:, 0, :], layer=layer)
            return self._output(out), (keys, values, *cache[2:])
        if cache is not None:
            k = _write_cache(cache[0], k, cache_index)
            v = _write_cache(cache[1], v, cache_index)
            cache = (k, v)
        if (
            c.attention_impl == "pallas"
            and kernel_platform() != "gpu"
            and q.shape[1] == k.shape[1]
            and q.shape[1] > 1
        ):
            # Whole-sequence self-attention on TPU (training, the engine's prefill). The mask is
            # `causal & valid key` (`causal_mask`, `sequence_mask`): the last query row holds
            # every key's validity.
            out = splash_self_attention(q, k.astype(q.dtype), v.astype(q.dtype), mask_bts[:, -1, :])
        elif q.shape[1] == 1 and cache is not None and c.attention_impl != "cudnn":
            # Decode: one query per row (the form follows the backend: `decode_step_attention`).
            impl = None if c.attention_impl is None else "xla"
            out = decode_step_attention(q, k.astype(q.dtype), v.astype(q.dtype), mask_bts, impl)
        elif c.attention_impl != "cudnn" and host_form():
            # Whole-sequence self-attention or cached prefill on the CPU.
            out = host_attention(q, k.astype(q.dtype), v.astype(q.dtype), mask_bts)
        else:  # accelerators: the XLA or cuDNN kernel (pallas: its cached prefill)
            impl = "xla" if c.attention_impl == "pallas" else c.attention_impl
            out = jax.nn.dot_product_attention(
                q,
                k.astype(q.dtype),
                v.astype(q.dtype),
                mask=mask_bts[:, None, :, :],
                implementation=impl,
            )
        return self._output(out), cache

    def _output(self, out_bthd: jax.Array) -> jax.Array:
        c = self.config
        out = ax.constrain(out_bthd, (ax.ACT_BATCH, ax.ACT_LENGTH, ax.ACT_HEADS, ax.ACT_HEAD_DIM))
        out = checkpoint_name(out, remat.ATTN_OUT)
        y = _matmul(out, self.o_kernel[...].astype(c.jnp_dtype), contract=2)
        if c.o_bias:
            y = y + self.o_bias[...].astype(c.jnp_dtype)
        return y


class MLP(nnx.Module):
    """SwiGLU: `down(silu(gate(x)) * up(x))`."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs, std: float):
        e, f, pd = config.hidden_size, config.intermediate_size, config.jnp_param_dtype
        self.config = config
        self.gate_kernel = _param(rngs, (e, f), (ax.EMBED, ax.MLP), pd, std)
        self.up_kernel = _param(rngs, (e, f), (ax.EMBED, ax.MLP), pd, std)
        self.down_kernel = _param(rngs, (f, e), (ax.MLP, ax.EMBED), pd, std)
        if config.mlp_bias:
            self.gate_bias = _param(rngs, (f,), (ax.MLP,), pd, 0.0)
            self.up_bias = _param(rngs, (f,), (ax.MLP,), pd, 0.0)
            self.down_bias = _param(rngs, (e,), (ax.EMBED,), pd, 0.0)

    def _dense(self, x, name):
        dtype = self.config.jnp_dtype
        y = _matmul(x, getattr(self, f"{name}_kernel")[...].astype(dtype))
        if self.config.mlp_bias:
            y = y + getattr(self, f"{name}_bias")[...].astype(dtype)
        return y

    def __call__(self, x_bte: jax.Array) -> jax.Array:
        hidden_btf = jax.nn.silu(self._dense(x_bte, "gate")) * self._dense(x_bte, "up")
        hidden_btf = ax.constrain(hidden_btf, (ax.ACT_BATCH, ax.ACT_LENGTH, ax.ACT_MLP))
        return self._dense(hidden_btf, "down")


class DecoderLayer(nnx.Module):
    """Pre-norm attention and MLP blocks; `moe`: the MLP is a routed mixture of experts."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs, std: float, moe: bool = False):
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config, rngs, ax.NORM)
        self.attention = Attention(config, rngs, std)
        self.post_attention_norm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, config, rngs, ax.NORM
        )
        self.mlp = MoEMLP(config, rngs, std) if moe else MLP(config, rngs, std)

    def __call__(
        self,
        x_bte,
        cos_btd,
        sin_btd,
        mask_bts,
        cache=None,
        cache_index=None,
        router_stats=False,
        replay_btk=None,
        record=False,
    ):
        """`(out, cache)`; with `router_stats`, `record` or `replay_btk` (a sparse MLP's routing,
        `MoEMLP.__call__`) `(out, cache, RoutingInfo)` (empty for a dense layer)."""
        attn_out, cache = self.attention(
            self.input_norm(x_bte), cos_btd, sin_btd, mask_bts, cache, cache_index
        )
        h = x_bte + attn_out
        if not (router_stats or record or replay_btk is not None):
            out = h + self.mlp(self.post_attention_norm(h))
            return ax.constrain(out, (ax.ACT_BATCH, ax.ACT_LENGTH, ax.ACT_EMBED)), cache
        info = RoutingInfo(None, None)
        if isinstance(self.mlp, MoEMLP):
            mlp_out = self.mlp(self.post_attention_norm(h), router_stats, replay_btk, record)
            if router_stats or record:
                mlp_out, info = mlp_out
        else:
            mlp_out = self.mlp(self.post_attention_norm(h))
        out = ax.constrain(h + mlp_out, (ax.ACT_BATCH, ax.ACT_LENGTH, ax.ACT_EMBED))
        return out, cache, info


class Transformer(nnx.Module):
    """The policy LM.

    `model(tokens_bt, valid_bt)` returns float32 logits `[B, T, V]` for a (left- or right-)
    padded batch. The pieces (`embed`, `hidden_states`, `logits`, `unembedding`) are public so
    the sampler can run a KV cache and the losses can compute log-probs in vocabulary chunks.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, init_std: float = 0.02):
        c = config
        self.config = c
        self.embedding = _param(
            rngs, (c.vocab_size, c.hidden_size), (ax.VOCAB, ax.EMBED), c.jnp_param_dtype, init_std
        )
        if c.scan_layers:
            self.layers = _stacked_layers(c, rngs, init_std)
        else:
            self.layers = nnx.List(
                [
                    DecoderLayer(c, rngs, init_std, moe=c.is_moe_layer(i))
                    for i in range(c.num_layers)
                ]
            )
        self.final_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, c, rngs, ax.NORM)
        if not c.tie_word_embeddings:
            self.lm_head = _param(
                rngs,
                (c.hidden_size, c.vocab_size),
                (ax.EMBED, ax.VOCAB),
                c.jnp_param_dtype,
                init_std,
            )

    def embed(self, tokens_bt: jax.Array) -> jax.Array:
        x = jnp.take(self.embedding[...], tokens_bt, axis=0).astype(self.config.jnp_dtype)
        return ax.constrain(x, (ax.ACT_BATCH, ax.ACT_LENGTH, ax.ACT_EMBED))

    def hidden_states(
        self,
        tokens_bt: jax.Array,
        positions_bt: jax.Array,
        mask_bts: jax.Array,
        cache: KVCache | None = None,
        cache_index: jax.Array | None = None,
        router_stats: bool = False,
        routing: jax.Array | None = None,
        record_routing: bool = False,
    ) -> tuple[jax.Array, KVCache | None]:
        """Final-norm hidden states `[B, T, E]` and the updated cache (None without a cache).

        `mask_bts`: a dense `[B, T, S]` boolean mask, or a `SegmentMask` (self-attention without
        a cache: training, `__call__`), which stays per-token for the fused GPU kernel
        (`flash_kernels`) and is made dense for every other attention form.

        Mixture-of-experts models (`jaxrl.models.moe`): with `router_stats`, `routing` or
        `record_routing`, returns `(hidden, cache, RoutingInfo)`: `router_stats` (no cache) the
        routing statistics `load_balancing_loss` reduces to the auxiliary loss (a dense model's
        count 0 layers); `record_routing` each layer's own top-k experts `[B, T, L, k]` (-1 on
        dense layers: the generation engine's routing record); `routing` `[B, T, L, k]` experts
        to use instead of the routers' choice where given (>= 0: routing replay)."""
        target = decode_kernel.platform()
        if self.config.attention_impl == "cudnn" and target != "gpu":
            raise ValueError(
                f"attention_impl='cudnn' needs an NVIDIA GPU (cuDNN), and this program is "
                f"compiled for {target}: use None (the platform's own attention) or 'xla'"
            )
        if isinstance(mask_bts, SegmentMask) and not (
            flash_kernels(self.config) and fresh_cache(cache, cache_index, tokens_bt.shape[1])
        ):
            mask_bts = mask_bts.dense()
        x = self.embed(tokens_bt)
        inv_freq = inverse_frequencies(self.config.head_dim, self.config.rope)
        cos, sin = rope_cos_sin(positions_bt, inv_freq, self.config.jnp_dtype)
        policy = remat.remat_policy(self.config.remat_policy)
        remat_layer = lambda f: nnx.remat(  # noqa: E731
            f, policy=policy, prevent_cse=not self.config.scan_layers
        )
        if router_stats or record_routing or routing is not None:
            if router_stats and cache is not None:
                raise ValueError("router_stats=True is for whole-sequence forwards (no KV cache)")

            def run_routed(x, layer, layer_cache, replay_btk):
                return layer(
                    x, cos, sin, mask_bts, layer_cache, cache_index, router_stats, replay_btk,
                    record_routing,
                )  # fmt: skip

            if self.config.remat_policy != "none":
                run_routed = remat_layer(run_routed)
            hidden, cache, info = _routed_layers(
                self, run_routed, x, cache, mask_bts, router_stats, routing, record_routing
            )
            return self.final_norm(hidden), cache, info

        def run_layer(x, layer, layer_cache):
            return layer(x, cos, sin, mask_bts, layer_cache, cache_index)

        if self.config.remat_policy != "none":
            run_layer = remat_layer(run_layer)
        if self.config.scan_layers and in_place_decode_step(self.config, cache, mask_bts):
            # The stacked cache rides in the scan's carry with the layer index, so each layer
            # writes and reads it in place (as scan inputs and outputs, every step would slice
            # each layer's cache out and write it into a new stacked output).
            def run_stacked(carry, layer):
                x, keys, values, i = carry
                x, (keys, values, _) = run_layer(x, layer, (keys, values, i))
                return x, keys, values, i + 1

            scan = nnx.scan(
                run_stacked,
                in_axes=(nnx.Carry, 0),
                out_axes=nnx.Carry,
                transform_metadata={nnx.PARTITION_NAME: ax.LAYERS},
            )
            x, keys, values, _ = scan((x, *cache, jnp.zeros((), jnp.int32)), self.layers)
            return self.final_norm(x), (keys, values)
        if self.config.scan_layers:
            scan = nnx.scan(
                run_layer,
                in_axes=(nnx.Carry, 0, None if cache is None else 0),
                out_axes=(nnx.Carry, 0),
                transform_metadata={nnx.PARTITION_NAME: ax.LAYERS},
            )
            x, new_cache = scan(x, self.layers, cache)
            return self.final_norm(x), new_cache
        new_cache = []
        for i, layer in enumerate(self.layers):
            x, layer_cache = run_layer(x, layer, None if cache is None else cache[i])
            new_cache.append(layer_cache)
        return self.final_norm(x), (None if cache is None else tuple(new_cache))

    def logits_and_aux_loss(
        self, tokens_bt: jax.Array, valid_bt: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array]:
        """`__call__`'s logits and the load-balancing loss over the valid tokens
        (`jaxrl.models.moe.load_balancing_loss`; 0 for a dense model). A trainer adds
        `config.router_aux_loss_coef` (or its own weight) times the loss."""
        if valid_bt is None:
            valid_bt = jnp.ones(tokens_bt.shape, bool)
        hidden, _, info = self.hidden_states(
            tokens_bt,
            positions_from_mask(valid_bt),
            SegmentMask.from_valid(valid_bt),
            router_stats=True,
        )
        return self.logits(hidden), load_balancing_loss(info.stats, valid_bt)

    def unembedding(self) -> jax.Array:
        """The output projection `[E, V]` in the compute dtype (the embedding when tied)."""
        w = self.embedding[...].T if self.config.tie_word_embeddings else self.lm_head[...]
        return w.astype(self.config.jnp_dtype)

    def logits(self, hidden_bte: jax.Array) -> jax.Array:
        """float32 logits `[B, T, V]` (accumulated in float32 even in bf16 compute)."""
        logits = _matmul(hidden_bte, self.unembedding(), preferred_element_type=jnp.float32)
        return ax.constrain(logits, (ax.ACT_BATCH, ax.ACT_LENGTH, ax.ACT_VOCAB))

    def __call__(self, tokens_bt: jax.Array, valid_bt: jax.Array | None = None) -> jax.Array:
        if valid_bt is None:
            valid_bt = jnp.ones(tokens_bt.shape, bool)
        hidden, _ = self.hidden_states(
            tokens_bt, positions_from_mask(valid_bt), SegmentMask.from_valid(valid_bt)
        )
        return self.logits(hidden)


def _routed_layers(model, run_layer, x, cache, mask_bts, with_stats, replay_btlk, record):
    """`hidden_states`' layers when routing is asked for (`router_stats`, replay or record):
    `(x, cache, RoutingInfo)`, the sparse layers' statistics summed over layers in the carry,
    their own top-k stacked on axis 2, the replayed experts fed to layer l from
    `replay_btlk[:, :, l]`."""
    c = model.config
    b, t = x.shape[:2]
    zeros = jnp.zeros((b, t, max(c.num_experts, 1)), jnp.float32) if with_stats else None
    none_btk = jnp.full((b, t, max(c.num_experts_per_tok, 1)), -1, ROUTING_DTYPE)

    def step(carry, layer, layer_cache, replay_btk):
        x, counts, probs = carry
        x, layer_cache, info = run_layer(x, layer, layer_cache, replay_btk)
        if with_stats and info.stats is not None:
            counts, probs = counts + info.stats.counts_bte, probs + info.stats.probs_bte
        chosen = (none_btk if info.experts is None else info.experts) if record else None
        return (x, counts, probs), (layer_cache, chosen)

    if c.scan_layers and in_place_decode_step(c, cache, mask_bts):
        if with_stats or replay_btlk is not None:
            raise ValueError("an in-place decode step records routing only (no stats, no replay)")

        def run_stacked(carry, layer):
            x, keys, values, i = carry
            (x, _, _), ((keys, values, _), chosen) = step(
                (x, None, None), layer, (keys, values, i), None
            )
            return (x, keys, values, i + 1), chosen

        scan = nnx.scan(
            run_stacked,
            in_axes=(nnx.Carry, 0),
            out_axes=(nnx.Carry, 0),
            transform_metadata={nnx.PARTITION_NAME: ax.LAYERS},
        )
        (x, keys, values, _), chosen_l = scan((x, *cache, jnp.zeros((), jnp.int32)), model.layers)
        cache, counts, probs = (keys, values), None, None
    elif c.scan_layers:
        replay_l = None if replay_btlk is None else jnp.moveaxis(replay_btlk, 2, 0)
        scan = nnx.scan(
            step,
            in_axes=(nnx.Carry, 0, None if cache is None else 0, None if replay_l is None else 0),
            out_axes=(nnx.Carry, 0),
            transform_metadata={nnx.PARTITION_NAME: ax.LAYERS},
        )
        carry = (x, zeros, zeros)
        (x, counts, probs), (cache, chosen_l) = scan(carry, model.layers, cache, replay_l)
    else:
        carry, new_cache, chosen = (x, zeros, zeros), [], []
        for i, layer in enumerate(model.layers):
            replay_btk = None if replay_btlk is None else replay_btlk[:, :, i]
            layer_cache = None if cache is None else cache[i]
            carry, (layer_cache, layer_chosen) = step(carry, layer, layer_cache, replay_btk)
            new_cache.append(layer_cache)
            chosen.append(layer_chosen)
        (x, counts, probs), cache = carry, None if cache is None else tuple(new_cache)
        chosen_l = jnp.stack(chosen) if record else None
    stats = RouterStats(counts, probs, len(c.moe_layers)) if with_stats else None
    experts = jnp.moveaxis(chosen_l, 0, 2) if record else None
    return x, cache, RoutingInfo(stats, experts)


def _matmul(x_btk: jax.Array, w_k: jax.Array, contract: int = 1, **kwargs) -> jax.Array:
    """`[B, T, *K] @ [*K, *N] -> [B, T, *N]` (`K`: the leading `contract` axes of `w_k`)
    computed as one matmul over B*T rows.

    Same math as an einsum, but the backward pass then needs only 2-D transposes: XLA:CPU emits
    the 3-D transposes a `bte,ef` contraction's weight gradient asks for (fused with the
    activation's derivative) as slow strided loops, which made the backward pass ~10x the
    forward pass on CPU.

    Written as `jax.lax.dot_general` on the kernel as stored (q/k/v kernels `[E, H, D]` are not
    reshaped) because that is the call qwix intercepts to attach LoRA adapters
    (`jaxrl.train.lora`): inside `jnp.matmul` (itself jitted) or after a reshape, qwix cannot tell
    which parameter the right operand is, and the projection silently gets no adapter.
    """
    if hasattr(w_k, "quantized_matmul"):  # the engine's int8 weights (generation.quantize)
        return w_k.quantized_matmul(x_btk, contract, **kwargs)
    b, t = x_btk.shape[:2]
    dims = ((tuple(range(1, contract + 1)), tuple(range(contract))), ((), ()))
    y = jax.lax.dot_general(x_btk.reshape(b * t, *x_btk.shape[2:]), w_k, dims, **kwargs)
    return y.reshape(b, t, *w_k.shape[contract:])


def _write_cache(cache_bskd: jax.Array, x_btkd: jax.Array, index: jax.Array) -> jax.Array:
    """Writes `x` into the cache at sequence position `index` (a scalar, or `[B]` per row)."""
    x_btkd = x_btkd.astype(cache_bskd.dtype)
    if jnp.ndim(index) == 0:
        return jax.lax.dynamic_update_slice(cache_bskd, x_btkd, (0, index, 0, 0))
    return jax.vmap(lambda c, x, i: jax.lax.dynamic_update_slice(c, x, (i, 0, 0)))(
        cache_bskd, x_btkd, index
    )


def positions_from_mask(valid_bt: jax.Array) -> jax.Array:
    """Token positions that skip padding: 0 at each row's first real token (left padding)."""
    return jnp.maximum(jnp.cumsum(valid_bt.astype(jnp.int32), axis=-1) - 1, 0)


def _stacked_layers(config: ModelConfig, rngs: nnx.Rngs, init_std: float) -> DecoderLayer:
    """`num_layers` decoder layers as one module whose params carry a leading `layers` axis."""

    @nnx.split_rngs(splits=config.num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: ax.LAYERS})
    def make(rngs):
        return DecoderLayer(config, rngs, init_std, moe=bool(config.moe_layers))

    return make(rngs)


def init_cache(config: ModelConfig, batch: int, max_len: int, dtype=None) -> KVCache:
    """A zeroed KV cache: `[B, max_len, K, D]` keys and values per layer, or (`scan_layers`)
    one pair `[L, B, max_len, K, D]`."""
    shape = (batch, max_len, config.num_kv_heads, config.head_dim)
    dtype = dtype or config.jnp_dtype
    if config.scan_layers:
        stacked = (config.num_layers, *shape)
        return (jnp.zeros(stacked, dtype), jnp.zeros(stacked, dtype))
    return tuple(
        (jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(config.num_layers)
    )


def constrain_cache(cache: KVCache) -> KVCache:
    """The cache's logical sharding: batch, length, kv heads, head dim (layer axis replicated)."""
    axes = (ax.ACT_BATCH, ax.ACT_LENGTH, ax.ACT_KV_HEADS, ax.ACT_HEAD_DIM)
    return jax.tree.map(lambda c: ax.constrain(c, (ax.LAYERS,) * (c.ndim - 4) + axes), cache)

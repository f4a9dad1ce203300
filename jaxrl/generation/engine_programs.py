"""The continuous-batching engine's device side (`jaxrl.generation.engine`): its three jitted
programs over one KV cache `[S, C, K, D]` per layer, their ahead-of-time lowering and
compilation, and the cache's placement on the mesh.

* **prefill** runs right-padded prompts `[P, T]` through the model into a fresh cache and copies
  each prompt's keys / values into its G slots (MaxText's `prefill_multisampling` +
  `bulk_insert`). It computes no logits: each slot then feeds the prompt's last token as its
  first decode step.
* **decode** runs `steps_per_call` steps of the first `active` slots in a `fori_loop`, attending
  only over the cache prefix `[:span]` (sliced out at the start of the call, decoded into,
  written back at its end), so attention and the cache copy follow the longest live row, not the
  capacity. On a GPU or TPU (`transformer.in_place_decode`) nothing is sliced out: each step
  scatters its keys / values into the donated cache and the decode kernel (`decode_kernel`,
  `decode_kernel_tpu`) reads every row's own length there.
  Sample g of request r draws token t from one uniform keyed by
  `fold_in(fold_in(fold_in(seed, r), g), t)` by inverse CDF (`inverse_cdf_tokens`), never from
  the slot index or the step count; its log-prob is `processed_logprobs` of the logits it was
  drawn from.
* **move** copies the written prefix of live rows down to lower slots when the engine packs a
  draining batch into a smaller active-slot bucket.

Weights per layer (`layer_layout`). With scanned layers (`ModelConfig.scan_layers`) a decode
step runs the layer loop over the stacked weights `[L, ...]`, and XLA:GPU copies each layer's
weights out of the stack at every step (a `dynamic-slice` it cannot fuse into the GEMMs that
read them): the weights move three times a step where a step reads them once (Llama 3 8B on
TP 4: 14.2 GB a step against 7.2 GB, `launch.plan`'s decode line). On a GPU the programs
therefore run the same model with its layers unrolled ("auto", where the weights take at most
`UNROLL_SHARE` of a device's memory; "unrolled" anywhere), on the engine's own per-layer copy
made on the devices once per weights object (`engine_params`), held beside the caller's stacked
weights. "stacked" keeps the caller's layout. 8-bit weights (`quantize`): the same copy.

Copies into slots are in-place `dynamic_update_slice`s per row (`_copy_rows`). Each program is
compiled once per (bucket, static sampling config): one prefill per (prompt-batch, prompt-length)
bucket pair, one decode per (span, active-slot) bucket pair, one move per span bucket. `precompile`
compiles them up front; `run` runs a precompiled executable when there is one (`jax.jit`'s own cache
is not filled by an ahead-of-time compile), else the jitted function. Each trace counts in
`EngineStats.num_traces`.

Shapes: S slots, C cache capacity, L span (attended prefix), P prompt batch, T prompt length,
V vocabulary, N steps per call.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.core import spmd as flax_spmd

from jaxrl.generation import engine_routing, quantize
from jaxrl.generation.engine_layout import (  # noqa: F401  (LAYER_LAYOUTS, UNROLL_SHARE: here too)
    LAYER_LAYOUTS,
    UNROLL_SHARE,
    bucket,
    extend_row_buckets,
    note_xla_decode,
    pow2_buckets,
    pure_params,
    unrolls,
    unstacker,
)
from jaxrl.generation.engine_requests import EngineStats
from jaxrl.generation.sampling import SamplingConfig, inverse_cdf_tokens, processed_logprobs
from jaxrl.infra import sharding as ax
from jaxrl.models.config import ModelConfig
from jaxrl.models.masks import SegmentMask
from jaxrl.models.transformer import (
    Transformer,
    constrain_cache,
    in_place_decode,
    init_cache,
    positions_from_mask,
)


def _copy_rows(full, new, dest_s, src_s, axis: int):
    """`full` with slot `dest_s[i]` (along `axis`) overwritten, over its leading positions, by
    row `src_s[i]` of `new`, for the leading entries with `dest_s[i]` in range (the rest mark
    unused entries and are skipped).

    One in-place `dynamic_update_slice` per copied row, in a loop: the cost follows the rows and
    positions copied, not the cache. (A scatter, `full.at[dest_s].set(...)`, is a loop that
    copies the whole buffer per index on XLA:CPU: 6 s per call on a 64-slot, 8192-position
    cache.)
    """
    count = jnp.sum(dest_s < full.shape[axis])

    def body(i, full):
        row = jax.lax.dynamic_index_in_dim(new, src_s[i], axis, keepdims=True)
        start = [jnp.zeros((), jnp.int32)] * full.ndim
        start[axis] = dest_s[i]
        return jax.lax.dynamic_update_slice(full, row.astype(full.dtype), start)

    return jax.lax.fori_loop(0, count, body, full)


class EnginePrograms:
    """The jitted prefill, decode and move programs of an engine with `num_slots` slots (module
    docstring); `stats` is the engine's, whose `num_traces` each trace increments.

    `compiled`: executables `precompile` made, by (name, static args); the engine clears it when
    its cache grows.
    """

    def __init__(
        self,
        graphdef: nnx.GraphDef,
        model_config: ModelConfig,
        *,
        num_slots: int,
        steps_per_call: int,
        pad_id: int,
        mesh: jax.sharding.Mesh | None,
        rules: ax.LogicalRules | None,
        stats: EngineStats,
        layer_layout: str = "auto",
        weights: str = "native",
        early_exit: bool = False,
    ):
        self.mesh, self.rules, self.stats = mesh, rules, stats
        self.early_exit = early_exit  # decode ends once `exit_at` of its rows have stopped
        self.unstack = unrolls(graphdef, model_config, mesh, rules, layer_layout)
        self._converted: tuple[Any, Any] | None = None  # (weights passed in, the engine's copy)
        self._unstack_q = None  # `unstack` of a tree pushed already quantized
        if self.unstack:
            self.source_layers = model_config.num_layers
            self._unstack = unstacker(model_config, mesh, rules, self.source_layers)
            model_config = model_config.replace(scan_layers=False)
            graphdef = nnx.graphdef(
                nnx.eval_shape(lambda: Transformer(model_config, rngs=nnx.Rngs(0)))
            )
        self.graphdef, self.model_config = graphdef, model_config
        # 8-bit weights (`jaxrl.generation.quantize`): the engine's own copy, checked up front.
        self.weights, self._quantize = quantize.engine_format(
            graphdef, model_config, mesh, weights, rules
        )
        self.num_slots, self.steps_per_call, self.pad_id = num_slots, steps_per_call, pad_id
        # Mixture-of-experts models: the cache is (KV cache, routing record) (`engine_routing`).
        self.record = engine_routing.records(model_config)
        self.prefill = jax.jit(self._prefill_impl, donate_argnums=(1,))
        self.decode = jax.jit(
            self._decode_impl, static_argnames=("sampling", "span", "active"), donate_argnums=(1,)
        )
        self.move = jax.jit(self._move_impl, static_argnames=("span",), donate_argnums=(0,))
        self.extend = jax.jit(self._extend_impl, static_argnames=("span",), donate_argnums=(1,))
        self.jitted = {
            "prefill": self.prefill,
            "decode": self.decode,
            "move": self.move,
            "extend": self.extend,
        }
        self.compiled: dict[tuple, Any] = {}

    @staticmethod
    def _program_key(name: str, args, static: dict) -> tuple:
        if name in ("prefill", "extend"):
            shapes = tuple(np.shape(a) for a in args[2:4])
        else:  # a decode with continuations: their shape
            shapes = tuple(np.shape(a) for a in jax.tree.leaves(args[5:6]))
        return (name, shapes, tuple(sorted(static.items())))

    def engine_params(self, params, abstract: bool = False):
        """The weights the programs take: `params` itself, or with per-layer weights
        (`unstack`, module docstring) the engine's copy of them, made once per weights object
        (`abstract`: ShapeDtypeStructs of it, for lowering; nothing runs)."""
        if not self.unstack and self._quantize is None:
            return params
        if abstract:  # each jit's own eval_shape: their out_shardings carry to the result
            for step in self._steps(params):
                if step is not None:
                    params = self.call_on_mesh(jax.eval_shape, step, pure_params(params))
            return params
        if self._converted is None or self._converted[0] is not params:
            self._converted = None  # the previous copy goes before the new one is made
            self._converted = (params, self.call_on_mesh(self._convert, params))
        return self._converted[1]

    def _convert(self, params):  # the engine's copy (`_steps`)
        for step in self._steps(params):
            if step is not None:
                params = step(pure_params(params))
        return params

    def _steps(self, params) -> tuple:
        """(unstack, quantize): what makes the engine's copy of `params`, per-layer weights then
        8-bit (None: not needed); a tree pushed already quantized (`jaxrl.sync.quantized`) is
        not quantized again, and its per-layer copy is laid out as the engine's own."""
        pushed = self._quantize is not None and quantize.pushed_quantized(params, self.weights)
        if pushed and self.unstack and self._unstack_q is None:
            self._unstack_q = unstacker(
                self.model_config, self.mesh, self.rules, self.source_layers, self.weights
            )
        unstack = (self._unstack_q if pushed else self._unstack) if self.unstack else None
        return unstack, None if pushed else self._quantize

    def run(self, name: str, *args, **static):
        """Runs program `name` (its precompiled executable if `precompile` made one)."""
        if name != "move":
            args = (self.engine_params(args[0]), *args[1:])
        compiled = self.compiled.get(self._program_key(name, args, static))
        if compiled is not None:
            return self.call_on_mesh(compiled, *args)
        return self.call_on_mesh(self.jitted[name], *args, **static)

    def precompile(
        self,
        params: nnx.State,
        cache,
        config: SamplingConfig,
        *,
        capacity: int,
        prompt_buckets: Sequence[int],
        span_buckets: Sequence[int],
        active_buckets: Sequence[int],
        samples_per_request: int,
        max_prompt_len: int | None,
        recompute: bool,
        extend_widths: Sequence[int] | None,
        extend_min_rows: int,
        progress: Callable[[str], None] | None,
    ) -> int:
        """Compiles each program `Engine.precompile` names (its docstring) for `params`, `cache`
        and host arrays of the shapes `Engine.run` passes; `config` is the sampling config as
        the engine compiles it, the capacity and buckets are the engine's. Returns how many
        programs were compiled."""
        params = self.engine_params(params, abstract=True)
        n = self.num_slots
        widest = capacity if max_prompt_len is None else int(max_prompt_len)
        top_width = bucket(widest, prompt_buckets, capacity)
        widths = [b for b in prompt_buckets if b < top_width] + [top_width]
        most = max(1, n // max(int(samples_per_request), 1))
        batches = sorted({bucket(k, pow2_buckets(1, n), n) for k in range(1, most + 1)})
        prefills = [(b, w) for b in batches for w in widths]
        if recompute:  # every running row's prefix (up to the capacity), one row per slot
            all_widths = [*prompt_buckets, capacity]
            rows = sorted({bucket(k, pow2_buckets(1, n), n) for k in range(1, n + 1)})
            prefills += [(b, w) for b in rows for w in all_widths if (b, w) not in prefills]
        index = np.zeros(n, np.int32)
        jobs = []
        for batch, width in prefills:
            tokens = np.zeros((batch, width), np.int32)
            jobs.append(("prefill", (params, cache, tokens, tokens.astype(bool), index,
                                     index), {}))  # fmt: skip
        key_data = np.asarray(jax.random.key_data(jax.random.key(0)))
        exit_at = np.int32(0)
        spans = sorted(set(span_buckets) | {capacity})  # past the last: the capacity
        for span in spans:
            for active in active_buckets:
                state = tuple(
                    self.place_rows(np.zeros(active, dtype))
                    for dtype in (np.int32,) * 4 + (bool,) + (np.int32,) * 2
                )
                static = {"sampling": config, "span": span, "active": active}
                jobs.append(("decode", (params, cache, state, key_data, exit_at), static))
                for width in (w for w in extend_widths or () if w < span):
                    for count in extend_row_buckets(active, extend_min_rows):
                        rows = np.zeros(count, np.int32)
                        extend = (np.zeros((count, width), np.int32), rows, rows)
                        args = (params, cache, state, key_data, exit_at, extend)
                        jobs.append(("decode", args, static))
            jobs.append(("move", (cache, index, index), {"span": span}))
        start, done = time.perf_counter(), 0
        for name, args, static in jobs:
            key = self._program_key(name, args, static)
            if key in self.compiled:
                continue
            lowered = self.call_on_mesh(self.jitted[name].lower, *args, **static)
            self.compiled[key] = lowered.compile()
            done += 1
        if progress is not None:
            progress(
                f"[engine] precompiled {done} programs ({len(prefills)} prefill, "
                f"{sum(name == 'decode' for name, _, _ in jobs)} decode, {len(spans)} move) in "
                f"{time.perf_counter() - start:.1f}s"
            )
        return done

    def call_on_mesh(self, fn, *args, **kwargs):
        """`fn(*args, **kwargs)` under the mesh and its logical rules (directly without a mesh)."""
        if self.mesh is None:
            return fn(*args, **kwargs)
        with jax.set_mesh(self.mesh), flax_spmd.logical_axis_rules(self.rules):
            return fn(*args, **kwargs)

    def place_rows(self, array: np.ndarray) -> jax.Array:
        """A host `[S]` array on the devices, split over the slots' data-parallel axis."""
        if self.mesh is None:
            return jnp.asarray(array)
        spec = ax.logical_to_pspec((ax.ACT_BATCH,), self.rules)
        return ax.place_host(array, jax.sharding.NamedSharding(self.mesh, spec))

    def cache_shardings(self, positions: int):
        """NamedShardings of a KV cache of `positions` positions on the mesh (None without)."""
        if self.mesh is None:
            return None
        abstract = jax.eval_shape(lambda: self._init(positions))
        axes = (ax.ACT_BATCH, ax.ACT_LENGTH, ax.ACT_KV_HEADS, ax.ACT_HEAD_DIM)

        def sharding(c, logical):
            return jax.sharding.NamedSharding(self.mesh, ax.logical_to_pspec(logical, self.rules))

        kv_part = lambda c: sharding(c, (None,) * (c.ndim - 4) + axes)  # noqa: E731
        if not self.record:
            return jax.tree.map(kv_part, abstract)
        routing = jax.tree.map(lambda r: sharding(r, engine_routing.routing_axes(r)), abstract[1])
        return jax.tree.map(kv_part, abstract[0]), routing

    def _init(self, positions: int):
        """A zero KV cache of `num_slots` rows (and, recording, an empty routing record)."""
        kv = init_cache(self.model_config, self.num_slots, positions)
        if not self.record:
            return kv
        return kv, engine_routing.init_routing(self.model_config, self.num_slots, positions)

    def lower_prefill(self, abstract_params, cache, prompts: int, width: int):
        """The prefill program lowered for abstract inputs (`Engine.lower_prefill`)."""
        rep = self.replicated()
        s = jax.ShapeDtypeStruct
        args = (
            self.engine_params(abstract_params, abstract=True),
            cache,
            s((prompts, width), jnp.int32, sharding=rep),
            s((prompts, width), bool, sharding=rep),
            s((self.num_slots,), jnp.int32, sharding=rep),
            s((self.num_slots,), jnp.int32, sharding=rep),
        )
        return self.call_on_mesh(self.prefill.lower, *args)

    def lower_decode(self, abstract_params, cache, sampling: SamplingConfig, span: int):
        """The decode program lowered for abstract inputs (`Engine.lower_decode`); `sampling` is
        the config as the engine compiles it."""
        n = self.num_slots
        spec = ax.logical_to_pspec((ax.ACT_BATCH,), self.rules) if self.mesh is not None else None
        rows = None if spec is None else jax.sharding.NamedSharding(self.mesh, spec)
        s = jax.ShapeDtypeStruct
        state = tuple(
            s((n,), dtype, sharding=rows) for dtype in (jnp.int32,) * 4 + (bool,) + (jnp.int32,) * 2
        )
        key = s((2,), jnp.uint32, sharding=self.replicated())
        return self.call_on_mesh(
            self.decode.lower,
            self.engine_params(abstract_params, abstract=True),
            cache,
            state,
            key,
            s((), jnp.int32, sharding=self.replicated()),
            sampling=sampling,
            span=span,
            active=n,
        )

    def replicated(self):
        return None if self.mesh is None else ax.replicated(self.mesh)

    def abstract_cache(self, positions: int):
        """ShapeDtypeStructs of a KV cache of `positions` positions, with its shardings on a
        mesh."""
        abstract = jax.eval_shape(lambda: self._init(positions))
        shardings = self.cache_shardings(positions)
        if shardings is None:
            return abstract
        return ax.attach_shardings(abstract, shardings)

    def new_cache(self, positions: int):
        """A zero KV cache of `positions` positions per slot, placed on the mesh."""
        return self.call_on_mesh(lambda: jax.jit(lambda: self._constrain(self._init(positions)))())

    def grow_cache(self, cache, extra: int):
        """`cache` with `extra` more zero positions per slot. Not donated: the grown cache has
        another shape, so XLA cannot write it into the old buffers (a donation would be refused
        with a warning and copied anyway); the old cache is freed when the caller drops it."""
        axis = 2 if self.model_config.scan_layers else 1  # [L,] S, C, K, D

        def pad(cache):
            widths = [(0, 0)] * cache.ndim
            widths[axis] = (0, extra)
            empty = -1 if cache.dtype == engine_routing.ROUTING_DTYPE else 0  # a routing record
            return jnp.pad(cache, widths, constant_values=empty)

        grow = jax.jit(lambda c: self._constrain(jax.tree.map(pad, c)))
        return self.call_on_mesh(grow, cache)

    def _prefill_impl(self, params, cache, tokens_pt, valid_pt, dest_s, src_s):
        """Runs right-padded prompts `[P, T]` through the model into a fresh `[P, T]` cache, then
        copies row `src_s[i]`'s first T positions into slot `dest_s[i]` (out of range: skipped)."""
        self.stats.num_traces += 1
        model: Transformer = nnx.merge(self.graphdef, params)
        batch, width = tokens_pt.shape
        fresh = constrain_cache(init_cache(self.model_config, batch, width))
        # A `SegmentMask` (dense `causal_mask(valid_pt)` off the GPU kernels): on a GPU the
        # prefill's self-attention runs the fused kernel (`Transformer.hidden_states`).
        fresh = self._forward(
            model, tokens_pt, positions_from_mask(valid_pt), SegmentMask.from_valid(valid_pt),
            fresh, 0, fresh=True,
        )[1]  # fmt: skip
        axis = 1 if self.model_config.scan_layers else 0  # caches [L, B, C, K, D]: slots on 1
        return self._constrain(
            jax.tree.map(lambda full, new: _copy_rows(full, new, dest_s, src_s, axis), cache, fresh)
        )

    def _forward(self, model, tokens_bt, positions_bt, mask, cache, index, fresh=False):
        """`model.hidden_states` over the engine's cache: `(hidden, cache)`, the routing record
        (a mixture-of-experts model's) written where the keys / values are, from `index` (per
        row); `fresh`: `cache` is a fresh KV cache written from 0, the record made here."""
        if not self.record:
            return model.hidden_states(tokens_bt, positions_bt, mask, cache, index)
        kv = cache if fresh else cache[0]
        hidden, kv, info = model.hidden_states(
            tokens_bt, positions_bt, mask, kv, index, record_routing=True
        )
        if fresh:
            return hidden, (kv, engine_routing.as_layout(self.model_config, info.experts))
        routing = engine_routing.write_rows(self.model_config, cache[1], info.experts, index)
        return hidden, (kv, routing)

    def _constrain(self, cache):
        if not self.record:
            return constrain_cache(cache)
        return constrain_cache(cache[0]), engine_routing.constrain_routing(cache[1])

    def _extend_impl(self, params, cache, tokens_rw, start_r, slot_r, *, span: int):
        """Runs `tokens_rw[r]` through the model at positions `start_r[r]...` of slot
        `slot_r[r]`, attending over the slot's cache prefix `[:span]` (which must hold
        `start_r[r] + W`) and the row's own earlier tokens, and writes their keys / values there
        (rows with `slot_r` out of range, which come last, are skipped). Padding past a row's
        tokens writes positions no live row has reached: decode overwrites them first."""
        self.stats.num_traces += 1
        return self._extend_rows(params, cache, tokens_rw, start_r, slot_r, span)

    def _extend_rows(self, params, cache, tokens_rw, start_r, slot_r, span: int):
        model: Transformer = nnx.merge(self.graphdef, params)
        axis = 1 if self.model_config.scan_layers else 0
        rows = jnp.minimum(slot_r, jax.tree.leaves(cache)[0].shape[axis] - 1)

        def view(c):
            return jax.lax.slice_in_dim(jnp.take(c, rows, axis=axis), 0, span, axis=axis + 1)

        views = jax.tree.map(view, cache)
        positions_rw = start_r[:, None] + jnp.arange(tokens_rw.shape[1])[None, :]
        mask_rwl = jnp.arange(span)[None, None, :] <= positions_rw[:, :, None]
        _, views = self._forward(model, tokens_rw, positions_rw, mask_rwl, views, start_r)
        slots = jax.tree.leaves(cache)[0].shape[axis]
        if jax.tree.leaves(cache)[0].shape[axis + 1] == span:
            # The decode call's prefix (`span` positions): each slot takes its row by one gather
            # and a select, cheaper than a loop of in-place row copies into the prefix.
            match_sr = slot_r[None, :] == jnp.arange(slots)[:, None]
            has_s, row_s = match_sr.any(axis=1), jnp.argmax(match_sr, axis=1)

            def put(full, new):
                shape = [1] * full.ndim
                shape[axis] = slots
                picked = jnp.take(new, row_s, axis=axis).astype(full.dtype)
                return jnp.where(has_s.reshape(shape), picked, full)

            return self._constrain(jax.tree.map(put, cache, views))
        order = jnp.arange(slot_r.shape[0], dtype=jnp.int32)
        return self._constrain(
            jax.tree.map(lambda full, new: _copy_rows(full, new, slot_r, order, axis), cache, views)
        )

    def _move_impl(self, cache, dest_s, src_s, *, span: int):
        """Copies the first `span` positions (all the moved rows have written) of slot
        `src_s[i]`'s cache row to slot `dest_s[i]` (out of range: skipped)."""
        self.stats.num_traces += 1
        axis = 1 if self.model_config.scan_layers else 0

        def move(c):  # the sources are read from a copy of the written span
            written = jax.lax.slice_in_dim(c, 0, span, axis=axis + 1)
            return _copy_rows(c, written, dest_s, src_s, axis)

        return jax.tree.map(move, cache)

    def _decode_impl(
        self,
        params,
        cache,
        state,
        key_data,
        exit_at,
        extend=None,
        *,
        sampling: SamplingConfig,
        span: int,
        active: int,
    ):
        """`steps_per_call` decode steps of slots `[:active]` over the cache prefix `[:span]`,
        after `extend` (tokens_rw, start_r, slot_r: as for the extend program, slots below
        `active`, `start_r + W <= span`) when given: continuations join in the same call. With
        `early_exit` the steps stop sooner, once `exit_at` (an int32 scalar) of the rows live at
        the start have stopped or none is live; otherwise `exit_at` is unused.

        state: (token_s next input, pos_s its position = cache write index, index_s completion
        index of the next draw, budget_s max_new_tokens, live_s, req_s, sample_s).
        Returns (cache, state, (tokens_ns, logprobs_ns, kept_ns)).
        """
        self.stats.num_traces += 1
        key = jax.random.wrap_key_data(key_data)
        param_leaves, params_def = jax.tree.flatten(params)
        stacked = self.model_config.scan_layers
        seq_axis = 2 if stacked else 1

        def cut(c):
            c = jax.lax.slice_in_dim(c, 0, active, axis=seq_axis - 1)
            return jax.lax.slice_in_dim(c, 0, span, axis=seq_axis)

        # On a GPU or TPU (`in_place_decode`: a kernel form and a cache it tiles) the steps
        # decode into the whole (donated) cache: each step scatters its keys / values in place
        # and the kernel reads every row's own length, so nothing is sliced out, copied or
        # written back. Elsewhere the first `active` slots' prefix `[:span]` is cut out, decoded
        # into and written back at the end.
        capacity = jax.tree.leaves(cache)[0].shape[seq_axis]
        in_place = in_place_decode(self.model_config, capacity)
        if not in_place:
            note_xla_decode(self.model_config, capacity)
        prefix = cache if in_place else jax.tree.map(cut, cache)
        reach = capacity if in_place else span
        if extend is not None:
            prefix = self._extend_rows(params, prefix, *extend, span)
        stop_ids = jnp.asarray(sampling.stop_ids or (-1,), jnp.int32)
        n = self.steps_per_call
        s_count = active

        def draw(logits_sv, req_s, sample_s, index_s):
            # One keyed uniform per row and an inverse-CDF draw (`inverse_cdf_tokens`), not a
            # Gumbel draw of V keyed bits per row: threefry over [S, V] cost ~30x the rest of the
            # sampling at V = 32000 (measured on CPU, S = 64).
            logprobs_sv = processed_logprobs(logits_sv, sampling)
            if sampling.greedy:
                new_s = jnp.argmax(logits_sv, axis=-1).astype(jnp.int32)
            else:

                def uniform(r, g, t):
                    k = jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(key, r), g), t)
                    return jax.random.uniform(k, (), jnp.float32)

                u_s = jax.vmap(uniform)(req_s, sample_s, index_s)
                new_s = inverse_cdf_tokens(logprobs_sv, u_s)
            return new_s, jnp.take_along_axis(logprobs_sv, new_s[:, None], axis=-1)[:, 0]

        def body(i, carry):
            prefix, state, outs = carry
            token_s, pos_s, index_s, budget_s, live_s, req_s, sample_s = state
            write_s = jnp.minimum(pos_s, reach - 1)  # idle slots may run past; keep them in range
            mask_s1l = (jnp.arange(reach)[None, :] <= write_s[:, None])[:, None, :]
            model: Transformer = nnx.merge(
                self.graphdef, jax.tree.unflatten(params_def, param_leaves)
            )
            hidden, prefix = self._forward(
                model, token_s[:, None], write_s[:, None], mask_s1l, prefix, write_s
            )
            logits_sv = model.logits(hidden)[:, 0]
            new_s, logprob_s = draw(logits_sv, req_s, sample_s, index_s)
            kept_s = live_s
            outs = (
                outs[0].at[i].set(jnp.where(kept_s, new_s, self.pad_id)),
                outs[1].at[i].set(jnp.where(kept_s, logprob_s, 0.0)),
                outs[2].at[i].set(kept_s),
            )
            index_s = index_s + kept_s
            stopped_s = jnp.isin(new_s, stop_ids) | (index_s >= budget_s)
            state = (
                jnp.where(kept_s, new_s, token_s),
                pos_s + kept_s,
                index_s,
                budget_s,
                live_s & ~stopped_s,
                req_s,
                sample_s,
            )
            return prefix, state, outs

        outs = (
            jnp.full((n, s_count), self.pad_id, jnp.int32),
            jnp.zeros((n, s_count), jnp.float32),
            jnp.zeros((n, s_count), bool),
        )
        if not self.early_exit:
            prefix, state, outs = jax.lax.fori_loop(0, n, body, (prefix, state, outs))
        else:
            live0_s = state[4]

            def more(c):  # another step: below n steps, a row live, fewer than exit_at stopped
                live_s = c[1][1][4]
                return (c[0] < n) & jnp.any(live_s) & (jnp.sum(live0_s & ~live_s) < exit_at)

            start = (jnp.zeros((), jnp.int32), (prefix, state, outs))
            _, (prefix, state, outs) = jax.lax.while_loop(
                more, lambda c: (c[0] + 1, body(c[0], c[1])), start
            )
        if in_place:
            return self._constrain(prefix), state, outs
        cache = jax.tree.map(
            lambda c, p: jax.lax.dynamic_update_slice(c, p, (0,) * c.ndim), cache, prefix
        )
        return self._constrain(cache), state, outs

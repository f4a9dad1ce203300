"""Continuous-batching generation engine: decode slots, one prefill per group, live lengths.

The static `Sampler` runs a left-padded batch until its longest row stops, prefills each of a
group's G samples separately and attends over the whole `P_bucket + max_new` cache at every step.
This engine removes those three wastes.

Design
------
* **Slots.** A fixed number `S` of decode rows share one KV cache `[S, C, K, D]` per layer
  (`C = max_total_len`, or sized from the requests and grown as longer ones arrive). Each slot
  holds one sample of one request. A host FIFO queue holds the requests (prompt ids, G
  samples, per-request `max_new_tokens`, a `SamplingConfig`).
* **One prefill per group.** When at least G slots are free, the head request is admitted: its
  prompt is run through the model once (prompts admitted together are prefilled together,
  right-padded into a `[P_bucket, L_bucket]` batch) and its keys/values are copied into each of its
  G slots by the same device call (MaxText's `prefill_multisampling` + `bulk_insert`). The prefill
  computes no logits: each slot then feeds the prompt's last token as its first decode step (its
  key/value is rewritten in place), which draws the sample's first token from that slot's own
  noise. So a group costs `len(prompt)` prefill tokens, counted in `stats.prefill_tokens`.
* **Several decode steps per device call.** `decode` runs `steps_per_call` steps in a
  `fori_loop`; a slot whose row stops (stop token or its own `max_new_tokens`) idles until the call
  ends, then the host frees it, hands out finished groups and refills free slots. Larger
  `steps_per_call` amortises dispatch, smaller wastes fewer slot-steps on finished rows.
* **Attention over live lengths.** Each slot has its own length (write position `pos[s]`, the
  model's per-row `cache_index`), and a decode call attends only over a bucketed prefix
  `span = bucket(max live pos + steps_per_call)` of the cache: the prefix is sliced out at the
  start of the call, decoded into, and written back at its end, so attention and the cache copy
  cost follows the longest *live* row, not the capacity, and the number of compiled decode
  programs is the number of span buckets. We chose per-slot lengths over a bucketed prefix rather
  than a paged KV with a block table because XLA:CPU (this build) has no kernel that gathers pages
  cheaply: a gather of blocks per step would cost more than it saves. On TPU / GPU the same
  interface would be served by a Pallas ragged / paged attention kernel (JetStream's
  `ragged_paged_attention`, vLLM-style paged KV) that reads exactly each slot's `pos[s] + 1` keys;
  the slot bookkeeping here stays as it is.
* **A draining queue shrinks the batch.** Decode runs over the first `active` slots only
  (`active` = the power-of-two bucket holding the highest live slot); free slots are refilled
  lowest first, and when the live rows fit a smaller bucket the ones above it are moved down (a
  device copy of their cache rows). So the tail of a long-tailed workload, a few long rows after
  the queue is empty, costs those rows' steps, not `num_slots` rows per step.
* **Results independent of scheduling.** Sample g of request r draws token t from one uniform
  keyed by `fold_in(fold_in(fold_in(seed, r), g), t)` (per row, by inverse CDF:
  `inverse_cdf_tokens`, far cheaper than V Gumbel bits per row), never from the slot index or
  the step count, so the same requests give the same tokens with 4 slots or 64,
  in any arrival order. Tokens are identical; log-probs are bitwise equal when the batch shapes
  of the device calls are, and otherwise differ by XLA:CPU's shape-dependent fp32 rounding (up to
  ~5e-6 on a test model with logits of magnitude ~10).
* **Exact behaviour log-probs.** Every token's log-prob is `processed_logprobs` (fp32
  temperature, top-k / top-p, log-softmax) of the logits it was drawn from, as in the `Sampler`.

**Kept rows and continuations** (multi-turn episodes, `jaxrl.generation.episodes`). A request
with `keep_cache` keeps each sample's slot and KV cache when its row stops (a `KeptRow`), until
`release` or `reset`; a later one-sample request that `continues` it, whose prompt begins with the
row's sequence (its prompt and completion, then e.g. a tool's observation), takes over the slot:
only the new tokens run through the model at the row's own positions, attending over its cache,
at the start of the next decode call (no call of their own), instead of a prefill of the whole
prompt (`stats.extend_tokens`).
Continuations join whatever their place in the queue (they need no free slot); a request short
of free slots takes the slots of rows kept for `keep_calls` decode calls or more (their
continuations are then prefilled in full), and `run` returns early when only younger kept rows
hold it back (call it again once their continuations are queued). Noise stays keyed by the new
request's id: the tokens are those a fresh request draws.

In-flight weight updates (streaming RL, `jaxrl.loop.feeds.streaming`). `run(..., update=fn)` asks
`fn(version)` before every device call (so every `steps_per_call` decode steps) for newer weights;
when it returns `(new_version, new_params)` the running rows continue with them, without
draining. Every token records the version that sampled it (`GroupResult.versions_gn`), so a
trajectory may span several versions. The rows' KV cache, written by the older versions:
* `kv_on_update="keep"`: kept as is. A token's log-prob is then exactly that of a forward pass in
  which each position's keys / values and output are computed by the version recorded for it
  (the prompt by the version of the first token) -- what the behaviour log-probs mean, and what
  AIPO's per-token ratio corrects.
* `kv_on_update="recompute"`: the prefix of every running row (prompt and tokens so far) is
  prefilled again with the new weights (one batched prefill, each row its own sequence,
  `stats.recompute_tokens`), so later tokens are sampled as if the new version had written the
  whole prefix; the earlier tokens keep their versions and log-probs.

Sampling configs: all slots decoding together share one `SamplingConfig` (it is static in the
compiled programs; per-request `max_new_tokens` is dynamic). A request with a different config
waits until the running ones drain (FIFO order is kept).

Compiled programs (`stats.num_traces`): one prefill per (prompt-batch bucket, prompt-length
bucket) pair, one decode per (span bucket, active-slot bucket) pair per sampling config, one
slot-move program per span bucket, and decodes that extend continued rows first, one per
extend width bucket too: bounded by the bucket lists, never by the number of requests. Each is
compiled the first time its shape comes up, which stalls `run` mid-stream (0.7-1.9 s per program
on a CPU core for a 0.4M-parameter model); `precompile` compiles them all up front.

This module is the host scheduler (queue, admission, slots, swaps); the jitted programs are in
`jaxrl.generation.engine_programs`, `Request` / `GroupResult` / `EngineStats` in
`jaxrl.generation.engine_requests` (importable from here). Shapes: S slots, C cache capacity,
L span (attended prefix), P prompt batch, T prompt length, V vocabulary, N steps per call.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Sequence

import jax
import numpy as np
from flax import nnx

from jaxrl.generation import engine_routing
from jaxrl.generation.engine_device import MIN_CAPACITY, EngineDevice
from jaxrl.generation.engine_layout import bucket, pow2_buckets
from jaxrl.generation.engine_programs import EnginePrograms
from jaxrl.generation.engine_requests import EngineStats, GroupResult, KeptRow, Request
from jaxrl.generation.sampler import DEFAULT_PROMPT_BUCKETS
from jaxrl.generation.sampling import SamplingConfig
from jaxrl.infra import sharding as ax
from jaxrl.models.config import ModelConfig
from jaxrl.models.transformer import Transformer

KV_ON_UPDATE = ("keep", "recompute")
_KEPT = object()  # the owner of a kept row's slot (`Request.keep_cache`)


@dataclasses.dataclass
class _Live:
    """Host view of one admitted request. `slots[g]`: sample g's slot while it decodes (-1
    once it has stopped: its slot may then serve another row, of this request too)."""

    request: Request
    slots: list[int]
    tokens: list[list[int]]
    logprobs: list[list[float]]
    open_rows: int
    versions: list[list[int]] = dataclasses.field(default_factory=list)
    routing: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)  # sample -> record


class Engine(EngineDevice):
    """Continuous-batching sampler for a `Transformer` whose params are passed per run.

    Args:
      graphdef, model_config: as for `Sampler`.
      num_slots: decode rows (S); a request's G must not exceed it.
      pad_id, eos_ids: as for `Sampler` (EOS ends a row unless `SamplingConfig.ignore_eos`).
      max_total_len: cache capacity C, the longest prompt + completion. None: the cache is
        sized from the requests (`reserve`: the next power of two, at least `MIN_CAPACITY`,
        above the longest prompt + max_new_tokens so far), growing up to the model's
        `max_position_embeddings`. Either way a cache that would not fit in the devices' free
        memory is refused before it is allocated (`jaxrl.generation.kv_memory`).
      steps_per_call: decode steps per device call between refills.
      keep_calls: decode calls a kept row (`Request.keep_cache`) holds its slot against queued
        requests short of free slots (0: it gives way at once; see the module docstring).
      exit_stops: a decode call ends as soon as this many of its rows have stopped, while work
        waits for slots (queued requests, or the next turns of rows that keep their cache), or
        when none is live (0: every call runs `steps_per_call` steps). A stopped row then idles
        fewer steps before its slot or its next turn runs; the sampled tokens are the same.
      prompt_buckets: allowed padded prompt lengths for prefill (capped at C).
      span_buckets: allowed attended prefixes for decode (default: powers of two from 32, and C).
      mesh, rules: the generation mesh and its rules table (slots split over the data-parallel
        axis); None for one device. Meshes spanning several processes are refused.
      compile_only: the engine only lowers its programs (`lower_prefill` / `lower_decode`, as
        `launch.plan` does for a TPU topology); the single-process check, which concerns the host
        loop, is skipped.
      layer_layout: "auto", "stacked" or "unrolled": with scanned layers, whether the programs
        run on the engine's own per-layer copy of the weights ("auto": on GPUs, where decoding
        over stacked weights copies each layer's out of the stack every step; the copy is made
        once per weights object passed to `run` and held beside it;
        `jaxrl.generation.engine_programs`).
      extend_min_rows, extend_buckets: the fewest rows (`extend_row_buckets`) and the padded
        widths (default 8, 16, 32, ..., C) of a decode call's extension of continued rows: the
        padding a few tool replies pay against the number of decode programs to compile.

    Use: `submit` requests, then iterate `run(params, key)` for `GroupResult`s as groups finish;
    `cancel(request_id)` frees a request's slots at the next refill. `generate` does all three.
    """

    def __init__(
        self,
        graphdef: nnx.GraphDef,
        model_config: ModelConfig,
        *,
        num_slots: int,
        pad_id: int,
        eos_ids: Sequence[int] = (),
        max_total_len: int | None = None,
        steps_per_call: int = 8,
        keep_calls: int = 0,
        exit_stops: int = 0,
        prompt_buckets: Sequence[int] = DEFAULT_PROMPT_BUCKETS,
        span_buckets: Sequence[int] | None = None,
        mesh: jax.sharding.Mesh | None = None,
        rules: ax.LogicalRules | None = None,
        compile_only: bool = False,
        layer_layout: str = "auto",
        weights: str = "native",
        extend_min_rows: int = 8,
        extend_buckets: Sequence[int] | None = None,
    ):
        if (mesh is None) != (rules is None):
            raise ValueError("pass both mesh and rules, or neither")
        multi_process = mesh is not None and len({d.process_index for d in mesh.devices.flat}) > 1
        if multi_process and not compile_only:
            raise ValueError(
                "the engine runs on a single-process mesh; use the static Sampler for a generator "
                "mesh that spans processes"
            )
        if min(num_slots, steps_per_call, extend_min_rows) < 1 or exit_stops < 0:
            raise ValueError(f"num_slots={num_slots}, steps_per_call={steps_per_call}, "
                             f"extend_min_rows={extend_min_rows}, exit_stops={exit_stops}; "
                             "need >= 1 (exit_stops >= 0)")  # fmt: skip
        self.graphdef, self.model_config = graphdef, model_config
        self.num_slots, self.steps_per_call = int(num_slots), int(steps_per_call)
        self.keep_calls, self.extend_min_rows = int(keep_calls), int(extend_min_rows)
        self.exit_stops = int(exit_stops)
        self.pad_id, self.eos_ids = int(pad_id), tuple(int(i) for i in eos_ids)
        # The longest prompt + completion accepted; the cache spans `capacity <= max_capacity`
        # positions, grown with the requests when no max_total_len is given.
        self.max_capacity = int(max_total_len or model_config.max_position_embeddings)
        self.grows = max_total_len is None
        self._asked_buckets = (tuple(prompt_buckets), span_buckets)
        if extend_buckets is not None and (not extend_buckets or min(extend_buckets) < 1):
            raise ValueError(f"extend_buckets={extend_buckets}; need widths >= 1 (None: 8, 16..)")
        if span_buckets and min(span_buckets) < 1:
            raise ValueError(f"span_buckets={span_buckets}; need positions >= 1 (None: 32, 64..)")
        self._extend_buckets = None if extend_buckets is None else tuple(sorted(extend_buckets))
        start = min(MIN_CAPACITY, self.max_capacity) if self.grows else self.max_capacity
        self._set_capacity(start)
        self.mesh, self.rules = mesh, rules
        if mesh is not None:
            batch_axes = dict(rules)[ax.ACT_BATCH]
            names = (batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes or ())
            dp = int(np.prod([mesh.shape[a] for a in names]))
            if self.num_slots % dp:
                raise ValueError(f"num_slots={num_slots} must be a multiple of the data-parallel "
                                 f"size {dp}")  # fmt: skip
        else:
            dp = 1
        # Decode runs over the first `active` slots only (live rows are packed there when the
        # queue drains), so a draining tail does not pay for idle slots.
        # Buckets start at 8 rows: below that a decode step costs about the same.
        self.active_buckets = tuple(
            b for b in pow2_buckets(min(8, self.num_slots), self.num_slots) if b % dp == 0
        )
        self.stats = EngineStats()
        self._queue: collections.deque[Request] = collections.deque()
        self._ids: set[int] = set()
        self._cancelled: set[int] = set()
        self._static: dict[SamplingConfig, SamplingConfig] = {}
        self._kept: dict[tuple[int, int], KeptRow] = {}  # (request id, sample) -> its slot
        self._cache = None
        # The jitted device programs (`jaxrl.generation.engine_programs`), with those compiled
        # ahead by `precompile`, which `run` uses.
        self.programs = EnginePrograms(
            graphdef,
            model_config,
            num_slots=self.num_slots,
            steps_per_call=self.steps_per_call,
            pad_id=self.pad_id,
            mesh=mesh,
            rules=rules,
            stats=self.stats,
            layer_layout=layer_layout,
            weights=weights,  # `GeneratorConfig.weights`: "int8" etc. (`generation.quantize`)
            early_exit=self.exit_stops > 0,
        )
        if not compile_only and not self.grows:
            self._check_fits(self.capacity)

    @classmethod
    def for_model(cls, model: Transformer, **kwargs) -> tuple[Engine, nnx.State]:
        """An engine for `model` and its params; pad / EOS ids default to the config's."""
        graphdef, params = nnx.split(model)
        c = model.config
        kwargs.setdefault("pad_id", c.pad_token_id if c.pad_token_id is not None else 0)
        kwargs.setdefault("eos_ids", c.eos_token_ids)
        return cls(graphdef, c, **kwargs), params

    # --- requests -----------------------------------------------------------------------------

    def submit(self, request: Request) -> int:
        """Queues `request` after checking it; returns its id (ValueError naming the cause)."""
        rid, n = request.request_id, len(request.prompt)
        if rid in self._ids:
            raise ValueError(f"request id {rid} is already queued or running; ids must be unique")
        if n == 0:
            raise ValueError(
                f"request {rid}: the prompt is empty; there is nothing to condition on"
            )
        if request.budget < 1:
            raise ValueError(f"request {rid}: max_new_tokens={request.budget}; must be >= 1")
        if n + request.budget > self.max_capacity:
            raise ValueError(
                f"request {rid}: prompt of {n} tokens + max_new_tokens={request.budget} exceeds "
                f"the engine's context of {self.max_capacity} tokens; shorten or truncate the "
                "prompt, lower max_new_tokens, or build the engine with a larger max_total_len"
            )
        budgets = request.sample_budgets
        fits = budgets is None or all(1 <= b <= request.budget for b in budgets)
        if not fits or (budgets is not None and len(budgets) != request.num_samples):
            raise ValueError(
                f"request {rid}: sample_budgets={budgets}; need num_samples={request.num_samples} "
                f"values in 1..max_new_tokens={request.budget}"
            )
        if request.continues is not None and request.num_samples != 1:
            raise ValueError(
                f"request {rid}: continues a kept row with num_samples={request.num_samples}; "
                "a continuation is one sample (its row's own slot)"
            )
        if not 1 <= request.num_samples <= self.num_slots:
            raise ValueError(
                f"request {rid}: num_samples={request.num_samples} but the engine has "
                f"{self.num_slots} decode slots; a group's samples decode side by side, so build "
                "the engine with num_slots >= G (or split the group into several requests)"
            )
        self._ids.add(rid)
        self._queue.append(request)
        return rid

    def cancel(self, request_id: int) -> None:
        """Drops a queued request, or frees a running one's slots at the next refill (its result
        is never handed out). Unknown or finished ids are ignored."""
        if request_id in self._ids:
            self._cancelled.add(request_id)

    @property
    def kept_rows(self) -> dict[tuple[int, int], KeptRow]:
        """The kept rows (`Request.keep_cache`) by (request id, sample)."""
        return dict(self._kept)

    def release(self, request_id: int, sample: int) -> None:
        """Frees a kept row's slot; unknown rows are ignored."""
        self._kept.pop((request_id, sample), None)

    def reset(self) -> None:
        """Forgets every queued request, cancellation and kept row (e.g. after an interrupted
        `run`)."""
        self._queue.clear()
        self._ids.clear()
        self._cancelled.clear()
        self._kept.clear()

    def generate(
        self, params: nnx.State, requests: Iterable[Request], key: jax.Array
    ) -> list[GroupResult]:
        """Submits `requests`, runs them all, returns their results in submission order."""
        order = [self.submit(r) for r in requests]
        results = {g.request_id: g for g in self.run(params, key)}
        return [results[rid] for rid in order if rid in results]

    # --- the scheduling loop ------------------------------------------------------------------

    def _static_sampling(self, sampling: SamplingConfig) -> SamplingConfig:
        static = self._static.get(sampling)  # asked for every queued request at every refill
        if static is None:
            stops = sampling.stop_ids
            if not sampling.ignore_eos:
                stops = tuple(sorted(set(stops) | set(self.eos_ids)))
            static = dataclasses.replace(
                sampling, max_new_tokens=1, stop_ids=stops, ignore_eos=False
            )
            self._static[sampling] = static
        return static

    def run(
        self,
        params: nnx.State,
        key: jax.Array,
        *,
        version: int = 0,
        update: Callable[[int], tuple[int, nnx.State] | None] | None = None,
        kv_on_update: str = "keep",
    ) -> Iterator[GroupResult]:
        """Decodes until the queue is empty, yielding each group as its last sample stops.

        Requests may be submitted (or cancelled) while iterating; they join at the next refill.
        `key` seeds all the noise (see the module docstring). `version`: the policy version of
        `params`, recorded per token. `update(version)`: asked before every device call for
        newer weights, `(new_version, new_params)` or None; `kv_on_update`: "keep" or
        "recompute" the running rows' KV on a swap (see the module docstring).
        """
        if kv_on_update not in KV_ON_UPDATE:
            raise ValueError(f"kv_on_update={kv_on_update!r}; use one of {KV_ON_UPDATE}")
        s_count, n_steps = self.num_slots, self.steps_per_call
        key_data = np.asarray(jax.random.key_data(key))
        self.reserve()
        if self._cache is None:
            self._cache = self.programs.new_cache(self.capacity)
        # Host mirrors of the per-slot state (the device gets them each call: [S] int32 / bool).
        owner: list[int | None] = [None] * s_count  # request id per slot
        token = np.zeros(s_count, np.int32)
        pos = np.zeros(s_count, np.int32)
        index = np.zeros(s_count, np.int32)  # completion token index of the next draw
        budget = np.ones(s_count, np.int32)
        live = np.zeros(s_count, bool)
        req_of = np.zeros(s_count, np.int32)
        sample_of = np.zeros(s_count, np.int32)
        running: dict[int, _Live] = {}
        config: SamplingConfig | None = None
        for row in self._kept.values():  # kept rows hold their slots from earlier runs
            owner[row.slot], token[row.slot] = _KEPT, row.ids[-1]
            pos[row.slot] = len(row.ids) - 1
        self._view = (owner, pos, running)  # for `cached_sequences`
        self.version = version

        while self._queue or running:
            if update is not None:
                swapped = update(self.version)
                if swapped is not None:
                    self.version, params = swapped
                    self.stats.swaps += 1
                    if kv_on_update == "recompute" and running:
                        self._recompute(params)
            # Cancelled requests leave the queue and free their slots.
            for rid in list(self._cancelled):
                self._cancelled.discard(rid)
                self._ids.discard(rid)
                self._queue = collections.deque(r for r in self._queue if r.request_id != rid)
                if rid in running:
                    for s in running.pop(rid).slots:
                        if s >= 0:  # a stopped sample's slot may be another row's by now
                            owner[s], live[s] = None, False
            kept_slots = {row.slot for row in self._kept.values()}
            for s in range(s_count):  # released kept rows
                if owner[s] is _KEPT and s not in kept_slots:
                    owner[s] = None
            if not running:
                config = None
            # Continuations of kept rows join in their own slots, whatever their queue position.
            continued, config = self._take_continuations(config, owner)
            # Admit FIFO while G slots are free and the sampling config matches the running one.
            free = [s for s in range(s_count) if owner[s] is None]
            admitted: list[tuple[Request, list[int]]] = []
            while self._queue:
                head = self._queue[0]
                head_config = self._static_sampling(head.sampling)
                if config is not None and head_config != config:
                    break
                if head.continues in self._kept:
                    break
                calls = self.stats.decode_calls  # rows kept this long wait on slow tools
                stale = [k for k, row in self._kept.items() if calls - row.since >= self.keep_calls]
                short = head.num_samples - len(free)
                if short > len(stale):
                    break
                for key in stale[: max(short, 0)]:  # evicted: prefilled in full later
                    free.append(self._kept.pop(key).slot)
                    owner[free[-1]] = None
                free.sort()
                self.reserve(len(head.prompt) + head.budget)  # a request submitted mid-run
                config = head_config
                self._queue.popleft()
                slots, free = free[: head.num_samples], free[head.num_samples :]
                admitted.append((head, slots))
            # The new part of each continued prompt, from its row's last token to the prompt's
            # second-to-last (the last is the first decode input): run in this call's decode.
            extending = [(r.request_id, start, r.prompt[start:-1]) for r, _, start in continued]
            if admitted:
                self._admit(params, admitted)
            for request, slots in [*admitted, *((r, [s]) for r, s, _ in continued)]:
                tokens_g, logprobs_g, versions_g = ([[] for _ in slots] for _ in range(3))
                running[request.request_id] = _Live(
                    request, slots, tokens_g, logprobs_g, len(slots), versions_g
                )
                for g, s in enumerate(slots):
                    owner[s], live[s] = request.request_id, True
                    token[s], pos[s] = request.prompt[-1], len(request.prompt) - 1
                    index[s], budget[s] = 0, request.sample_budget(g)
                    req_of[s], sample_of[s] = request.request_id, g
            if not running:
                if self._queue:  # waits for slots of kept rows: their continuations come later
                    return
                continue

            # Pack live rows into the smallest slot bucket that holds them (a device copy of
            # their cache rows), then decode over that bucket only.
            state = [token, pos, index, budget, live, req_of, sample_of]
            target = bucket(int(live.sum()), self.active_buckets, s_count)
            movers = [s for s in np.flatnonzero(live) if s >= target]
            holes = [s for s in range(target) if owner[s] is None][: len(movers)]
            movers = movers[: len(holes)]  # kept rows may hold some of the holes
            if movers:
                dest = np.full(s_count, s_count, np.int32)
                src = np.zeros(s_count, np.int32)
                dest[: len(movers)], src[: len(movers)] = holes, movers
                span = bucket(int(pos[movers].max()) + 1, self.span_buckets, self.capacity)
                self._cache = self.programs.run("move", self._cache, dest, src, span=span)
                self.stats.moved_rows += len(movers)
                for a, b in zip(movers, holes, strict=True):
                    for x in state:
                        x[b] = x[a]
                    live[a], owner[b], owner[a] = False, owner[a], None
                    group = running[owner[b]]
                    group.slots[group.slots.index(a)] = b
            active = bucket(int(np.flatnonzero(live).max()) + 1, self.active_buckets, s_count)
            # Past each live row's last write this call (its budget may end sooner than
            # n_steps): the span follows the rows, never the cache's length.
            last = pos[live] + np.minimum(n_steps, budget[live] - index[live])
            # Kept rows among the decoded ones rewrite their last position: keep it in the span.
            kept = [int(pos[s]) + 1 for s in range(active) if owner[s] is _KEPT]
            rows = [(running[rid].slots[0], start, ids) for rid, start, ids in extending]
            extend, reach = self._extension(params, rows, active)
            span = bucket(max([int(last.max()), *kept, reach]), self.span_buckets, self.capacity)
            waits = self._queue or any(g.request.keep_cache for g in running.values())
            exit_at = self.exit_stops if self.exit_stops and waits else active + 1
            self._cache, new_state, out = self.programs.run(
                "decode",
                params,
                self._cache,
                tuple(self.programs.place_rows(x[:active]) for x in state),
                key_data,
                np.int32(exit_at),
                *([] if extend is None else [extend]),
                sampling=config,
                span=span,
                active=active,
            )
            for x, new in zip(state, new_state, strict=True):
                x[:active] = np.asarray(new)
            token, pos, index, budget, live, req_of, sample_of = state
            out_tokens, out_logprobs, out_valid = (np.asarray(x) for x in out)  # [N, active]
            self.stats.decode_calls += 1
            steps = int(out_valid.any(axis=1).sum()) if self.exit_stops else n_steps
            self.stats.slot_steps += steps * active
            self.stats.attended_positions += steps * active * span
            self.stats.early_exits += steps < n_steps
            self.stats.kept_tokens += int(out_valid.sum())
            records = self._stopped_records(owner, live, pos, running, active)

            for rid in list(running):
                group = running[rid]
                for g, s in enumerate(group.slots):
                    if s < 0 or owner[s] != rid or s >= active:
                        continue
                    kept = out_valid[:, s]
                    group.tokens[g].extend(out_tokens[kept, s].tolist())
                    group.logprobs[g].extend(out_logprobs[kept, s].tolist())
                    group.versions[g].extend([self.version] * int(kept.sum()))
                    if not live[s]:
                        if records is not None:
                            group.routing[g] = records[s]
                        owner[s], group.slots[g] = None, -1
                        group.open_rows -= 1
                        if group.request.keep_cache and rid not in self._cancelled:
                            ids = (*group.request.prompt, *group.tokens[g])
                            row = KeptRow(s, ids, self.stats.decode_calls)
                            self._kept[rid, g], owner[s] = row, _KEPT
                        if group.request.per_sample and rid not in self._cancelled:
                            routing = engine_routing.rows_of(group.routing, [g])
                            yield GroupResult.of(group.request, [group.tokens[g]],
                                                 [group.logprobs[g]], [group.versions[g]],
                                                 self.pad_id, (g,), routing)  # fmt: skip
                if group.open_rows == 0:
                    del running[rid]
                    self._ids.discard(rid)
                    if rid in self._cancelled:
                        self._cancelled.discard(rid)
                        continue
                    if not group.request.per_sample:
                        routing = engine_routing.rows_of(group.routing, range(len(group.slots)))
                        yield GroupResult.of(group.request, group.tokens, group.logprobs,
                                             group.versions, self.pad_id,
                                             routing=routing)  # fmt: skip

    def cached_sequences(self) -> dict[int, tuple[int, int, list[int]]]:
        """Slot -> (request id, sample index, the ids whose keys / values the slot's cache holds:
        prompt + completion so far, without the newest token, which is the next input). Valid
        between device calls of a `run` (e.g. inside `update`)."""
        owner, pos, running = self._view
        out = {row.slot: (rid, g, list(row.ids[:-1])) for (rid, g), row in self._kept.items()}
        for rid, group in running.items():
            for g, s in enumerate(group.slots):
                if s >= 0 and owner[s] == rid:
                    ids = list(group.request.prompt) + group.tokens[g]
                    out[s] = (rid, g, ids[: int(pos[s])])
        return out

    def _take_continuations(self, config, owner) -> tuple[list[tuple[Request, int, int]], object]:
        """Takes from the queue the continuations of kept rows (`Request.continues`) of the
        running sampling config: (request, its row's slot, the row's cached length) each, and the
        config. A request whose prompt does not begin with its row's sequence frees the row and
        stays queued, to be prefilled as usual."""
        taken, rest = [], collections.deque()
        for request in self._queue:
            row = self._kept.get(request.continues) if request.continues is not None else None
            if row is not None and tuple(request.prompt[: len(row.ids)]) != row.ids:
                del self._kept[request.continues]
                owner[row.slot], row = None, None
            request_config = self._static_sampling(request.sampling)
            if row is None or (config is not None and request_config != config):
                rest.append(request)
                continue
            self.reserve(len(request.prompt) + request.budget)
            config = request_config
            del self._kept[request.continues]
            self.stats.continued_rows += 1
            self.stats.kept_wait_calls += self.stats.decode_calls - row.since
            taken.append((request, row.slot, len(row.ids) - 1))
        self._queue = rest
        return taken, config

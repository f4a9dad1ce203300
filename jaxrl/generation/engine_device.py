"""The continuous-batching engine's device-side API (`jaxrl.generation.engine.Engine` inherits
it): the cache's length (fixed, or grown with the requests), compiling the programs ahead of
`run`, and the cache's and programs' abstract forms for `launch.plan`. The programs themselves
are in `jaxrl.generation.engine_programs`."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from flax import nnx

from jaxrl.generation import engine_routing, kv_memory
from jaxrl.generation.engine_layout import bucket, extend_row_buckets, pow2_buckets
from jaxrl.generation.engine_requests import Request
from jaxrl.generation.sampling import SamplingConfig

# The shortest cache an engine that grows with its requests starts from.
MIN_CAPACITY = 64


class EngineDevice:
    """`Engine`'s methods over its `programs` (an `EnginePrograms`), cache and buckets."""

    # --- the device calls' host arrays -------------------------------------------------------

    def _admit(self, params, admitted: list[tuple[Request, list[int]]]) -> None:
        """Prefills the admitted prompts (each once) and copies each into its G slots."""
        lengths = [len(r.prompt) for r, _ in admitted]
        width = bucket(max(lengths), self.prompt_buckets, self.capacity)
        batch = bucket(len(admitted), pow2_buckets(1, self.num_slots), self.num_slots)
        tokens = np.full((batch, width), self.pad_id, np.int32)
        valid = np.zeros((batch, width), bool)
        dest = np.full(self.num_slots, self.num_slots, np.int32)  # out of range: dropped
        src = np.zeros(self.num_slots, np.int32)
        i = 0
        for row, (request, slots) in enumerate(admitted):
            tokens[row, : len(request.prompt)] = request.prompt
            valid[row, : len(request.prompt)] = True
            for s in slots:
                dest[i], src[i] = s, row
                i += 1
        valid[len(admitted) :, 0] = True  # padding rows: one token, so softmax rows are defined
        self.stats.prefill_calls += 1
        self.stats.prefill_tokens += sum(lengths)
        self.stats.prefill_padded_tokens += batch * width
        self._cache = self.programs.run("prefill", params, self._cache, tokens, valid, dest, src)

    def _extension(self, params, rows: list[tuple[int, int, Sequence[int]]], active: int):
        """The decode call's `extend` arrays for continued rows (slot, first position, new ids)
        and the positions they reach; rows too near the capacity for a padded width are written
        by extend calls of their own first (then None, 0)."""
        rows = [row for row in rows if len(row[2])]
        if not rows:
            return None, 0
        longest = max(len(ids) for _, _, ids in rows)
        width = bucket(longest, self.extend_widths(), self.capacity)
        reach = max(start for _, start, _ in rows) + width
        # Rows bucketed (extend_min_rows, twice that, ...): a few continuations do not pay for
        # every active slot.
        buckets = extend_row_buckets(active, self.extend_min_rows)
        count = bucket(len(rows), buckets, active)
        tokens = np.full((count, width), self.pad_id, np.int32)
        start_r = np.zeros(count, np.int32)
        slot_r = np.full(count, active, np.int32)  # out of range: not written back
        for r, (slot, start, ids) in enumerate(rows):
            tokens[r, : len(ids)], start_r[r], slot_r[r] = ids, start, slot
        self.stats.extend_calls += 1
        self.stats.extend_tokens += sum(len(ids) for _, _, ids in rows)
        if reach <= self.capacity:
            self.stats.extend_padded_tokens += count * width
            return (tokens, start_r, slot_r), reach
        self.stats.extend_padded_tokens += sum(len(ids) for _, _, ids in rows)
        for r, (slot, start, ids) in enumerate(rows):  # one row per call, its exact width
            one = (tokens[r : r + 1, : len(ids)], start_r[r : r + 1], np.array([slot], np.int32))
            span = bucket(start + len(ids), self.span_buckets, self.capacity)
            self._cache = self.programs.run("extend", params, self._cache, *one, span=span)
        return None, 0

    def _recompute(self, params) -> None:
        """Prefills every running row's cached prefix again with `params` (kv_on_update =
        "recompute"): one row per slot (a group's samples have diverged), through the prefill
        program, written into the slot's first positions."""
        rows = [(s, ids) for s, (_, _, ids) in sorted(self.cached_sequences().items()) if ids]
        if not rows:
            return
        width = bucket(max(len(ids) for _, ids in rows), self.prompt_buckets, self.capacity)
        batch = bucket(len(rows), pow2_buckets(1, self.num_slots), self.num_slots)
        tokens = np.full((batch, width), self.pad_id, np.int32)
        valid = np.zeros((batch, width), bool)
        dest = np.full(self.num_slots, self.num_slots, np.int32)
        src = np.zeros(self.num_slots, np.int32)
        for row, (s, ids) in enumerate(rows):
            tokens[row, : len(ids)], valid[row, : len(ids)] = ids, True
            dest[row], src[row] = s, row
        valid[len(rows) :, 0] = True
        self.stats.recompute_tokens += sum(len(ids) for _, ids in rows)
        self.stats.prefill_padded_tokens += batch * width
        self._cache = self.programs.run("prefill", params, self._cache, tokens, valid, dest, src)

    def _stopped_records(self, owner, live, pos, running, active) -> dict[int, np.ndarray] | None:
        """A mixture-of-experts model's routing records of the rows that stopped in the last
        decode call (slot -> `[pos + 1, L, k]`: every position the row ran, and -1 for its last
        token), read before their slots serve other rows; None when the engine keeps none."""
        if not self.programs.record:
            return None
        stopped = [s for s in range(active) if owner[s] in running and not live[s]]
        if not stopped:
            return {}
        rows = bucket(len(stopped), pow2_buckets(1, self.num_slots), self.num_slots)
        slots = np.zeros(rows, np.int32)
        slots[: len(stopped)] = stopped
        span = bucket(int(pos[stopped].max()), self.span_buckets, self.capacity)
        read = engine_routing.read_rows(self.model_config, self._cache[1], slots, span)
        return {
            s: engine_routing.with_unrecorded_last(read[i, : int(pos[s])])
            for i, s in enumerate(stopped)
        }

    # --- the cache's length -------------------------------------------------------------------

    def _set_capacity(self, capacity: int) -> None:
        prompt_buckets, span_buckets = self._asked_buckets
        self.capacity = int(capacity)
        self.prompt_buckets = tuple(sorted(b for b in prompt_buckets if b < self.capacity))
        spans = span_buckets or pow2_buckets(min(32, self.capacity), self.capacity)
        self.span_buckets = tuple(sorted(b for b in spans if b <= self.capacity))

    def _check_fits(self, capacity: int) -> None:
        devices = None if self.mesh is None else self.mesh.devices.flat
        kv_memory.check_cache_fits(
            self.model_config, self.num_slots, capacity, self.abstract_cache(capacity), devices
        )

    def reserve(self, positions: int | None = None) -> None:
        """Grows the cache (an engine built without max_total_len) to hold requests of
        `positions` prompt + completion tokens (default: the longest queued request), to the
        next power of two (at least `MIN_CAPACITY`) up to `max_capacity`; refuses with the
        figures when that cache cannot fit in memory. Running rows keep their keys and values;
        the programs compiled for the old length are compiled again as they come up. Decode and
        prefill shapes follow the rows, not the capacity, so a grown engine samples the same
        tokens and log-probs. A no-op for a fixed-length engine or a cache already long enough.
        """
        if positions is None:
            positions = max((len(r.prompt) + r.budget for r in self._queue), default=0)
        if not self.grows or positions <= self.capacity:
            return
        capacity = min(self.max_capacity, max(MIN_CAPACITY, 1 << (int(positions) - 1).bit_length()))
        self._check_fits(capacity)
        if self._cache is not None:
            self._cache = self.programs.grow_cache(self._cache, capacity - self.capacity)
        self.programs.compiled.clear()
        self._set_capacity(capacity)

    def precompile(
        self,
        params: nnx.State,
        sampling: SamplingConfig,
        *,
        samples_per_request: int = 1,
        max_prompt_len: int | None = None,
        recompute: bool = False,
        max_extend_len: int | None = None,
        progress: Callable[[str], None] | None = None,
    ) -> int:
        """Compiles, ahead of `run`, every program it can call for requests of `sampling` with
        `samples_per_request` samples and prompts of at most `max_prompt_len` tokens: each
        decode (span bucket x active-slot bucket), prefill (prompt-batch bucket x prompt-length
        bucket; `recompute`: also the re-prefill of every slot's prefix), slot move and, with
        `max_extend_len`, each extend of continuations of up to that many new tokens. `run`
        otherwise compiles each the first time it is needed, which stalls the generator
        mid-run (seconds per program on a CPU core). Nothing is executed: the programs are
        lowered for `params`, the cache and host arrays of the shapes and placements `run`
        passes. Returns how many programs were compiled; `progress` gets a one-line summary."""
        if self._cache is None:
            self._cache = self.programs.new_cache(self.capacity)
        return self.programs.precompile(
            params,
            self._cache,
            self._static_sampling(sampling),
            capacity=self.capacity,
            prompt_buckets=self.prompt_buckets,
            span_buckets=self.span_buckets,
            active_buckets=self.active_buckets,
            samples_per_request=samples_per_request,
            max_prompt_len=max_prompt_len,
            recompute=recompute,
            extend_widths=None if max_extend_len is None else self.extend_widths(max_extend_len),
            extend_min_rows=self.extend_min_rows,
            progress=progress,
        )

    def extend_widths(self, longest: int | None = None) -> tuple[int, ...]:
        """The padded widths of extend calls (`extend_buckets`, default powers of two from 8;
        and the capacity), up to the one that holds `longest` new tokens."""
        if self._extend_buckets is None:
            widths = pow2_buckets(min(8, self.capacity), self.capacity)
        else:
            widths = (*(w for w in self._extend_buckets if w < self.capacity), self.capacity)
        if longest is None:
            return widths
        return tuple(w for w in widths if w < longest) + (bucket(longest, widths, self.capacity),)

    def cache_shardings(self, positions: int | None = None):
        """NamedShardings of the KV cache (of `positions`, default the capacity) on the engine's
        mesh (None without a mesh)."""
        return self.programs.cache_shardings(positions or self.capacity)

    def abstract_cache(self, positions: int | None = None):
        """ShapeDtypeStructs of the KV cache (of `positions`, default the capacity), with its
        shardings on a mesh."""
        return self.programs.abstract_cache(positions or self.capacity)

    def lower_prefill(self, abstract_params, prompts: int, width: int):
        """The prefill program lowered for abstract inputs (nothing allocated): `prompts`
        right-padded prompts of `width` tokens copied into the slots. For `launch.plan`."""
        return self.programs.lower_prefill(abstract_params, self.abstract_cache(), prompts, width)

    def lower_decode(self, abstract_params, sampling: SamplingConfig, span: int | None = None):
        """The decode program (`steps_per_call` steps of every slot over the cache prefix `span`,
        default the capacity) lowered for abstract inputs. For `launch.plan`."""
        span = self.capacity if span is None else span
        return self.programs.lower_decode(
            abstract_params, self.abstract_cache(), self._static_sampling(sampling), span
        )

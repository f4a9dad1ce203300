"""What goes into the continuous-batching engine (`jaxrl.generation.engine`) and what comes out:
a `Request` (one prompt, G samples), the `GroupResult` of its G completions, and the engine's
`EngineStats` counters. `jaxrl.generation.engine` re-exports all three.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxrl.generation.sampling import SamplingConfig


@dataclasses.dataclass(frozen=True)
class Request:
    """One prompt to complete `num_samples` times.

    max_new_tokens: this request's completion budget (default: `sampling.max_new_tokens`).
    request_id: keys the sampling noise (with the sample index and token index); unique per run.
    keep_cache: when a sample's row stops, its slot and KV cache are kept (a `KeptRow`, keyed
      by (request_id, sample)) for a later request that `continues` it, until
      `Engine.release(request_id, sample)` or `Engine.reset`.
    continues: (request id, sample) of a kept row whose sequence (prompt and completion) begins
      this prompt: the request (one sample) takes over that row's slot and only the rest of
      its prompt runs through the model (an extend call), not the whole. With no such row kept,
      or a prompt that does not begin with its sequence, the prompt is prefilled as usual.
    sample_budgets: per-sample `max_new_tokens` (G values in 1..`budget`); None: `budget` each.
    per_sample: each sample is handed out as its row stops (a one-row `GroupResult` whose
      `samples` names it), not the group when its last row does: a multi-turn episode's tool
      call starts while the other samples of its group still decode.
    """

    request_id: int
    prompt: Sequence[int]
    num_samples: int = 1
    sampling: SamplingConfig = SamplingConfig()
    max_new_tokens: int | None = None
    keep_cache: bool = False
    continues: tuple[int, int] | None = None
    per_sample: bool = False
    sample_budgets: tuple[int, ...] | None = None

    @property
    def budget(self) -> int:
        return self.max_new_tokens or self.sampling.max_new_tokens

    def sample_budget(self, g: int) -> int:
        """Sample g's `max_new_tokens` (`sample_budgets[g]`, else `budget`)."""
        return self.budget if self.sample_budgets is None else self.sample_budgets[g]


@dataclasses.dataclass(frozen=True)
class GroupResult:
    """The G completions of one request (host arrays, N = the request's `max_new_tokens`).

    tokens_gn: sampled ids, `pad_id` after a row's stop. logprobs_gn: float32 behaviour
    log-probs (0 where masked). mask_gn: True on completion tokens (the stop token included).
    versions_gn: int32 policy version that sampled each token (-1 where masked).
    samples: the sample index of each row (a `Request.per_sample` result: one row); None: rows
      0..G-1, the whole group.
    routing_g: a mixture-of-experts model's routing record per row, int16
      `[len(prompt) + lengths_g[g], L, k]` (`jaxrl.generation.engine_routing`); None when dense.
    """

    request_id: int
    prompt: tuple[int, ...]
    tokens_gn: np.ndarray
    logprobs_gn: np.ndarray
    mask_gn: np.ndarray
    versions_gn: np.ndarray | None = None
    samples: tuple[int, ...] | None = None
    routing_g: tuple[np.ndarray, ...] | None = None

    @property
    def lengths_g(self) -> np.ndarray:
        return self.mask_gn.sum(axis=-1)

    @classmethod
    def of(
        cls, request: Request, tokens, logprobs, versions, pad_id: int, samples=None, routing=None
    ) -> GroupResult:
        """The result of `request` from each row's token, log-prob and version lists and routing
        records (rows `samples`, default all)."""
        g, n = len(tokens), request.budget
        tokens_gn = np.full((g, n), pad_id, np.int32)
        logprobs_gn = np.zeros((g, n), np.float32)
        mask_gn = np.zeros((g, n), bool)
        versions_gn = np.full((g, n), -1, np.int32)
        for row, (toks, lps, vs) in enumerate(zip(tokens, logprobs, versions, strict=True)):
            tokens_gn[row, : len(toks)], logprobs_gn[row, : len(lps)] = toks, lps
            mask_gn[row, : len(toks)], versions_gn[row, : len(toks)] = True, vs
        return cls(request.request_id, tuple(request.prompt), tokens_gn, logprobs_gn, mask_gn,
                   versions_gn, None if samples is None else tuple(samples),
                   None if routing is None else tuple(routing))  # fmt: skip


@dataclasses.dataclass
class KeptRow:
    """A stopped row kept in its slot (`Request.keep_cache`): `ids` is its whole sequence,
    prompt and completion; the cache holds the keys / values of all but the last. `since`: the
    engine's decode call count when it stopped."""

    slot: int
    ids: tuple[int, ...]
    since: int = 0


@dataclasses.dataclass
class EngineStats:
    """Counters since the engine was built.

    prefill_tokens: prompt tokens run through prefill (each request's prompt once).
    prefill_padded_tokens: prefill positions computed, padding included.
    slot_steps: decode slot-steps executed (S per decode step, idle slots included).
    attended_positions: slot-steps times the span each attended over (the cache prefix a
      decode call reads every step where it runs in the XLA form: the longest row's, in every
      row).
    kept_tokens: slot-steps that produced a completion token (utilisation = kept / slot_steps).
    decode_calls, prefill_calls: device calls; num_traces: programs compiled. early_exits:
      decode calls that ended before `steps_per_call` steps (`Engine.exit_stops`).
    swaps: in-flight weight updates; recompute_tokens: prefix tokens prefilled again on them.
    moved_rows: live rows moved down to a smaller active-slot bucket (their cache rows copied).
    extend_calls, extend_tokens: decode calls that also ran continued rows' new tokens
      (`Request.continues`; the new part of each prompt) through the model, and those tokens;
      extend_padded_tokens: the positions those extensions computed (rows x width, padding
      included).
    continued_rows: kept rows continued in their own slots. kept_wait_calls: decode calls that
      ran while such a row waited for its continuation, summed over those rows (0: each
      continuation joined the call right after the one its row stopped in).
    """

    prefill_tokens: int = 0
    prefill_padded_tokens: int = 0
    slot_steps: int = 0
    attended_positions: int = 0
    kept_tokens: int = 0
    decode_calls: int = 0
    early_exits: int = 0
    prefill_calls: int = 0
    num_traces: int = 0
    swaps: int = 0
    recompute_tokens: int = 0
    moved_rows: int = 0
    extend_calls: int = 0
    extend_tokens: int = 0
    extend_padded_tokens: int = 0
    continued_rows: int = 0
    kept_wait_calls: int = 0

    @property
    def utilisation(self) -> float:
        return self.kept_tokens / max(self.slot_steps, 1)

"""What an 8-bit generator's sampling costs the policy: the mismatch at the behaviour version.

An engine with 8-bit weights (`GeneratorConfig.weights`, `jaxrl.generation.quantize`) samples
from a policy mu_q that is not the full-precision policy pi it was quantized from, at the same
version. `MismatchScorer` scores the tokens the engine sampled with those full-precision weights
(the very params object the engine quantized: the trainer's in sync mode, the pushed version in
async mode), one whole-sequence forward per batch on the generator's devices, and
`mismatch_metrics` compares the two per token:

    gen/mismatch_kl             mean over sampled tokens of (r - 1) - log r, r = pi / mu_q: an
                                unbiased, non-negative estimate of KL(mu_q || pi) from mu_q's
                                samples ("k3")
    gen/mismatch_log_ratio      mean of log mu_q - log pi (the plain "k1" estimate of the same KL)
    gen/mismatch_abs_log_ratio_max
    time/mismatch_s             the scoring forward's wall time

Beside the lag (which the trainer's own `ratio_*` / `behaviour_kl` metrics see mixed in), this
is the quantization alone. `GeneratorConfig.mismatch = "uncorrected"` (a negative control)
also hands the trainer pi's log-probs as the behaviour log-probs, so its importance weights
correct the lag but not the quantization.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl.models.masks import SegmentMask
from jaxrl.rl.logprobs import token_logprobs

MISMATCH_MODES = ("off", "measure", "uncorrected")
_LENGTH_STEP = 64  # sequences are padded to a multiple of this: one compile per length bucket
_VOCAB_CHUNK = 8192


class MismatchScorer:
    """Full-precision log-probs of sampled completions, on the engine's mesh and rules.

    `graphdef`: the engine's model; `temperature`: the sampling temperature (RL samples with
    top_k=0 and top_p=1, so the behaviour log-probs are the tempered softmax's);
    `call_on_mesh`: runs a function under the engine's mesh and logical rules
    (`EnginePrograms.call_on_mesh`)."""

    def __init__(self, graphdef: nnx.GraphDef, temperature: float, call_on_mesh=None):
        self.graphdef, self.temperature = graphdef, float(temperature)
        self.call_on_mesh = call_on_mesh or (lambda fn, *a: fn(*a))
        self._forward = jax.jit(self._forward_impl)

    def _forward_impl(self, params, tokens_bt, valid_bt):
        model = nnx.merge(self.graphdef, params)
        positions = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1]), tokens_bt.shape)
        out = model.hidden_states(tokens_bt, positions, SegmentMask.from_valid(valid_bt))
        return token_logprobs(
            out[0][:, :-1],
            model.unembedding(),
            tokens_bt[:, 1:],
            temperature=self.temperature,
            vocab_chunk_size=_VOCAB_CHUNK,
        )

    def logprobs(
        self,
        params,
        prompt_ids: Sequence[Sequence[int]],
        completion_ids: Sequence[np.ndarray],
    ) -> list[np.ndarray]:
        """log pi of each completion's tokens under `params` (float32, one array per row)."""
        lengths = [len(p) + len(c) for p, c in zip(prompt_ids, completion_ids, strict=True)]
        width = -(-max(lengths) // _LENGTH_STEP) * _LENGTH_STEP
        tokens = np.zeros((len(lengths), width), np.int32)
        valid = np.zeros((len(lengths), width), bool)
        for i, (p, c) in enumerate(zip(prompt_ids, completion_ids, strict=True)):
            tokens[i, : lengths[i]] = np.concatenate([np.asarray(p), np.asarray(c)])
            valid[i, : lengths[i]] = True
        out = np.asarray(self.call_on_mesh(self._forward, params, tokens, valid))
        # Position t of `out` predicts token t + 1: a completion of P prompt tokens starts at P.
        return [
            out[i, len(p) - 1 : len(p) - 1 + len(c)]
            for i, (p, c) in enumerate(zip(prompt_ids, completion_ids, strict=True))
        ]


def mismatch_metrics(
    behaviour: Sequence[np.ndarray], full_precision: Sequence[np.ndarray]
) -> dict[str, float]:
    """The per-token comparison of the module docstring over every sampled token."""
    lb = np.concatenate([np.asarray(x, np.float64) for x in behaviour])
    lp = np.concatenate([np.asarray(x, np.float64) for x in full_precision])
    if lb.size == 0:
        return {}
    log_r = lp - lb  # log pi / mu_q
    return {
        "gen/mismatch_kl": float(np.mean(np.expm1(log_r) - log_r)),
        "gen/mismatch_log_ratio": float(np.mean(-log_r)),
        "gen/mismatch_abs_log_ratio_max": float(np.abs(log_r).max()),
    }


def score_batch(scorer: MismatchScorer, params, generated, uncorrected: bool):
    """`(generated, metrics)`: the mismatch metrics of a `GeneratedBatch` sampled with
    `params`' quantized copy; with `uncorrected`, the batch with pi's log-probs as its behaviour
    log-probs (the negative control)."""
    start = time.perf_counter()
    full = scorer.logprobs(params, generated.prompt_ids, generated.completion_ids)
    metrics = mismatch_metrics(generated.behaviour_logprobs, full)
    metrics["time/mismatch_s"] = time.perf_counter() - start
    if uncorrected:
        generated = dataclasses.replace(generated, behaviour_logprobs=full)
    return generated, metrics

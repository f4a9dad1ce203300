"""The generator executor the RL loop drives.

GeneratorExecutor: samples `samples_per_prompt` completions of each prompt with the weights of
one policy version, on its mesh, and returns host-side rollouts stamped with that version. The
generator is the continuous-batching engine (`EngineSampler`: each prompt one request of
`samples_per_prompt` samples, prefilled once) or, with `generator="static"` and on meshes that
span processes, the static `Sampler`. Its sampling key is a function of (seed, policy version,
batch index) only and the engine's request id is the prompt's index in the batch, so a sample's
noise depends on (seed, version, batch index, prompt index, sample index, token index) only and a
resumed or re-run job draws exactly the same samples.

The reward executor is `jaxrl.loop.reward`; where the sampler is placed, `placement`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import jax
import numpy as np

from jaxrl.generation.mismatch import MISMATCH_MODES, MismatchScorer, score_batch
from jaxrl.generation.sampling import Sampler, SamplingConfig
from jaxrl.tasks.source import PromptItem

_SAMPLING_STREAM = 0x5A3


def sampling_key(seed: int, policy_version: int, batch_index: int) -> jax.Array:
    """The key of one generate call: a pure function of (seed, version, batch index)."""
    key = jax.random.fold_in(jax.random.key(seed), _SAMPLING_STREAM)
    return jax.random.fold_in(jax.random.fold_in(key, policy_version), batch_index)


@dataclasses.dataclass
class GeneratedBatch:
    """Rollouts of one generate call, before scoring."""

    items: list[PromptItem]  # one per row (each prompt repeated samples_per_prompt times)
    prompt_ids: list[list[int]]
    completion_ids: list[np.ndarray]
    behaviour_logprobs: list[np.ndarray]
    group_ids: np.ndarray
    policy_version: int
    batch_index: int
    seconds: float
    # A mixture-of-experts engine's routing records, one per row (`SampleOutput.routing_b`:
    # `[len(prompt) + len(completion), L, k]`); None for a dense model or the static sampler.
    routing: tuple[np.ndarray, ...] | None = None
    # The generator's own figures (an 8-bit engine's `gen/mismatch_*`, `jaxrl.generation.mismatch`).
    metrics: dict = dataclasses.field(default_factory=dict)


class GeneratorExecutor:
    def __init__(
        self,
        sampler: Sampler,
        sampling: SamplingConfig,
        samples_per_prompt: int,
        seed: int,
        mismatch: str = "off",
    ):
        """`mismatch` (`GeneratorConfig.mismatch`, an 8-bit engine only): "off", "measure"
        (each batch's `gen/mismatch_*` metrics: its tokens scored with the full-precision
        weights the engine quantized) or "uncorrected" (also hands the trainer those
        full-precision log-probs as the behaviour log-probs: the negative control)."""
        if sampling.top_k or sampling.top_p < 1.0:
            raise ValueError(
                "RL sampling uses top_k=0 and top_p=1: the trainer's log pi must be computed "
                "under the distribution the behaviour log-probs come from"
            )
        self.sampler, self.sampling = sampler, sampling
        self.samples_per_prompt, self.seed = samples_per_prompt, seed
        self.mismatch, self.scorer = mismatch, None
        if mismatch != "off":
            self.scorer = mismatch_scorer(sampler, sampling, mismatch)

    def generate(
        self,
        params,
        items: Sequence[PromptItem],
        prompt_ids: Sequence[Sequence[int]],
        policy_version: int,
        batch_index: int,
    ) -> GeneratedBatch:
        start = time.perf_counter()
        n = self.samples_per_prompt
        rows = [list(p) for p in prompt_ids for _ in range(n)]
        out = self.sampler.generate(
            params,
            [list(p) for p in prompt_ids],
            self.sampling,
            sampling_key(self.seed, policy_version, batch_index),
            num_samples=n,
        )
        lengths = out.lengths_b
        generated = GeneratedBatch(
            items=[it for it in items for _ in range(n)],
            prompt_ids=rows,
            completion_ids=[out.tokens_bn[i, : lengths[i]] for i in range(len(rows))],
            behaviour_logprobs=[out.logprobs_bn[i, : lengths[i]] for i in range(len(rows))],
            group_ids=np.repeat(np.arange(len(items)) + batch_index * len(items), n),
            policy_version=policy_version,
            batch_index=batch_index,
            seconds=time.perf_counter() - start,
            routing=out.routing_b,
        )
        if self.scorer is None:
            return generated
        full = getattr(self.sampler, "full_params", None)  # a LoRA sampler: base + adapters
        generated, metrics = score_batch(
            self.scorer,
            params if full is None else full(params),
            generated,
            self.mismatch == "uncorrected",
        )
        return dataclasses.replace(generated, metrics=metrics)


def mismatch_scorer(sampler, sampling: SamplingConfig, mismatch: str) -> MismatchScorer:
    """The `MismatchScorer` of an 8-bit engine sampler (`GeneratorExecutor`'s `mismatch`)."""
    if mismatch not in MISMATCH_MODES:
        raise ValueError(f"GeneratorConfig.mismatch={mismatch!r}; expected one of {MISMATCH_MODES}")
    engine = getattr(sampler, "engine", None)
    if engine is None or engine.programs.weights == "native":
        raise ValueError(
            f"GeneratorConfig.mismatch={mismatch!r} compares an 8-bit engine with the weights it "
            "was quantized from; this generator samples the weights as given (weights='native'): "
            "set GeneratorConfig.weights (e.g. 'int8') or mismatch='off'"
        )
    # The caller's graphdef: the params it hands over are laid out for it (the engine's own
    # graphdef may have per-layer weights).
    return MismatchScorer(sampler.graphdef, sampling.temperature, engine.programs.call_on_mesh)

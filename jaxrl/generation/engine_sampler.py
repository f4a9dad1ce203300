"""`Sampler.generate`'s interface served by the continuous-batching `Engine`.

Every caller of the static sampler (the RL generator, evaluation, SFT evals, `launch.generate`)
hands over a batch of prompts and gets a `SampleOutput` back. `EngineSampler.generate` turns the
batch into engine requests, one per prompt with its `num_samples` samples as a group (one
prefill per prompt), runs them to completion and lays the groups out as the static sampler
does: row `i * num_samples + g` is sample g of prompt i.

Noise: prompt i of a call is request i, so sample g of prompt i draws its token t with
`fold_in(fold_in(fold_in(key, i), g), t)` (see `jaxrl.generation.engine`): a function of the
caller's key (the RL generator's: seed, policy version, batch index), the prompt's index in the
batch, the sample and the token index only, never of the slots or of the other prompts' lengths.
A call starts with every slot free, so the same call schedules the same device calls: a re-run
or a resumed run reproduces the tokens and log-probs bit for bit.

What still uses the static `Sampler`: generator meshes that span several processes (the engine's
host scheduler reads its per-slot state on one host; `make_sampler` falls back and says so), and
`GeneratorConfig.kind = 'static'` on request. Shapes: B prompts, G samples, N max_new_tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx

from jaxrl.generation.engine import Engine, Request
from jaxrl.generation.sampler import (
    DEFAULT_PROMPT_BUCKETS,
    SampleOutput,
    Sampler,
    checked_prompts,
    spans_processes,
)
from jaxrl.generation.sampling import SamplingConfig
from jaxrl.infra import sharding as ax
from jaxrl.models.config import ModelConfig
from jaxrl.models.transformer import Transformer

GENERATORS = ("engine", "static")


class EngineSampler:
    """A `Sampler` look-alike (same `generate`, `prompt_buckets`, `max_total_len`, `eos_ids`,
    `num_traces`) that decodes with one `Engine` of `num_slots` slots, kept across calls.

    Args: as for `Sampler`, plus the engine's `num_slots` (rounded up to a multiple of the
    data-parallel size) and `steps_per_call`; `precompile`: compile every program the engine
    can call for a sampling config before its first use of it (`warm_up`, `Engine.precompile`)
    instead of one by one mid-run; `weights`: the engine's weight format
    (`GeneratorConfig.weights`, `jaxrl.generation.quantize`). A call's prompts may outnumber
    the slots (they queue), but its `num_samples` may not. `max_total_len` None (the
    default): prompts up to the model's context are accepted and the KV cache is sized from
    the calls (the longest prompt + max_new_tokens so far, see `Engine.reserve`), so a
    long-context model with the default 256 slots allocates what its requests need, not
    `256 x max_position_embeddings` positions.
    """

    def __init__(
        self,
        graphdef: nnx.GraphDef,
        model_config: ModelConfig,
        *,
        pad_id: int,
        eos_ids: Sequence[int] = (),
        max_total_len: int | None = None,
        prompt_buckets: Sequence[int] = DEFAULT_PROMPT_BUCKETS,
        num_slots: int = 256,
        steps_per_call: int = 8,
        mesh: jax.sharding.Mesh | None = None,
        rules: ax.LogicalRules | None = None,
        precompile: bool = False,
        weights: str = "native",
        extend_min_rows: int = 8,
        extend_buckets: Sequence[int] | None = None,
        keep_calls: int = 0,
        exit_stops: int = 0,
        span_buckets: Sequence[int] | None = None,
    ):
        self.graphdef, self.model_config = graphdef, model_config
        self.precompile = precompile
        self._warm: set[tuple] = set()
        self.pad_id, self.eos_ids = int(pad_id), tuple(int(i) for i in eos_ids)
        # The longest prompt + completion a call may ask for; with None the engine's cache is
        # sized from the calls (`Engine.reserve`), not this.
        self.max_total_len = max_total_len or model_config.max_position_embeddings
        # Kept whole: the RL controller pads train batches to these buckets.
        self.prompt_buckets = tuple(sorted(prompt_buckets))
        self.mesh, self.rules = mesh, rules
        dp = 1
        if mesh is not None and rules is not None:
            batch_axes = dict(rules)[ax.ACT_BATCH]
            names = (batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes or ())
            dp = int(np.prod([mesh.shape[a] for a in names]))
        self.engine = Engine(
            graphdef,
            model_config,
            num_slots=-(-int(num_slots) // dp) * dp,
            steps_per_call=steps_per_call,
            pad_id=pad_id,
            eos_ids=eos_ids,
            max_total_len=max_total_len,
            prompt_buckets=prompt_buckets,
            mesh=mesh,
            rules=rules,
            weights=weights,
            extend_min_rows=extend_min_rows,
            extend_buckets=extend_buckets,
            keep_calls=keep_calls,
            exit_stops=exit_stops,
            span_buckets=span_buckets,
        )

    @classmethod
    def for_model(cls, model: Transformer, **kwargs) -> tuple[EngineSampler, nnx.State]:
        graphdef, params = nnx.split(model)
        c = model.config
        kwargs.setdefault("pad_id", c.pad_token_id if c.pad_token_id is not None else 0)
        kwargs.setdefault("eos_ids", c.eos_token_ids)
        return cls(graphdef, c, **kwargs), params

    def warm_up(
        self, params, sampling: SamplingConfig, num_samples: int, *, recompute: bool = False
    ) -> None:
        """With `precompile`, compiles the engine's programs for requests of `sampling` with
        `num_samples` samples (`recompute`: and kv_on_update="recompute"'s re-prefills), once
        per such kind and cache length; prompts are bounded by the cache's length (an engine
        sized from its requests is first grown for the queued ones) less max_new_tokens. Else
        nothing."""
        self.engine.reserve()
        kind = (self.engine._static_sampling(sampling), num_samples, recompute)
        kind += (self.engine.capacity,)
        if not self.precompile or kind in self._warm:
            return
        self._warm.add(kind)
        self.engine.precompile(
            params,
            sampling,
            samples_per_request=num_samples,
            max_prompt_len=self.engine.capacity - sampling.max_new_tokens,
            recompute=recompute,
            progress=lambda line: print(line, flush=True) if jax.process_index() == 0 else None,
        )

    @property
    def num_traces(self) -> int:
        return self.engine.stats.num_traces

    @property
    def stats(self):
        return self.engine.stats

    def generate(
        self,
        params: nnx.State,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        key: jax.Array,
        *,
        truncate: bool = False,
        num_samples: int = 1,
    ) -> SampleOutput:
        """Completes each prompt `num_samples` times: rows `[B * G, N]`, prompt-major."""
        # Checked before anything is queued, with the static sampler's messages.
        prompts = checked_prompts(prompts, sampling, self.max_total_len, truncate)
        if not 1 <= num_samples <= self.engine.num_slots:
            raise ValueError(
                f"num_samples={num_samples} but the engine has {self.engine.num_slots} decode "
                "slots; a group's samples decode side by side, so raise the slot count "
                "(GeneratorConfig.slots) to at least the samples per prompt"
            )
        self.engine.reserve(max(len(p) for p in prompts) + sampling.max_new_tokens)
        self.warm_up(params, sampling, num_samples)
        requests = [
            Request(i, tuple(int(t) for t in p), num_samples, sampling)
            for i, p in enumerate(prompts)
        ]
        try:
            groups = self.engine.generate(params, requests, key)
        finally:
            self.engine.reset()  # an interrupted call leaves nothing queued for the next one
        return SampleOutput(
            tokens_bn=np.concatenate([g.tokens_gn for g in groups]),
            logprobs_bn=np.concatenate([g.logprobs_gn for g in groups]),
            mask_bn=np.concatenate([g.mask_gn for g in groups]),
            routing_b=(
                None
                if groups[0].routing_g is None
                else tuple(r for g in groups for r in g.routing_g)
            ),
        )


def make_sampler(
    kind: str,
    graphdef: nnx.GraphDef,
    model_config: ModelConfig,
    *,
    num_slots: int = 256,
    steps_per_call: int = 8,
    cls_static: type = Sampler,
    cls_engine: type = EngineSampler,
    **kwargs,
):
    """The generator `kind` ("engine" or "static") with the `Sampler` arguments `kwargs`. The
    engine falls back to the static sampler on a mesh spanning several processes."""
    if kind not in GENERATORS:
        raise ValueError(f"generator {kind!r}; expected one of {GENERATORS}")
    if kind == "engine" and spans_processes(kwargs.get("mesh")):
        if jax.process_index() == 0:
            print(
                "[generation] the engine runs on single-process meshes; this mesh spans "
                "processes: using the static sampler",
                flush=True,
            )
        kind = "static"
    precompile = kwargs.pop("precompile", False)
    engine_only = ("extend_min_rows", "extend_buckets", "keep_calls", "exit_stops", "span_buckets")
    engine_args = {k: kwargs.pop(k) for k in engine_only if k in kwargs}
    if kind == "static" and kwargs.get("weights", "native") != "native":
        raise ValueError(
            f"generator weights {kwargs['weights']!r} need the engine (single-process generator "
            "mesh); the static sampler runs the weights as given: use weights='native'"
        )
    if kind == "static":
        return cls_static(graphdef, model_config, **kwargs)
    return cls_engine(
        graphdef, model_config, num_slots=num_slots, steps_per_call=steps_per_call,
        precompile=precompile, **engine_args, **kwargs,
    )  # fmt: skip

"""Where a run's sampler lives: on the trainer's mesh (colocated) or on the generator's own.

`mesh_sampler` builds the engine or the static sampler for the trainer's model on a mesh with
that role's rules table; `colocated_sampler` on the trainer's; `generator_param_shardings` gives
the params' layout on the generator mesh (the target of a weight push). A LoRA policy's sampler
(`AdapterEngineSampler`, `AdapterSampler`) holds the frozen base once and takes the adapters as
each call's params.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
from flax import nnx

from jaxrl.generation.engine_sampler import GENERATORS, EngineSampler, make_sampler
from jaxrl.generation.mismatch import MISMATCH_MODES
from jaxrl.generation.quantize import WEIGHT_FORMATS
from jaxrl.generation.quantized_lora import QuantizedBase, attach
from jaxrl.generation.sampler import Sampler as StaticSampler
from jaxrl.generation.sampling import Sampler
from jaxrl.infra.sharding import param_shardings
from jaxrl.models.transformer import Transformer
from jaxrl.train import lora as lora_lib

GENERATOR_DTYPES = ("auto", "float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class GeneratorConfig:
    """The RL generator: which sampler, its engine's size, and its copy of the weights
    (`rl_main.generator_config = @GeneratorConfig()`).

    kind: "engine" (the continuous-batching engine, `jaxrl.generation.engine`: each prompt's G
      samples share one prefill, finished rows free their slots at once) or "static" (the
      left-padded `Sampler`); meshes spanning several processes always use the static one.
    dtype (async mode): the generator's copy of the weights, cast on the trainer during each
      push: "bfloat16", "float32", or "auto" (bfloat16 on GPU / TPU, where decoding is bound by
      reading the weights; the trainer's parameter dtype on CPU, where bf16 matmuls are slower
      and the fp32 log-ratio checks hold exactly). AIPO's per-token ratio corrects for the bf16
      sampler like any lag.
    slots: the engine's decode slots (0: the schedule's own, `feeds.*.engine_slots`: the rows
      of one generate call, num_prompts x oversample x samples_per_prompt; streaming:
      num_prompts x samples_per_prompt, one step's groups in flight).
    steps_per_call: decode steps per device call (capped at max_new_tokens).
    extend_min_rows, extend_widths (multi-turn episodes continued in their slots): the fewest
      rows, and the padded widths (() : 8, 16, 32, ...), of the tool replies a decode call runs
      through the model (`Engine.extend_min_rows` / `extend_buckets`); on a model whose forward
      costs what its tokens cost (135M on CPU), e.g. 1 and (8, 16, 24, 32, 40, 48, 64) pay for
      the replies' tokens, not 8 rows of a power-of-two width, at the price of more decode
      programs to compile (docs/multiturn_chat.md).
    keep_calls (multi-turn): decode calls a row waiting for its tool reply keeps its slot (and
      KV cache) against queued episodes short of slots (`Engine.keep_calls`; 0: it gives way at
      once, and its next turn is prefilled again in full when the reply comes).
    exit_stops (multi-turn): a decode call ends once this many of its rows have stopped, so a
      row whose turn ended mid-call starts its next turn (or frees its slot) sooner, for more,
      shorter calls (`Engine.exit_stops`; 0: every call runs `steps_per_call` steps).
    span_buckets: the attended prefixes a decode call is padded to (`Engine.span_buckets`; () :
      powers of two from 32 and the cache's length). Finer steps above the prompts' length
      (e.g. 192, 224, 256, 288 for 171-token prompts) spare a call whose longest row just
      passed a power of two from attending to the next one in every row, at one decode
      program per bucket (docs/multiturn_chat.md).
    max_len: the engine's cache length, the longest prompt + max_new_tokens it takes (0: sized
      from the prompts it gets, the next power of two above the longest prompt +
      max_new_tokens, growing up to the model's context). The engine holds one cache of slots x
      that length x layers x 2 x kv_heads x head_dim values (e.g. 256 slots x 4096 on Llama 3
      8B in bf16: 128 GiB); one that cannot fit in free memory is refused before it is
      allocated.
    precompile: the generator's engine compiles every program it can call (each decode span x
      active-slot bucket, prefill batch x prompt-length bucket, slot move) before its first
      batch, instead of one at a time when a new shape first comes up: a streaming run
      otherwise stalls its generator, and then its trainer, for each compile during its first
      hundred or so steps (cost: docs/benchmarks.md, "Engine precompile").
    weights: the engine's copy of the weights (`jaxrl.generation.quantize`): "native" (as
      given), or 8-bit with per-output-channel scales, made on the generator's devices once per
      weights object (sync: once per step; async: once per pushed version): "int8_weights"
      (weight-only), "int8_dynamic" (activations per token too), "int8" (the platform's choice:
      dynamic on CPU, weight-only on GPU / TPU), "fp8" (weight-only float8_e4m3fn, GPU / CPU;
      refused on TPU: use "int8"), "int4_weights" / "int5_weights" / "int6_weights" (N-bit
      levels in int8 bytes: a larger mismatch for experiments on the correction, not for
      speed). Engine only; a LoRA policy's base is quantized once and its adapters applied
      unquantized (`jaxrl.generation.quantized_lora`). The behaviour log-probs are the
      quantized policy's (docs/quantization.md).
    mismatch (8-bit weights): "auto" (the default: "measure" with 8-bit weights, else "off"),
      "off", "measure" (each batch's tokens scored with the full-precision weights the engine
      quantized, on the generator's devices: `gen/mismatch_kl` etc., `jaxrl.generation.mismatch`)
      or "uncorrected" (a negative control: the trainer gets those full-precision log-probs as
      the behaviour log-probs, so its importance weights correct the lag but not the
      quantization; whole-batch schedules only). With "off" in a one-process async run the push
      itself quantizes, on the trainer's devices, and moves the 8-bit kernels
      (`jaxrl.sync.quantized`: a quarter of an fp32 push's bytes); measuring needs the
      full-precision weights on the generator, so the push stays full precision otherwise.
    """

    kind: str = "engine"
    dtype: str = "auto"
    slots: int = 0
    steps_per_call: int = 8
    extend_min_rows: int = 8
    extend_widths: tuple[int, ...] = ()
    keep_calls: int = 0
    exit_stops: int = 0
    span_buckets: tuple[int, ...] = ()
    max_len: int = 0
    precompile: bool = False
    weights: str = "native"
    mismatch: str = "auto"

    def validate(self) -> None:
        if self.kind not in GENERATORS:
            raise ValueError(f"GeneratorConfig.kind={self.kind!r}; expected one of {GENERATORS}")
        if self.dtype not in GENERATOR_DTYPES:
            raise ValueError(
                f"GeneratorConfig.dtype={self.dtype!r}; expected one of {GENERATOR_DTYPES}"
            )
        if self.weights not in WEIGHT_FORMATS:
            raise ValueError(
                f"GeneratorConfig.weights={self.weights!r}; expected one of {WEIGHT_FORMATS}"
            )
        if self.weights != "native" and self.kind != "engine":
            raise ValueError(
                f"GeneratorConfig.weights={self.weights!r} needs kind='engine' (the static "
                "sampler has no quantized path); use kind='engine' or weights='native'"
            )
        if self.mismatch not in ("auto", *MISMATCH_MODES):
            raise ValueError(
                f"GeneratorConfig.mismatch={self.mismatch!r}; expected one of "
                f"{('auto', *MISMATCH_MODES)}"
            )
        if self.mismatch in ("measure", "uncorrected") and self.weights == "native":
            raise ValueError(
                f"GeneratorConfig.mismatch={self.mismatch!r} compares an 8-bit generator with "
                "the weights it was quantized from; weights='native' has no mismatch: set "
                "GeneratorConfig.weights (e.g. 'int8') or mismatch='auto'"
            )
        if self.keep_calls < 0:
            raise ValueError(
                f"GeneratorConfig.keep_calls={self.keep_calls}; need >= 0 (0: a kept row gives "
                "way at once)"
            )
        if self.exit_stops < 0:
            raise ValueError(
                f"GeneratorConfig.exit_stops={self.exit_stops}; need >= 0 (0: every decode call "
                "runs steps_per_call steps)"
            )
        if self.extend_min_rows < 1 or any(int(w) < 1 for w in self.extend_widths):
            raise ValueError(
                f"GeneratorConfig.extend_min_rows={self.extend_min_rows}, extend_widths="
                f"{self.extend_widths}: need a row floor >= 1 and widths >= 1 (() : the default)"
            )
        if any(int(b) < 1 for b in self.span_buckets):
            raise ValueError(
                f"GeneratorConfig.span_buckets={self.span_buckets}: need positions >= 1 (() : "
                "powers of two)"
            )
        if self.slots < 0 or self.steps_per_call < 1 or self.max_len < 0:
            raise ValueError(
                f"GeneratorConfig.slots={self.slots}, steps_per_call={self.steps_per_call}, "
                f"max_len={self.max_len}: need slots >= 0 (0: automatic), steps_per_call >= 1, "
                "max_len >= 0 (0: sized from the requests)"
            )

    def resolve_dtype(self, generator_mesh) -> str | None:
        """The dtype a weight push casts to (None: the trainer's own)."""
        if self.dtype != "auto":
            return self.dtype
        platform = generator_mesh.devices.flat[0].platform
        return None if platform == "cpu" else "bfloat16"


# Prompt lengths a run's sampler pads to (one compiled program per bucket in use).
RL_PROMPT_BUCKETS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048)


class _Adapters:
    """A sampler of a LoRA policy that holds the frozen base once (`base_params`, on its mesh)
    and takes the adapters as the params of each `generate` call: applied unmerged, so a weight
    push moves the adapters only and the base is never rewritten or copied."""

    base_params: dict | None = None

    def full_params(self, params):
        """The full-precision policy of adapters `params`: the base with them added, for the
        caller's (LoRA) `graphdef` (e.g. to score an 8-bit engine's samples against)."""
        if self.base_params is None:
            raise ValueError(
                f"{type(self).__name__}.base_params is unset: place the frozen base first"
            )
        return lora_lib.combine(self.base_params, params)

    def sampled_params(self, params):
        """The tree the sampler runs for adapters `params`."""
        return self.full_params(params)

    def generate(self, params, *args, **kwargs):
        return super().generate(self.sampled_params(params), *args, **kwargs)


class AdapterSampler(_Adapters, StaticSampler):
    """The static sampler of a LoRA policy (see `_Adapters`)."""


class AdapterEngineSampler(_Adapters, EngineSampler):
    """The engine of a LoRA policy (see `_Adapters`).

    With 8-bit `weights` (`GeneratorConfig.weights`, `jaxrl.generation.quantized_lora`) the
    engine runs the plain `Transformer` on the base quantized once, on the first call after
    `base_params` is set (`quantized_base`, one copy shared by every call and pushed version),
    with each call's adapters attached unquantized; `lora` (the policy's `LoraConfig`) gives
    their scale. `graphdef` stays the caller's LoRA model (`full_params`' layout)."""

    def __init__(self, graphdef, model_config, *, weights: str = "native", lora=None, **kwargs):
        self.quantized_base, self.lora = None, lora
        if weights == "native":
            super().__init__(graphdef, model_config, weights=weights, **kwargs)
            return
        if lora is None:
            raise ValueError(
                f"AdapterEngineSampler with weights={weights!r} needs the policy's LoraConfig "
                "(lora=...): the adapters' scale alpha / r"
            )
        # Checked (format, platform, contraction) before the engine is built.
        mesh, rules = kwargs.get("mesh"), kwargs.get("rules")
        self.quantized_base = QuantizedBase(model_config, mesh, weights, rules)
        # The engine takes the tree as it is: its kernels are quantized already.
        super().__init__(self.quantized_base.graphdef, model_config, weights=weights, **kwargs)
        self.graphdef = graphdef

    def sampled_params(self, params):
        if self.quantized_base is None:
            return super().sampled_params(params)
        if self.base_params is None:
            raise ValueError(
                f"{type(self).__name__}.base_params is unset: place the frozen base first"
            )
        base = self.quantized_base(self.base_params, self.engine.programs.call_on_mesh)
        return attach(base, params, self.lora.scale)


def mesh_sampler(
    trainer,
    tokenizer,
    mesh: jax.sharding.Mesh,
    rules,
    max_total_len: int | None = None,
    prompt_buckets: Sequence[int] = RL_PROMPT_BUCKETS,
    base_dtype: str | None = None,
    generator: str = "engine",
    num_slots: int = 256,
    steps_per_call: int = 8,
    precompile: bool = False,
    weights: str = "native",
    extend_min_rows: int = 8,
    extend_widths: Sequence[int] = (),
    keep_calls: int = 0,
    exit_stops: int = 0,
    span_buckets: Sequence[int] = (),
) -> Sampler:
    """A sampler for the trainer's model on `mesh` with that role's rules table: the trainer's
    own (colocated, `colocated_sampler`) or the generator's devices in async mode.
    `prompt_buckets`: the padded prompt lengths (one compile each; train batches are padded to
    the same bucket). `generator`: "engine" (`EngineSampler` with `num_slots` decode slots and
    `steps_per_call` decode steps per device call, `precompile` its programs ahead of their
    first use, `weights` its weight format: `GeneratorConfig.weights`, `extend_min_rows` /
    `extend_widths` its extension buckets, `keep_calls`, `exit_stops` and `span_buckets`:
    `GeneratorConfig`'s)
    or "static" (`jaxrl.generation.sampler.Sampler`); see `make_sampler`.

    A LoRA trainer gets an `AdapterEngineSampler` / `AdapterSampler` holding the trainer's base
    (set before this call) placed on `mesh` (and cast to `base_dtype`): one copy, shared by every
    pushed version."""
    lora = trainer.lora is not None
    quantized = {"weights": weights} if weights != "native" else {}
    if lora and quantized:  # the base quantized once, the adapters unquantized
        quantized["lora"] = trainer.lora
    sampler = make_sampler(
        generator,
        trainer.graphdef,
        trainer.model_config,
        num_slots=num_slots,
        steps_per_call=steps_per_call,
        precompile=precompile,
        extend_min_rows=extend_min_rows,
        extend_buckets=tuple(extend_widths) or None,
        keep_calls=keep_calls,
        exit_stops=exit_stops,
        span_buckets=tuple(span_buckets) or None,
        **quantized,
        cls_static=AdapterSampler if lora else StaticSampler,
        cls_engine=AdapterEngineSampler if lora else EngineSampler,
        pad_id=tokenizer.pad_token_id,
        eos_ids=trainer.model_config.eos_token_ids,
        max_total_len=max_total_len,
        prompt_buckets=prompt_buckets,
        mesh=mesh,
        rules=rules,
    )
    if trainer.lora is not None:
        if trainer.base_params is None:
            raise ValueError("a LoRA trainer's sampler needs its base: call trainer.init first")
        base = trainer.base_params
        if base_dtype is not None:
            base = jax.tree.map(lambda x: x.astype(base_dtype), base)
        if mesh is trainer.mesh and rules is trainer.rules:
            sampler.base_params = base
        else:
            shardings = generator_param_shardings(trainer, mesh, rules, base=True)
            sampler.base_params = jax.device_put(base, shardings)
    return sampler


def colocated_sampler(
    trainer,
    tokenizer,
    max_total_len: int | None = None,
    prompt_buckets: Sequence[int] = RL_PROMPT_BUCKETS,
    **generator,
) -> Sampler:
    """A sampler on the trainer's own mesh and rules (colocated generation: sync mode, evals):
    `sampler.generate(state.params, prompt_ids, SamplingConfig(...), key)` samples from the
    trainer's current params with no copy. `generator`: `mesh_sampler`'s generator, num_slots,
    steps_per_call, precompile."""
    return mesh_sampler(
        trainer, tokenizer, trainer.mesh, trainer.rules, max_total_len, prompt_buckets,
        **generator,
    )  # fmt: skip


def generator_param_shardings(trainer, mesh: jax.sharding.Mesh, rules, base: bool = False):
    """The params' shardings on the generator mesh (same pure-dict tree as the trainer's): the
    trained params (LoRA: the adapters; LoRA-FA: the B's), or with `base` the full model's
    (LoRA-FA: with the frozen A's)."""
    frozen = {}
    if trainer.lora is not None:
        _, abstract = lora_lib.abstract_lora(trainer.model_config, trainer.lora)
        adapters = nnx.to_pure_dict(param_shardings(abstract, mesh, rules))
        if not base:
            return lora_lib.trained_part(adapters, trainer.lora)
        frozen = lora_lib.frozen_part(adapters, trainer.lora)  # LoRA-FA: the A's ride with it
    model = nnx.eval_shape(lambda: Transformer(trainer.model_config, rngs=nnx.Rngs(0)))
    full = nnx.to_pure_dict(param_shardings(nnx.state(model), mesh, rules))
    return lora_lib.combine(full, frozen)

"""KV-cache sampler: left-padded prompts, one jitted prefill, a jitted decode loop.

One call generates a batch:

1. Prompts are left-padded into a `[B_bucket, P_bucket]` array (both sizes rounded up to a bucket,
   so a run compiles at most one program per (batch bucket, prompt bucket) pair).
2. Prefill runs the whole prompt through the model, writing keys/values into a preallocated
   cache of length `P_bucket + max_new_tokens`, and samples the first new token from the last
   prompt position.
3. A `lax.while_loop` feeds one token per step at cache slot `P_bucket + i` until every row has
   stopped or `max_new_tokens` are out.

Positions skip left padding (row b's first real token has position 0), as in training, so a
teacher-forced forward pass of the same tokens reproduces the behaviour log-probs.

On a mesh the sampler traces under the role's rules table: weights as the generator rules say
(e.g. TP over heads / vocab), the batch and cache split over the data-parallel axis.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.core import spmd as flax_spmd
from jax.sharding import PartitionSpec

from jaxrl.generation.sampling import SamplingConfig, sample_tokens
from jaxrl.infra import sharding as ax
from jaxrl.models.config import ModelConfig
from jaxrl.models.transformer import Transformer, constrain_cache, init_cache

DEFAULT_PROMPT_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


@dataclasses.dataclass(frozen=True)
class SampleOutput:
    """Completions of one `generate` call (host NumPy arrays, padding rows removed).

    tokens_bn: sampled ids, `pad_id` after a row's stop token.
    logprobs_bn: float32 log-prob of each sampled token under the distribution it was drawn from
      (0 where masked).
    mask_bn: True for completion tokens (up to and including the stop token).
    lengths_b: number of completion tokens per row.
    routing_b: a mixture-of-experts model's routing record (the continuous-batching engine's;
      `jaxrl.models.moe`), per row an int16 `[len(prompt) + lengths_b[b], num_layers, top_k]`:
      the experts each layer chose for each position of the sequence as the generator ran it,
      -1 where nothing was recorded (the last sampled token, never run through the model; dense
      layers). None for a dense model or a sampler that does not record.
    """

    tokens_bn: np.ndarray
    logprobs_bn: np.ndarray
    mask_bn: np.ndarray
    routing_b: tuple[np.ndarray, ...] | None = None

    @property
    def lengths_b(self) -> np.ndarray:
        return self.mask_bn.sum(axis=-1)


def _bucket(n: int, buckets: Sequence[int], what: str) -> int:
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{what} {n} exceeds the largest bucket {buckets[-1]}; add a bucket")
    return buckets[i]


def checked_prompts(
    prompts: Sequence[Sequence[int]], sampling: SamplingConfig, limit: int, truncate: bool
) -> Sequence[Sequence[int]]:
    """`prompts` cut to their last `limit - max_new_tokens` tokens when `truncate`, then checked
    (none empty, each fitting the context of `limit` tokens with its budget) with messages that
    name the fix; every sampler's `generate` runs this before any work."""
    if truncate:
        keep = limit - sampling.max_new_tokens
        if keep < 1:
            raise ValueError(f"max_new_tokens={sampling.max_new_tokens} leaves no room")
        prompts = [list(p)[-keep:] for p in prompts]
    if not prompts:
        raise ValueError("no prompts to generate from")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty (0 tokens): there is nothing to condition on")
        if len(p) + sampling.max_new_tokens > limit:
            raise ValueError(
                f"prompt {i} has {len(p)} tokens; with max_new_tokens="
                f"{sampling.max_new_tokens} that exceeds the context of {limit} tokens. "
                "Shorten the prompt, lower max_new_tokens, or truncate (truncate=True keeps "
                "the prompt's last tokens)."
            )
    return prompts


def spans_processes(mesh: jax.sharding.Mesh | None) -> bool:
    """Whether `mesh` has devices of more than one JAX process."""
    return mesh is not None and len({d.process_index for d in mesh.devices.flat}) > 1


class Sampler:
    """Samples from a `Transformer` whose parameters are passed per call (weights change every
    policy version; the compiled programs do not).

    Args:
      graphdef: the model's `nnx.GraphDef` (from `nnx.split(model)`).
      model_config: the model's `ModelConfig`.
      pad_id: token used for padding prompts and masked completion positions.
      eos_ids: tokens that end a row, unless `SamplingConfig.ignore_eos`.
      max_total_len: longest prompt + completion the model may see (default: the model's
        `max_position_embeddings`).
      prompt_buckets / batch_buckets: allowed padded sizes. Batch buckets default to powers of
        two (times the data-parallel size on a mesh).
      mesh, rules: the generation mesh and its logical-axis rules table; None for one device.
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
        batch_buckets: Sequence[int] | None = None,
        mesh: jax.sharding.Mesh | None = None,
        rules: ax.LogicalRules | None = None,
    ):
        if (mesh is None) != (rules is None):
            raise ValueError("pass both mesh and rules, or neither")
        self.graphdef = graphdef
        self.model_config = model_config
        self.pad_id = int(pad_id)
        self.eos_ids = tuple(int(i) for i in eos_ids)
        self.max_total_len = max_total_len or model_config.max_position_embeddings
        self.prompt_buckets = tuple(sorted(prompt_buckets))
        self.mesh, self.rules = mesh, rules
        data_parallel = 1
        if mesh is not None:
            batch_axes = dict(rules)[ax.ACT_BATCH]
            names = (batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes or ())
            data_parallel = int(np.prod([mesh.shape[a] for a in names]))
        self.batch_buckets = tuple(
            sorted(batch_buckets or [data_parallel * 2**i for i in range(16)])
        )
        if any(b % data_parallel for b in self.batch_buckets):
            raise ValueError(
                f"batch buckets {self.batch_buckets} must be multiples of the data-parallel size "
                f"{data_parallel}"
            )
        self.num_traces = 0  # programs traced so far (one per bucket pair and sampling config)
        # A mesh over several processes: outputs replicated (an all-gather over this mesh's own
        # devices), so that every process can read the tokens on its host and score them.
        self.multi_process = spans_processes(mesh)
        out_shardings = (
            jax.sharding.NamedSharding(mesh, PartitionSpec()) if self.multi_process else None
        )
        self._generate = jax.jit(
            self._generate_impl, static_argnames=("sampling",), out_shardings=out_shardings
        )

    # --- host side ----------------------------------------------------------------------------

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
        """Completes each prompt (a list of token ids) `num_samples` times (rows prompt-major:
        row `i * num_samples + g`); `key` seeds all the sampling noise."""
        if num_samples > 1:
            prompts = [p for p in prompts for _ in range(num_samples)]
        prompts = checked_prompts(prompts, sampling, self.max_total_len, truncate)
        n = len(prompts)
        batch = _bucket(n, self.batch_buckets, "batch size")
        prompt_len = _bucket(max(len(p) for p in prompts), self.prompt_buckets, "prompt length")
        tokens = np.full((batch, prompt_len), self.pad_id, np.int32)
        valid = np.zeros((batch, prompt_len), bool)
        for row, p in enumerate(prompts):
            tokens[row, prompt_len - len(p) :] = p
            valid[row, prompt_len - len(p) :] = True
        # Padding rows get one token so their softmax rows are well defined; they are dropped.
        valid[n:, -1] = True
        if not sampling.ignore_eos:
            stops = tuple(sorted(set(sampling.stop_ids) | set(self.eos_ids)))
            sampling = dataclasses.replace(sampling, stop_ids=stops)
        tokens_j, valid_j = self._place(tokens), self._place(valid)
        if self.multi_process:  # host key data, placed on each process's own devices
            key = np.asarray(jax.random.key_data(key))
        out_tokens, out_logprobs, out_mask = self._run(params, tokens_j, valid_j, key, sampling)
        return SampleOutput(
            tokens_bn=np.asarray(out_tokens)[:n],
            logprobs_bn=np.asarray(out_logprobs)[:n],
            mask_bn=np.asarray(out_mask)[:n],
        )

    @classmethod
    def for_model(cls, model: Transformer, **kwargs) -> tuple[Sampler, nnx.State]:
        """A sampler for `model` and the params to pass to `generate`. Pad and EOS ids default to
        the model config's."""
        graphdef, params = nnx.split(model)
        c = model.config
        kwargs.setdefault("pad_id", c.pad_token_id if c.pad_token_id is not None else 0)
        kwargs.setdefault("eos_ids", c.eos_token_ids)
        return cls(graphdef, c, **kwargs), params

    def _place(self, array: np.ndarray) -> jax.Array:
        if self.mesh is None:
            return jnp.asarray(array)
        spec = ax.logical_to_pspec((ax.ACT_BATCH, None), self.rules)
        return ax.place_host(array, jax.sharding.NamedSharding(self.mesh, spec))

    def _run(self, params, tokens, valid, key, sampling):
        if self.mesh is None:
            return self._generate(params, tokens, valid, key, sampling=sampling)
        with jax.set_mesh(self.mesh), flax_spmd.logical_axis_rules(self.rules):
            return self._generate(params, tokens, valid, key, sampling=sampling)

    # --- device side --------------------------------------------------------------------------

    def _generate_impl(self, params, tokens_bp, valid_bp, key, *, sampling: SamplingConfig):
        self.num_traces += 1
        if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):  # raw key data (multi-process)
            key = jax.random.wrap_key_data(key)
        model: Transformer = nnx.merge(self.graphdef, params)
        param_leaves, params_def = jax.tree.flatten(params)
        batch, prompt_len = tokens_bp.shape
        new = sampling.max_new_tokens
        total = prompt_len + new
        cache = constrain_cache(init_cache(model.config, batch, total))
        # valid_bs[b, s]: cache slot s holds a real token of row b (prompt or generated).
        valid_bs = jnp.concatenate([valid_bp, jnp.ones((batch, new), bool)], axis=1)
        prompt_lens_b = valid_bp.sum(axis=-1).astype(jnp.int32)
        stop_ids = jnp.asarray(sampling.stop_ids or (-1,), jnp.int32)

        # Prefill: every prompt position; sample from the last one.
        positions_bp = jnp.maximum(jnp.cumsum(valid_bp.astype(jnp.int32), axis=-1) - 1, 0)
        causal_ps = jnp.arange(prompt_len)[:, None] >= jnp.arange(total)[None, :]
        mask_bps = causal_ps[None] & valid_bs[:, None, :]
        hidden, cache = model.hidden_states(tokens_bp, positions_bp, mask_bps, cache, 0)
        logits_bv = model.logits(hidden[:, -1:])[:, 0]
        token_b, logprob_b = sample_tokens(logits_bv, sampling, jax.random.fold_in(key, 0))

        out_tokens = jnp.full((batch, new), self.pad_id, jnp.int32).at[:, 0].set(token_b)
        out_logprobs = jnp.zeros((batch, new), jnp.float32).at[:, 0].set(logprob_b)
        out_mask = jnp.zeros((batch, new), bool).at[:, 0].set(True)
        done_b = jnp.isin(token_b, stop_ids)

        def cond(carry):
            i, *_, done_b = carry
            return (i < new) & ~jnp.all(done_b)

        def body(carry):
            i, cache, token_b, out_tokens, out_logprobs, out_mask, done_b = carry
            slot = prompt_len + i - 1  # where the previous token goes
            positions_b1 = (prompt_lens_b + i - 1)[:, None]
            mask_b1s = ((jnp.arange(total) <= slot)[None, :] & valid_bs)[:, None, :]
            # A module made at this trace level from the params' arrays: NNX transforms (the
            # scanned layers) refuse Variables captured from the enclosing trace.
            step_model: Transformer = nnx.merge(
                self.graphdef, jax.tree.unflatten(params_def, param_leaves)
            )
            hidden, cache = step_model.hidden_states(
                token_b[:, None], positions_b1, mask_b1s, cache, slot
            )
            logits_bv = step_model.logits(hidden)[:, 0]
            token_b, logprob_b = sample_tokens(logits_bv, sampling, jax.random.fold_in(key, i))
            live_b = ~done_b
            token_b = jnp.where(live_b, token_b, self.pad_id)
            out_tokens = jax.lax.dynamic_update_slice(out_tokens, token_b[:, None], (0, i))
            out_logprobs = jax.lax.dynamic_update_slice(
                out_logprobs, jnp.where(live_b, logprob_b, 0.0)[:, None], (0, i)
            )
            out_mask = jax.lax.dynamic_update_slice(out_mask, live_b[:, None], (0, i))
            done_b = done_b | (live_b & jnp.isin(token_b, stop_ids))
            return i + 1, cache, token_b, out_tokens, out_logprobs, out_mask, done_b

        carry = (jnp.int32(1), cache, token_b, out_tokens, out_logprobs, out_mask, done_b)
        _, _, _, out_tokens, out_logprobs, out_mask, _ = jax.lax.while_loop(cond, body, carry)
        return out_tokens, out_logprobs, out_mask

"""The generator and reward executors the controller drives.

GeneratorExecutor: samples `samples_per_prompt` completions of each prompt with the weights of
one policy version, on its mesh, and returns host-side rollouts stamped with that version. The
generator is the continuous-batching engine (`EngineSampler`: each prompt one request of
`samples_per_prompt` samples, prefilled once) or, with `generator="static"` and on meshes that
span processes, the static `Sampler`. Its sampling key is a function of (seed, policy version,
batch index) only and the engine's request id is the prompt's index in the batch, so a sample's
noise depends on (seed, version, batch index, prompt index, sample index, token index) only and a
resumed or re-run job draws exactly the same samples.

RewardExecutor: decodes completions (without special tokens: the `<eos>` that ended a completion
is not part of its text) and scores them with a registered (or given) reward function; a reward
that raises or returns non-finite values stops the run with a message naming it.

Async mode (the generator on its own mesh): `mesh_sampler` and `generator_param_shardings` place
the generator, and `GeneratorWeights` hands it the trainer's pushed weights version by version.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx

from jaxrl import lora as lora_lib
from jaxrl.generation.engine_sampler import EngineSampler, make_sampler
from jaxrl.generation.sampler import Sampler
from jaxrl.generation.sampling import SamplingConfig
from jaxrl.infra.sharding import param_shardings
from jaxrl.models.transformer import Transformer
from jaxrl.rl import Rollout
from jaxrl.rollout_queue import QueueClosed, wait_until
from jaxrl.tasks.rewards import RewardError, compute_rewards, decode_completions
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


class GeneratorExecutor:
    def __init__(
        self,
        sampler: Sampler,
        sampling: SamplingConfig,
        samples_per_prompt: int,
        seed: int,
    ):
        if sampling.top_k or sampling.top_p < 1.0:
            raise ValueError(
                "RL sampling uses top_k=0 and top_p=1: the trainer's log pi must be computed "
                "under the distribution the behaviour log-probs come from"
            )
        self.sampler, self.sampling = sampler, sampling
        self.samples_per_prompt, self.seed = samples_per_prompt, seed

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
        return GeneratedBatch(
            items=[it for it in items for _ in range(n)],
            prompt_ids=rows,
            completion_ids=[out.tokens_bn[i, : lengths[i]] for i in range(len(rows))],
            behaviour_logprobs=[out.logprobs_bn[i, : lengths[i]] for i in range(len(rows))],
            group_ids=np.repeat(np.arange(len(items)) + batch_index * len(items), n),
            policy_version=policy_version,
            batch_index=batch_index,
            seconds=time.perf_counter() - start,
        )


class RewardExecutor:
    def __init__(self, reward, tokenizer, *, shuffle_seed: int | None = None):
        """`reward`: a registered reward name or a batched callable. `shuffle_seed` (a control
        experiment) permutes the rewards within each batch, breaking their link to the
        completions."""
        self.reward, self.tokenizer, self.shuffle_seed = reward, tokenizer, shuffle_seed

    def score(self, batch: GeneratedBatch) -> tuple[list[Rollout], dict]:
        start = time.perf_counter()
        texts = decode_completions(self.tokenizer, batch.completion_ids)
        try:
            rewards = compute_rewards(
                self.reward,
                [it.text for it in batch.items],
                texts,
                [it.reference for it in batch.items],
            )
        except RewardError:
            raise
        except Exception as e:  # a user reward's own failure: stop and say which reward
            name = self.reward if isinstance(self.reward, str) else repr(self.reward)
            raise RewardError(
                f"reward {name!r} raised {type(e).__name__}: {e} (batch {batch.batch_index})"
            ) from e
        raw_mean = float(rewards.mean())
        if self.shuffle_seed is not None:
            rng = np.random.default_rng([self.shuffle_seed, batch.batch_index])
            rewards = rewards[rng.permutation(len(rewards))]
        rollouts = [
            Rollout(
                prompt_ids=np.asarray(batch.prompt_ids[i], np.int32),
                completion_ids=np.asarray(batch.completion_ids[i], np.int32),
                behaviour_logprobs=np.asarray(batch.behaviour_logprobs[i], np.float32),
                policy_version=batch.policy_version,
                reward=float(rewards[i]),
                group_id=int(batch.group_ids[i]),
            )
            for i in range(len(texts))
        ]
        lengths = np.array([len(c) for c in batch.completion_ids])
        metrics = {
            "reward/mean": raw_mean,
            "reward/trained_mean": float(rewards.mean()),
            "completion/mean_tokens": float(lengths.mean()),
            "time/reward_s": time.perf_counter() - start,
        }
        return rollouts, metrics


# --- async mode: the generator on its own mesh --------------------------------------------------


# Prompt lengths a run's sampler pads to (one compiled program per bucket in use).
RL_PROMPT_BUCKETS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048)


class _Adapters:
    """A sampler of a LoRA policy that holds the frozen base once (`base_params`, on its mesh)
    and takes the adapters as the params of each `generate` call: applied unmerged, so a weight
    push moves the adapters only and the base is never rewritten or copied."""

    base_params: dict | None = None

    def generate(self, params, *args, **kwargs):
        if self.base_params is None:
            raise ValueError(
                f"{type(self).__name__}.base_params is unset: place the frozen base first"
            )
        return super().generate(lora_lib.combine(self.base_params, params), *args, **kwargs)


class AdapterSampler(_Adapters, Sampler):
    """The static sampler of a LoRA policy (see `_Adapters`)."""


class AdapterEngineSampler(_Adapters, EngineSampler):
    """The engine of a LoRA policy (see `_Adapters`)."""


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
) -> Sampler | EngineSampler:
    """A sampler for the trainer's model on `mesh` with that role's rules table: the trainer's
    own (colocated, `colocated_sampler`) or the generator's devices in async mode.
    `prompt_buckets`: the padded prompt lengths (one compile each; train batches are padded to
    the same bucket). `generator`: "engine" (`EngineSampler` with `num_slots` decode slots and
    `steps_per_call` decode steps per device call, `precompile` its programs ahead of their
    first use) or "static" (`Sampler`); see `make_sampler`.

    A LoRA trainer gets an `AdapterEngineSampler` / `AdapterSampler` holding the trainer's base
    (set before this call) placed on `mesh` (and cast to `base_dtype`): one copy, shared by every
    pushed version."""
    lora = trainer.lora is not None
    sampler = make_sampler(
        generator,
        trainer.graphdef,
        trainer.model_config,
        num_slots=num_slots,
        steps_per_call=steps_per_call,
        precompile=precompile,
        cls_static=AdapterSampler if lora else Sampler,
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
) -> Sampler | EngineSampler:
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


class GeneratorWeights:
    """The generator's copies of the policy, by version: the trainer thread publishes each new
    version (a `WeightSync` push into fresh generator buffers), the generator thread acquires the
    version each batch is sampled with.

    No rollout is sampled from half-updated weights: a push never writes into buffers a batch
    samples from (the version in use stays whole until the generator, between two batches,
    acquires a newer one and frees it), and a version is visible only once its push returned.

    Memory on the generator devices: at most two copies of the params (the one in use and one
    newer) -- a double buffer. Before pushing, `publish` waits until the generator holds at most
    one copy (fixed lag: every version is used, so it waits for the generator to take the
    pending one) or, with `latest_only` (free-running: the generator always takes the newest),
    frees the pending version that the new one supersedes and never waits. Why not WeightSync's
    pause-and-swap (peak params + one chunk): a swap must wait for the batch being sampled to
    finish, so the trainer would idle up to one generate call per step, the very overlap async
    mode exists for; one extra copy of the params on the generator buys it back.

    Args:
      sync: the trainer -> generator transport (built for the trainer's and generator's
        shardings); pushes run with `previous=None`, so its strategy does not matter here.
      latest_only: free-running schedule (see above).
    """

    def __init__(self, sync, *, latest_only: bool):
        self.sync, self.latest_only = sync, latest_only
        self._held: dict[int, object] = {}  # version -> GeneratorParams
        self.published_at: dict[int, float] = {}  # version -> time.perf_counter() of its push
        self._in_use: int | None = None
        self._closed: QueueClosed | None = None
        self._cond = threading.Condition()

    def publish(self, trainer_params, version: int, timeout: float | None = None):
        """Pushes `trainer_params` as `version` (trainer thread; before the next step donates
        them). Returns (SyncMetrics, seconds spent waiting for the generator to free a slot)."""
        start = time.perf_counter()
        with self._cond:
            if self.latest_only:
                for v in [v for v in self._held if v != self._in_use]:
                    self._held.pop(v).delete()
            deadline = None if timeout is None else time.monotonic() + timeout
            while len(self._held) >= 2:
                self._wait(deadline, f"the generator to take version {min(self._held)}")
        waited = time.perf_counter() - start
        params, metrics = self.sync.push(trainer_params, version)
        with self._cond:
            self._held[version] = params
            self.published_at[version] = time.perf_counter()
            self._cond.notify_all()
        return metrics, waited

    def newest(self, after: int):
        """The `GeneratorParams` of the newest published version above `after`, or None at once
        (streaming: the engine asks between decode steps and never waits). Frees the older
        versions, as `acquire` does."""
        with self._cond:  # one lock: a concurrent publish may free a pending version
            if self._closed is not None:
                raise QueueClosed(self._closed.error)
            newer = [v for v in self._held if v > after]
            if not newer:
                return None
            version = max(newer)
            for v in [v for v in self._held if v < version]:
                self._held.pop(v).delete()
            self._in_use = version
            self._cond.notify_all()
            return self._held[version]

    def acquire(self, version: int | None, timeout: float | None = None):
        """The `GeneratorParams` of `version` (None: the newest published), waiting until it is
        published (generator thread, between batches). Frees every older version: the schedules
        never ask for an older version than the last one acquired."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            if None not in (version, self._in_use) and version < self._in_use:
                raise ValueError(f"version {version} asked for after version {self._in_use}")
            while True:
                if self._closed is not None:
                    raise QueueClosed(self._closed.error)
                if version is None and self._held:
                    version = max(self._held)
                if version in self._held:
                    break
                self._wait(deadline, f"policy version {version}")
            for v in [v for v in self._held if v < version]:
                self._held.pop(v).delete()
            self._in_use = version
            self._cond.notify_all()
            return self._held[version]

    def close(self, error: BaseException | None = None) -> None:
        """Wakes every waiter (they raise QueueClosed(error)); the first close wins."""
        with self._cond:
            if self._closed is None:
                self._closed = QueueClosed(error)
            self._cond.notify_all()

    def free(self) -> None:
        """Deletes every held copy (end of run; the generator thread has stopped)."""
        with self._cond:
            for params in self._held.values():
                params.delete()
            self._held.clear()

    @property
    def held_versions(self) -> list[int]:
        with self._cond:
            return sorted(self._held)

    def _wait(self, deadline: float | None, what: str) -> None:
        if self._closed is not None:
            raise QueueClosed(self._closed.error)
        wait_until(self._cond, deadline, what)

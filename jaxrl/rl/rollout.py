"""Rollout records: one sampled completion on the host, and the fixed-shape batch the trainer eats.

A `Rollout` is what the generator + reward executors produce for one sample: variable-length NumPy
arrays plus scalars. `collate_rollouts` packs a list of them into a `RolloutBatch`, a pytree of
arrays whose shapes depend only on (batch_size, prompt_len, completion_len), so a jitted train step
compiles once per bucket:

    prompt_ids_bp           int32 [B, P]  left-padded with pad_id (prompts end at column P-1)
    prompt_mask_bp          bool  [B, P]
    completion_ids_bt       int32 [B, T]  right-padded with pad_id
    completion_mask_bt      bool  [B, T]  the loss mask: True on the sampled tokens that are trained
                                          (EOS included when sampled); False on padding and on a
                                          multi-turn episode's observation tokens
    completion_length_b     int32 [B]     tokens after the prompt that are in the sequence: the
                                          sampled ones and the observations between them
    behaviour_logprobs_bt   f32   [B, T]  log mu(y_t), from the sampler; 0 on padding
    policy_version_b        int32 [B]     generator policy version that sampled the row
    reward_b                f32   [B]
    group_id_b              int32 [B]     rows with equal ids are samples of the same prompt
    valid_b                 bool  [B]     False on rows that only fill the bucket
    routing_bslk            int16 [B, P + T, L, k] or None: a mixture-of-experts generator's
                                          routing record (`Rollout.routing`), aligned with the
                                          columns of `sequence()`; -1 on padding and on rows that
                                          only fill the bucket. None when the rollouts carry none
                                          (dense models: the batch and its programs as before)

Left-padded prompts followed by right-padded completions make one [B, P + T] teacher-forcing
sequence in which every prompt ends at column P-1, so the hidden states predicting the completion
are the static slice `[P-1, P+T-1)` (see `RolloutBatch.completion_hidden`).

Multi-turn episodes (`jaxrl.generation.episodes`): the completion is every token after the prompt,
the model's turns and the environment's observations in the order the engine saw them. The
observation tokens are attended to (they are among the first `completion_length_b` columns) but
not trained on (`completion_mask_bt` False there): every loss, KL and normaliser reads them only
through the mask, so their placeholder log-probs (0) and versions (-1) change nothing.

Routing replay (mixture-of-experts policies, issue 53): the generator records, for every position
of a sampled sequence, the top-k experts each layer's router chose (`SampleOutput.routing_b`), and
the record travels with the rollout (`Rollout.routing`) as its behaviour log-probs do: through
the rollout queue, its JSON (`jaxrl.loop.rollout_queue.encode_routing`), the role split's channel,
streaming and the checkpoint, into `RolloutBatch.routing_bslk` and, packed,
`PackedRolloutBatch.routing_rllk`, which the trainer's forward replays.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@dataclasses.dataclass(frozen=True)
class Rollout:
    """One scored sample on the host (variable length).

    Attributes:
      prompt_ids: int [P_i], without padding.
      completion_ids: int [T_i], the sampled tokens (EOS included if sampled).
      behaviour_logprobs: float [T_i], log mu of each sampled token under the sampling
        distribution actually used (temperature applied).
      policy_version: version of the generator weights that sampled it.
      reward: scalar reward.
      group_id: id shared by the n samples of one prompt.
      token_versions: int [T_i], the policy version that sampled each token (streaming RL, where
        a trajectory may span weight updates; `policy_version` is then the oldest of them), or
        None when one version sampled the whole completion. -1 on observation tokens.
      loss_mask: bool [T_i], True on the tokens the model sampled (trained), False on tokens a
        multi-turn environment appended (observations: attended, never trained); None when every
        completion token was sampled.
      routing: int16 [P_i + T_i, L, k], a mixture-of-experts generator's routing record: the k
        experts each of the model's L layers chose at each position of the sequence (prompt then
        completion), -1 where nothing was recorded (the last sampled token, which the generator
        never ran; dense layers). None for a dense model (or a generator that does not record).
    """

    prompt_ids: np.ndarray
    completion_ids: np.ndarray
    behaviour_logprobs: np.ndarray
    policy_version: int
    reward: float
    group_id: int
    token_versions: np.ndarray | None = None
    loss_mask: np.ndarray | None = None
    routing: np.ndarray | None = None

    def __post_init__(self):
        if len(self.completion_ids) != len(self.behaviour_logprobs):
            raise ValueError(
                f"completion has {len(self.completion_ids)} tokens but "
                f"{len(self.behaviour_logprobs)} behaviour log-probs"
            )
        if self.token_versions is not None and len(self.token_versions) != len(self.completion_ids):
            raise ValueError(
                f"completion has {len(self.completion_ids)} tokens but "
                f"{len(self.token_versions)} token versions"
            )
        if self.loss_mask is not None and len(self.loss_mask) != len(self.completion_ids):
            raise ValueError(
                f"completion has {len(self.completion_ids)} tokens but a loss mask of "
                f"{len(self.loss_mask)}"
            )
        if self.routing is not None:
            object.__setattr__(self, "routing", _checked_routing(self))


def _checked_routing(rollout: Rollout) -> np.ndarray:
    """`rollout.routing` as int16 `[P + T, L, k]`, or a ValueError naming the fix."""
    routing = np.asarray(rollout.routing)
    n = len(rollout.prompt_ids) + len(rollout.completion_ids)
    if routing.ndim != 3 or len(routing) != n or not np.issubdtype(routing.dtype, np.integer):
        raise ValueError(
            f"routing record of shape {routing.shape} ({routing.dtype}) for a rollout of "
            f"{len(rollout.prompt_ids)} prompt + {len(rollout.completion_ids)} completion tokens; "
            f"expected integers [{n}, num_layers, top_k], one row per position of the prompt "
            "then the completion: take row b of the sampler's record as `routing_b[b][: "
            "len(prompt_b) + lengths_b[b]]` (None for a dense model)"
        )
    if routing.dtype != np.int16:
        if routing.size and (routing.min() < -1 or routing.max() > np.iinfo(np.int16).max):
            raise ValueError(
                f"routing record holds expert ids in [{routing.min()}, {routing.max()}]; expected "
                "-1 (nothing recorded) or an expert index that fits int16"
            )
        routing = routing.astype(np.int16)
    return routing


@struct.dataclass
class RolloutBatch:
    """A fixed-shape batch of rollouts; see the module docstring for the fields' meaning."""

    prompt_ids_bp: jax.Array
    prompt_mask_bp: jax.Array
    completion_ids_bt: jax.Array
    completion_mask_bt: jax.Array
    completion_length_b: jax.Array
    behaviour_logprobs_bt: jax.Array
    policy_version_b: jax.Array
    reward_b: jax.Array
    group_id_b: jax.Array
    valid_b: jax.Array
    routing_bslk: jax.Array | None = None

    @property
    def batch_size(self) -> int:
        return self.completion_ids_bt.shape[0]

    @property
    def prompt_len(self) -> int:
        return self.prompt_ids_bp.shape[1]

    @property
    def completion_len(self) -> int:
        return self.completion_ids_bt.shape[1]

    def sequence(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Teacher-forcing inputs `(tokens_bs, mask_bs, positions_bs)`, S = P + T.

        Positions count real tokens only (left padding does not shift them), matching a sampler
        that starts each prompt at position 0.
        """
        tokens_bs = jnp.concatenate([self.prompt_ids_bp, self.completion_ids_bt], axis=1)
        # Attended: every present token, observations included (the loss mask is a subset).
        present_bt = jnp.arange(self.completion_len)[None, :] < self.completion_length_b[:, None]
        mask_bs = jnp.concatenate([self.prompt_mask_bp, present_bt], axis=1)
        # Padding inside the completion (after EOS) keeps counting; those positions are masked.
        prompt_positions_bp = jnp.cumsum(self.prompt_mask_bp, axis=1) - 1
        prompt_lengths_b1 = jnp.sum(self.prompt_mask_bp, axis=1, keepdims=True)
        completion_positions_bt = prompt_lengths_b1 + jnp.arange(self.completion_len)[None, :]
        positions_bs = jnp.concatenate(
            [jnp.maximum(prompt_positions_bp, 0), completion_positions_bt], axis=1
        )
        return tokens_bs, mask_bs, positions_bs.astype(jnp.int32)

    def completion_hidden(self, hidden_bsd: jax.Array) -> jax.Array:
        """`[B, T, D]` hidden states that predict `completion_ids_bt` (a static slice)."""
        p = self.prompt_len
        return hidden_bsd[:, p - 1 : p - 1 + self.completion_len]


def rollouts_from_samples(
    prompt_ids: Sequence[Sequence[int]],
    samples,
    rewards: Sequence[float],
    group_ids: Sequence[int],
    policy_version: int = 0,
) -> list[Rollout]:
    """One `Rollout` per row of a sampler's output.

    Args:
      prompt_ids: the B prompts passed to `Sampler.generate` (token ids, no padding).
      samples: its `SampleOutput` (`tokens_bn`, `logprobs_bn`, `mask_bn`; a row's completion is
        its first `mask_bn.sum()` tokens, the stop token included).
      rewards: B scores (e.g. `compute_rewards(...)` on `decode_completions(...)`).
      group_ids: B ids; rows with equal ids are samples of the same prompt (the group baseline).
      policy_version: the version of the weights that sampled them (0 for on-policy scripts).

    A mixture-of-experts sampler's routing record (`samples.routing_b`) goes with each row
    (`Rollout.routing`: its prompt and completion, checked against their lengths).
    """
    lengths_b = np.asarray(samples.mask_bn).sum(axis=-1)
    routing_b = getattr(samples, "routing_b", None)
    n = len(prompt_ids)
    if not len(lengths_b) == len(rewards) == len(group_ids) == n:
        raise ValueError(
            f"{n} prompts, {len(lengths_b)} sampled rows, {len(rewards)} rewards and "
            f"{len(group_ids)} group ids; expected one of each per row"
        )
    return [
        Rollout(
            prompt_ids=np.asarray(prompt_ids[i], np.int32),
            completion_ids=np.asarray(samples.tokens_bn[i, : lengths_b[i]], np.int32),
            behaviour_logprobs=np.asarray(samples.logprobs_bn[i, : lengths_b[i]], np.float32),
            policy_version=int(policy_version),
            reward=float(rewards[i]),
            group_id=int(group_ids[i]),
            routing=None if routing_b is None else routing_b[i],
        )
        for i in range(n)
    ]


def select_groups(
    rollouts: Sequence[Rollout], num_groups: int
) -> tuple[list[Rollout], dict[str, float]]:
    """Dynamic sampling (DAPO): keeps `num_groups` of the sampled prompt groups, those whose
    completions got different rewards first.

    A group whose samples all got the same reward has zero group-relative advantage on every
    row, so it adds no gradient, only noise to the normaliser; sampling more prompts than a step
    trains on and keeping the informative groups makes each train batch count. Groups are taken
    in sampling order (informative ones, then, if too few, uninformative ones to fill the batch),
    so the choice is a deterministic function of the rollouts. Returns the kept rollouts and
    `data/informative_groups` (fraction of the sampled groups with a reward spread) and
    `data/informative_trained` (fraction of the kept ones).
    """
    groups: dict[int, list[Rollout]] = {}
    for r in rollouts:
        groups.setdefault(r.group_id, []).append(r)
    if num_groups > len(groups):
        raise ValueError(f"asked for {num_groups} groups out of {len(groups)} sampled")
    spread = [len({r.reward for r in g}) > 1 for g in groups.values()]
    order = [i for i, s in enumerate(spread) if s] + [i for i, s in enumerate(spread) if not s]
    kept = sorted(order[:num_groups])
    members = list(groups.values())
    metrics = {
        "data/informative_groups": sum(spread) / len(spread),
        "data/informative_trained": sum(spread[i] for i in kept) / num_groups,
    }
    return [r for i in kept for r in members[i]], metrics


def collate_rollouts(
    rollouts: Sequence[Rollout],
    *,
    prompt_len: int,
    completion_len: int,
    pad_id: int,
    batch_size: int | None = None,
) -> RolloutBatch:
    """Pack rollouts into a `RolloutBatch` of shape (batch_size, prompt_len, completion_len).

    The leaves are host NumPy arrays, so the caller places them with `jax.device_put(batch,
    shardings)` straight into the trainer layout. Raises instead of truncating: a prompt or
    completion longer than its bucket means the bucket sizes are wrong, and silently cutting
    tokens would bias the loss. Extra rows (when `batch_size > len(rollouts)`) are invalid:
    all-False masks, group id -1, reward 0. A rollout's `loss_mask` (multi-turn) becomes its
    row of `completion_mask_bt`; its observation tokens' behaviour log-probs are written as 0
    whatever the rollout holds, so the batch does not depend on placeholders. Routing records
    (`Rollout.routing`) fill `routing_bslk` column for column with `sequence()` (-1 elsewhere);
    every rollout carries one or none does (None: the batch a dense model always had).
    """
    n = len(rollouts)
    batch_size = n if batch_size is None else batch_size
    if n == 0 or n > batch_size:
        raise ValueError(f"need 1 <= len(rollouts) <= batch_size; got {n} and {batch_size}")
    prompt_ids = np.full((batch_size, prompt_len), pad_id, np.int32)
    prompt_mask = np.zeros((batch_size, prompt_len), bool)
    completion_ids = np.full((batch_size, completion_len), pad_id, np.int32)
    completion_mask = np.zeros((batch_size, completion_len), bool)
    completion_length = np.zeros((batch_size,), np.int32)
    behaviour = np.zeros((batch_size, completion_len), np.float32)
    version = np.zeros((batch_size,), np.int32)
    reward = np.zeros((batch_size,), np.float32)
    group = np.full((batch_size,), -1, np.int32)
    valid = np.zeros((batch_size,), bool)
    routing = _routing_buffer(rollouts, batch_size, prompt_len + completion_len)
    for i, r in enumerate(rollouts):
        p, t = len(r.prompt_ids), len(r.completion_ids)
        if p == 0 or p > prompt_len or t > completion_len:
            raise ValueError(
                f"rollout {i}: prompt of {p} tokens / completion of {t} tokens does not fit the "
                f"bucket (prompt_len={prompt_len}, completion_len={completion_len}); pick a larger "
                "bucket"
            )
        prompt_ids[i, prompt_len - p :] = r.prompt_ids
        prompt_mask[i, prompt_len - p :] = True
        completion_ids[i, :t] = r.completion_ids
        trained = np.ones(t, bool) if r.loss_mask is None else np.asarray(r.loss_mask, bool)
        completion_mask[i, :t] = trained
        completion_length[i] = t
        behaviour[i, :t] = np.where(trained, r.behaviour_logprobs, 0.0)
        version[i], reward[i], group[i], valid[i] = r.policy_version, r.reward, r.group_id, True
        if routing is not None:
            routing[i, prompt_len - p : prompt_len] = r.routing[:p]
            routing[i, prompt_len : prompt_len + t] = r.routing[p:]
    return RolloutBatch(
        prompt_ids_bp=prompt_ids,
        prompt_mask_bp=prompt_mask,
        completion_ids_bt=completion_ids,
        completion_mask_bt=completion_mask,
        completion_length_b=completion_length,
        behaviour_logprobs_bt=behaviour,
        policy_version_b=version,
        reward_b=reward,
        group_id_b=group,
        valid_b=valid,
        routing_bslk=routing,
    )


def _routing_buffer(rollouts: Sequence[Rollout], batch_size: int, width: int):
    """An all -1 int16 `[batch_size, width, L, k]` for the rollouts' routing records, or None
    when none carries one; refuses a mix, or records of different `[L, k]`."""
    routed = [r.routing is not None for r in rollouts]
    if not any(routed):
        return None
    if not all(routed):
        raise ValueError(
            f"{sum(routed)} of {len(routed)} rollouts carry a routing record (rollout "
            f"{routed.index(False)} does not): a batch replays the generator's routing on every "
            "row or on none. Build all its rollouts from one mixture-of-experts generator that "
            "records routing, or drop the records (Rollout(routing=None)) from all of them"
        )
    shapes = {r.routing.shape[1:] for r in rollouts}
    if len(shapes) > 1:
        raise ValueError(
            f"routing records of different [num_layers, top_k] in one batch: {sorted(shapes)}; "
            "the rollouts of a batch come from one model"
        )
    return np.full((batch_size, width, *shapes.pop()), -1, np.int16)

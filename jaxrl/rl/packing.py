"""Padding-free batches: variable-length sequences packed into fixed-length rows with segment ids.

A padded `RolloutBatch` runs the model over `B x (P + T)` tokens, `P` the longest prompt's bucket
and `T` the sampler's `max_new_tokens`, whatever the real lengths. Packing lays each rollout's real
tokens (prompt then completion, `P_i + T_i`) end to end into rows of `L` tokens; the model runs over
`R x L` tokens with

    segment_rl[r, l]    k >= 1 for the k-th sequence of row r, 0 on the row's unused tail
    positions_rl[r, l]  0 at each sequence's first token (positions restart per segment)
    mask[r, q, k]       segment[r, k] == segment[r, q] > 0 and k <= q   (`segment_mask`)

so attention never crosses a segment and every sequence sees exactly the positions and keys it has
in the padded batch. The loss side does not change: `predict_index_bt[b, t]` is the flat index
(`row * L + column`, within the rollout's packing group) of the hidden state that predicts
completion token `t` of rollout `b`, and gathering those gives the same `[B, T, E]` hidden states
the padded batch slices out; the completion fields (`completion_ids_bt`, masks, behaviour log-probs,
rewards, group ids) are the padded batch's, so log-probs, advantages, the loss and its normalisers
are computed exactly as before.

Groups. The batch is cut into `micro_batches x shards` groups of consecutive rollouts (the trainer's
gradient-accumulation micro-batches, each split over the data-parallel devices), and each group is
packed into its own `R / (micro_batches x shards)` rows. Splitting rows and rollouts along the
leading axis therefore keeps every rollout with its rows, and the gather is a batched gather over
the group axis (local to a device, no all-gather of hidden states).

Shapes are bucketed so the train step compiles a bounded number of times: rows per group are
rounded up on a ladder of at most 8 sizes per octave (under 12.5% extra rows).

Packing is first-fit decreasing (longest sequence first, into the first row with room), a
deterministic function of the batch.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxrl.rl.rollout import RolloutBatch


@struct.dataclass
class PackedRolloutBatch:
    """A `RolloutBatch`'s rollouts packed into `[R, L]` rows (see the module docstring).

    The completion fields are the padded batch's (`RolloutBatch`), `B` rows of `T` columns.
    """

    tokens_rl: jax.Array  # int32 [R, L]
    segment_rl: jax.Array  # int32 [R, L]
    positions_rl: jax.Array  # int32 [R, L]
    predict_index_bt: jax.Array  # int32 [B, T]
    completion_ids_bt: jax.Array
    completion_mask_bt: jax.Array
    behaviour_logprobs_bt: jax.Array
    policy_version_b: jax.Array
    reward_b: jax.Array
    group_id_b: jax.Array
    valid_b: jax.Array

    @property
    def batch_size(self) -> int:
        return self.completion_ids_bt.shape[0]

    @property
    def completion_len(self) -> int:
        return self.completion_ids_bt.shape[1]

    def completion_hidden(self, hidden_rle: jax.Array, groups: int) -> jax.Array:
        """`[B, T, E]`: the hidden states (`hidden_rle`, the model over `tokens_rl`) that
        predict `completion_ids_bt`, gathered group by group (`groups` consecutive blocks of
        rows and rollouts)."""
        rows, length, e = hidden_rle.shape
        b, t = self.predict_index_bt.shape
        flat_gne = hidden_rle.reshape(groups, (rows // groups) * length, e)
        index_gn = self.predict_index_bt.reshape(groups, (b // groups) * t)
        out = jax.vmap(lambda h, i: jnp.take(h, i, axis=0))(flat_gne, index_gn)
        return out.reshape(b, t, e)


def segment_mask(segment_rl: jax.Array) -> jax.Array:
    """`mask[r, q, k]`: key k is in query q's segment (not the unused tail) and not after it."""
    length = segment_rl.shape[-1]
    causal = jnp.tril(jnp.ones((length, length), bool))
    same = segment_rl[:, :, None] == segment_rl[:, None, :]
    return causal[None] & same & (segment_rl[:, None, :] > 0)


def bucket_rows(n: int) -> int:
    """`n` rounded up on a ladder with at most 8 sizes per octave (1..8, then 9, 10, ..., 16,
    18, 20, ..., 32, 36, ...)."""
    if n <= 8:
        return max(n, 1)
    step = 1 << (n.bit_length() - 4)
    return -(-n // step) * step


def first_fit_rows(lengths: list[int], row_length: int) -> list[list[int]]:
    """Indices of `lengths` per row, first-fit decreasing (ties keep index order)."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if lengths[i] == 0:
            continue
        slot = next((r for r, free in enumerate(room) if free >= lengths[i]), None)
        if slot is None:
            rows.append([])
            room.append(row_length)
            slot = len(rows) - 1
        rows[slot].append(i)
        room[slot] -= lengths[i]
    return rows


def _check_groups(batch_size: int, groups: int) -> None:
    if groups < 1 or batch_size % groups:
        raise ValueError(
            f"a batch of {batch_size} rows does not split into {groups} packing groups "
            "(micro-batches x data-parallel devices); change the batch size"
        )


def _pack_groups(sequences: list[np.ndarray], row_length: int, groups: int, what: str):
    """Packs `sequences` (token arrays; empty = skipped), consecutive blocks of
    `len(sequences) // groups` per group. Returns `(tokens, segment, positions [R, L],
    placement)`, `placement[i] = (row within the group, column)` of sequence i's first token."""
    lengths = [len(s) for s in sequences]
    too_long = [i for i, n in enumerate(lengths) if n > row_length]
    if too_long:
        raise ValueError(
            f"{what} {too_long[0]} has {lengths[too_long[0]]} tokens, more than the pack length "
            f"{row_length}; set the pack length to at least {max(lengths)} (the longest sequence)"
        )
    per = len(sequences) // groups
    plans = [first_fit_rows(lengths[g * per : (g + 1) * per], row_length) for g in range(groups)]
    rows_per_group = bucket_rows(max(len(p) for p in plans))
    total = groups * rows_per_group
    tokens = np.zeros((total, row_length), np.int32)
    segment = np.zeros((total, row_length), np.int32)
    positions = np.zeros((total, row_length), np.int32)
    placement = [(0, 0)] * len(sequences)
    for g, plan in enumerate(plans):
        for r, members in enumerate(plan):
            row, col = g * rows_per_group + r, 0
            for k, local in enumerate(members, start=1):
                i = g * per + local
                n = lengths[i]
                tokens[row, col : col + n] = sequences[i]
                segment[row, col : col + n] = k
                positions[row, col : col + n] = np.arange(n)
                placement[i] = (r, col)
                col += n
    return tokens, segment, positions, placement


def pack_rollout_batch(batch: RolloutBatch, row_length: int, groups: int = 1) -> PackedRolloutBatch:
    """Packs a padded `RolloutBatch` (host arrays, e.g. from `collate_rollouts`) into rows of
    `row_length` tokens, in `groups` groups of consecutive rollouts (module docstring).

    Invalid rows (`valid_b` False) take no tokens. Raises if a rollout is longer than
    `row_length` or the batch does not split into `groups`.
    """
    prompt_ids, prompt_mask = np.asarray(batch.prompt_ids_bp), np.asarray(batch.prompt_mask_bp)
    completion_ids = np.asarray(batch.completion_ids_bt)
    completion_mask = np.asarray(batch.completion_mask_bt)
    valid = np.asarray(batch.valid_b)
    b, t = completion_ids.shape
    _check_groups(b, groups)
    prompts = [prompt_ids[i][prompt_mask[i]] if valid[i] else prompt_ids[i, :0] for i in range(b)]
    lengths = completion_mask.sum(axis=1)
    sequences = [
        np.concatenate([prompts[i], completion_ids[i, : lengths[i]]])
        if valid[i]
        else prompt_ids[i, :0]
        for i in range(b)
    ]
    tokens, segment, positions, placement = _pack_groups(sequences, row_length, groups, "rollout")
    # Completion token t of rollout i sits at column col + P_i + t; the state predicting it is
    # one column earlier. Padding columns point at the group's first token (masked in the loss).
    index = np.zeros((b, t), np.int32)
    for i in range(b):
        if valid[i]:
            row, col = placement[i]
            start = row * row_length + col + len(prompts[i]) - 1
            index[i, : lengths[i]] = start + np.arange(lengths[i])
    fields = {
        f.name: np.asarray(getattr(batch, f.name))
        for f in dataclasses.fields(PackedRolloutBatch)
        if hasattr(batch, f.name)
    }
    return PackedRolloutBatch(
        tokens_rl=tokens,
        segment_rl=segment,
        positions_rl=positions,
        predict_index_bt=index,
        **fields,
    )


def pack_sft_batch(batch: dict, row_length: int, groups: int = 1) -> dict:
    """Packs a right-padded SFT batch (`tokens_bs`, `loss_mask_bs`) into rows of `row_length`.

    A row's sequence ends at its last loss token (the `<eos>` it must emit); what follows is
    padding. Returns `tokens_bs`, `loss_mask_bs`, `segment_bs` and `positions_bs`, `[R, L]`
    each, the packed groups in order (as `pack_rollout_batch`).
    """
    tokens, loss_mask = np.asarray(batch["tokens_bs"]), np.asarray(batch["loss_mask_bs"])
    _check_groups(tokens.shape[0], groups)
    ends = [int(np.flatnonzero(m)[-1]) + 1 if m.any() else len(m) for m in loss_mask.astype(bool)]
    sequences = [tokens[i, :n] for i, n in enumerate(ends)]
    packed, segment, positions, placement = _pack_groups(sequences, row_length, groups, "example")
    per = tokens.shape[0] // groups
    rows_per_group = packed.shape[0] // groups
    mask = np.zeros(packed.shape, bool)
    for i, n in enumerate(ends):
        row, col = placement[i]
        row = (i // per) * rows_per_group + row
        mask[row, col : col + n] = loss_mask[i, :n]
        mask[row, col] = False  # a sequence's first token has no predictor, as when padded
    return {
        "tokens_bs": packed,
        "loss_mask_bs": mask,
        "segment_bs": segment,
        "positions_bs": positions,
    }

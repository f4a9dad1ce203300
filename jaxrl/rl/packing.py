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

Shared prompts (`share_prompts=True`; Prefix Grouper, arXiv 2506.05433). The G samples of a prompt
repeat it G times above. Instead, the rollouts of a packing group whose prompts are identical are
laid out as one unit `[prompt, c_1, ..., c_n]` (split into several units, each with its own copy of
the prompt, only where one would not fit a row), each part its own segment, and

    prefix_rl[r, l]     the segment id of the prompt of token l's unit (its own on a prompt token
                        and on the plain layout, where every sequence is its own prefix)
    mask[r, q, k]       k <= q and segment[r, k] > 0 and
                        (segment[r, k] == segment[r, q] or segment[r, k] == prefix[r, q])
    positions_rl        0 .. P-1 on the prompt, P .. P + T_j - 1 on completion j

so completion j attends to its prompt and to its own earlier tokens, never to another completion,
at the positions it has in the repeated layout: every hidden state of completion j equals the
repeated layout's. Completion j's first token is predicted from the prompt's last state (shared by
the unit's completions: `predict_index_bt` points G rows at one state), its token t > 0 from its
own token t - 1. The prompt runs through the model once per unit, and its gradient is the sum of
the completions' (the gather's transpose adds them up): the repeated layout's gradient, less
(G - 1) / G of the prompt's FLOPs.

Routing records (mixture-of-experts routing replay, `RolloutBatch.routing_bslk`): `routing_rllk`
`[R, L, layers, k]` holds, at each packed token, the record of the same token in the padded batch
(-1 on a row's unused tail), so the trainer's forward replays each position's experts exactly as
in the padded layout. With shared prompts a unit's prompt appears once, with the record of the
unit's first rollout: the engine prefills a group's prompt once and its G samples share that
prefill's records, so any of them serves. Rollouts with an identical prompt but a different
prompt record (the same prompt sampled in two requests, by different versions) go to different
units, so every completion attends to its prompt as its own generator ran it. A batch without
routing (a dense model) packs exactly as before, `routing_rllk` None.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxrl.models.masks import segment_mask  # noqa: F401  (the mask of these rows)
from jaxrl.rl.rollout import RolloutBatch


@struct.dataclass
class PackedRolloutBatch:
    """A `RolloutBatch`'s rollouts packed into `[R, L]` rows (see the module docstring).

    The completion fields are the padded batch's (`RolloutBatch`), `B` rows of `T` columns.
    """

    tokens_rl: jax.Array  # int32 [R, L]
    segment_rl: jax.Array  # int32 [R, L]
    prefix_rl: jax.Array  # int32 [R, L]: the segment of token l's prompt (shared prompts)
    positions_rl: jax.Array  # int32 [R, L]
    predict_index_bt: jax.Array  # int32 [B, T]
    completion_ids_bt: jax.Array
    completion_mask_bt: jax.Array
    behaviour_logprobs_bt: jax.Array
    policy_version_b: jax.Array
    reward_b: jax.Array
    group_id_b: jax.Array
    valid_b: jax.Array
    routing_rllk: jax.Array | None = None  # int16 [R, L, layers, k]: tokens_rl's routing records

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


def _too_long(lengths: list[int], row_length: int, what: str) -> None:
    too_long = [i for i, n in enumerate(lengths) if n > row_length]
    if too_long:
        raise ValueError(
            f"{what} {too_long[0]} has {lengths[too_long[0]]} tokens, more than the pack length "
            f"{row_length}; set the pack length to at least {max(lengths)} (the longest sequence)"
        )


def _pack_units(units_g: list[list[list[np.ndarray]]], row_length: int):
    """Packs units (each a list of parts, token arrays, laid end to end in one row) per group.

    A unit of one part is a plain sequence (its own prefix); in a unit of several, part 0 is the
    prompt and the others its completions: each part is its own segment, every part's prefix is
    part 0's segment, and a completion's positions continue from the prompt's length. Returns
    `(tokens, segment, prefix, positions [R, L], placement)`, `placement[g][u] = (row within the
    group, the column of each part)` (None for an empty unit)."""
    plans = [
        first_fit_rows([sum(len(p) for p in unit) for unit in units], row_length)
        for units in units_g
    ]
    rows_per_group = bucket_rows(max(len(p) for p in plans))
    total = len(units_g) * rows_per_group
    tokens = np.zeros((total, row_length), np.int32)
    segment = np.zeros((total, row_length), np.int32)
    prefix = np.zeros((total, row_length), np.int32)
    positions = np.zeros((total, row_length), np.int32)
    placement: list[list] = [[None] * len(units) for units in units_g]
    for g, plan in enumerate(plans):
        for r, members in enumerate(plan):
            row, col, seg = g * rows_per_group + r, 0, 0
            for u in members:
                parts = units_g[g][u]
                prefix_seg, prompt_len, cols = seg + 1, len(parts[0]), []
                for j, part in enumerate(parts):
                    seg, n = seg + 1, len(part)
                    tokens[row, col : col + n] = part
                    segment[row, col : col + n] = seg
                    prefix[row, col : col + n] = prefix_seg
                    positions[row, col : col + n] = (prompt_len if j else 0) + np.arange(n)
                    cols.append(col)
                    col += n
                placement[g][u] = (r, cols)
    return tokens, segment, prefix, positions, placement


def _pack_groups(sequences: list[np.ndarray], row_length: int, groups: int, what: str):
    """Packs `sequences` (token arrays; empty = skipped), consecutive blocks of
    `len(sequences) // groups` per group. Returns `(tokens, segment, positions [R, L],
    placement)`, `placement[i] = (row within the group, column)` of sequence i's first token."""
    _too_long([len(s) for s in sequences], row_length, what)
    per = len(sequences) // groups
    units_g = [[[s] for s in sequences[g * per : (g + 1) * per]] for g in range(groups)]
    tokens, segment, _, positions, placement_g = _pack_units(units_g, row_length)
    placement = [(0, 0)] * len(sequences)
    for g, units in enumerate(placement_g):
        for u, where in enumerate(units):
            if where is not None:
                placement[g * per + u] = (where[0], where[1][0])
    return tokens, segment, positions, placement


def _shared_units(
    prompts, completions, row_length: int, first: int, keys=None
) -> tuple[list, list]:
    """One packing group's units `[prompt, c_1, ..., c_n]` (rollouts with identical prompts, in
    batch order; a unit is closed when the next completion would not fit the row) and, per unit,
    the batch indices of its completions (`first` is the group's first index). Rollouts without
    completion tokens take no tokens. `keys` (bytes per rollout): only rollouts whose prompts
    and keys are both equal share a prompt (their prompts' routing records)."""
    by_prompt: dict[bytes, list[int]] = {}
    for i, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        if len(completion):
            key = prompt.tobytes() + (b"" if keys is None else b"|" + keys[i])
            by_prompt.setdefault(key, []).append(i)
    units, owners = [], []
    for members in by_prompt.values():
        prompt = prompts[members[0]]
        longest = max(members, key=lambda i: len(completions[i]))
        if len(prompt) + len(completions[longest]) > row_length:
            n = len(prompt) + len(completions[longest])
            raise ValueError(
                f"rollout {first + longest} has {n} tokens, more than the pack length "
                f"{row_length}; set the pack length to at least {n} (the longest sequence)"
            )
        unit, owner, length = [prompt], [], len(prompt)
        for i in members:
            if length + len(completions[i]) > row_length:
                units.append(unit)
                owners.append(owner)
                unit, owner, length = [prompt], [], len(prompt)
            unit.append(completions[i])
            owner.append(first + i)
            length += len(completions[i])
        units.append(unit)
        owners.append(owner)
    return units, owners


def pack_rollout_batch(
    batch: RolloutBatch, row_length: int, groups: int = 1, share_prompts: bool = False
) -> PackedRolloutBatch:
    """Packs a padded `RolloutBatch` (host arrays, e.g. from `collate_rollouts`) into rows of
    `row_length` tokens, in `groups` groups of consecutive rollouts (module docstring); with
    `share_prompts`, the rollouts of a group with identical prompts as `[prompt, c_1, ..., c_n]`.

    Invalid rows (`valid_b` False) take no tokens. Raises if a rollout is longer than
    `row_length` or the batch does not split into `groups`.
    """
    prompt_ids, prompt_mask = np.asarray(batch.prompt_ids_bp), np.asarray(batch.prompt_mask_bp)
    completion_ids = np.asarray(batch.completion_ids_bt)
    valid = np.asarray(batch.valid_b)
    b, t = completion_ids.shape
    _check_groups(b, groups)
    per = b // groups
    empty = prompt_ids[0, :0]
    prompts = [prompt_ids[i][prompt_mask[i]] if valid[i] else empty for i in range(b)]
    # Every present token (a multi-turn episode's observations too); the loss mask is a subset.
    lengths = np.asarray(batch.completion_length_b)
    completions = [completion_ids[i, : lengths[i]] if valid[i] else empty for i in range(b)]
    routing = _routing_parts(batch, prompt_mask, lengths, valid)
    where: dict[int, tuple[int, int, int]] = {}  # rollout -> (group, unit, completion's part)
    if share_prompts:
        units_g, owners_g = [], []
        keys = None if routing is None else [p.tobytes() for p, _ in routing]
        for g in range(groups):
            block = slice(g * per, (g + 1) * per)
            units, owners = _shared_units(
                prompts[block],
                completions[block],
                row_length,
                g * per,
                None if keys is None else keys[block],
            )
            units_g.append(units)
            owners_g.append(owners)
            for u, owner in enumerate(owners):
                where.update({i: (g, u, j) for j, i in enumerate(owner, start=1)})
    else:  # one part per unit: the prompt and the completion as one sequence
        sequences = [np.concatenate([prompts[i], completions[i]]) for i in range(b)]
        _too_long([len(s) for s in sequences], row_length, "rollout")
        units_g = [[[s] for s in sequences[g * per : (g + 1) * per]] for g in range(groups)]
        where = {i: (i // per, i % per, 0) for i in range(b) if len(sequences[i])}
        owners_g = None
    tokens, segment, prefix, positions, placement = _pack_units(units_g, row_length)
    packed_routing = None
    if routing is not None:
        layers_k = np.shape(batch.routing_bslk)[2:]
        packed_routing = _pack_routing(routing, where, placement, owners_g, tokens.shape, layers_k)
    # Completion token t of rollout i is predicted by the state before it: for t > 0 its own
    # token t - 1, for t = 0 the prompt's last token. Padding columns point at the group's
    # first token (masked in the loss).
    index = np.zeros((b, t), np.int32)
    for i, (g, u, j) in where.items():
        if not valid[i] or not lengths[i]:
            continue
        row, cols = placement[g][u]
        prompt_end = row * row_length + cols[0] + len(prompts[i])
        start = prompt_end if j == 0 else row * row_length + cols[j]
        index[i, : lengths[i]] = start - 1 + np.arange(lengths[i])
        index[i, 0] = prompt_end - 1
    fields = {
        f.name: np.asarray(getattr(batch, f.name))
        for f in dataclasses.fields(PackedRolloutBatch)
        if hasattr(batch, f.name)
    }
    return PackedRolloutBatch(
        tokens_rl=tokens,
        segment_rl=segment,
        prefix_rl=prefix,
        positions_rl=positions,
        predict_index_bt=index,
        routing_rllk=packed_routing,
        **fields,
    )


def _routing_parts(batch: RolloutBatch, prompt_mask, lengths, valid):
    """Per rollout, (its prompt's routing `[P_i, layers, k]`, its completion's `[T_i, ...]`)
    out of `batch.routing_bslk` (None when the batch has no routing)."""
    if batch.routing_bslk is None:
        return None
    routing = np.asarray(batch.routing_bslk)
    p = prompt_mask.shape[1]
    empty = routing[0, :0]
    return [
        (routing[i, :p][prompt_mask[i]], routing[i, p : p + lengths[i]])
        if valid[i]
        else (empty, empty)
        for i in range(len(routing))
    ]


def _pack_routing(routing, where, placement, owners_g, shape, layers_k) -> np.ndarray:
    """`routing_rllk` (module docstring): each packed token's routing record, -1 elsewhere.
    `where[i] = (group, unit, part)`: rollout i's completion is part `part` of the unit (0:
    the plain layout's `[prompt, completion]` sequence); `owners_g[g][u]` the rollouts of a
    shared unit (its prompt's record is the first one's)."""
    rows_per_group = shape[0] // max(len(placement), 1)
    out = np.full((*shape, *layers_k), -1, np.int16)
    for i, (g, u, j) in where.items():
        r, cols = placement[g][u]
        row = g * rows_per_group + r
        prompt, completion = routing[i]
        if j == 0:  # the plain layout: prompt and completion as one sequence
            sequence = np.concatenate([prompt, completion])
            out[row, cols[0] : cols[0] + len(sequence)] = sequence
            continue
        out[row, cols[j] : cols[j] + len(completion)] = completion
        if owners_g[g][u][0] == i:  # the unit's prompt, once: its first rollout's record
            out[row, cols[0] : cols[0] + len(prompt)] = prompt
    return out


# `Trainer(pack_length=AUTO)`: a row length derived from each batch's shapes.
AUTO = "auto"
# A packed row's attention is dense over the row, so its cost grows with the row's length
# (bench/shared_prompt.py: rows of 12 sequences made the step 6.5x the padded one): auto rows
# are at most this many padded rows long.
AUTO_MAX_ROWS = 4


def auto_row_length(batch: RolloutBatch) -> int:
    """The rows `pack_length="auto"` packs `batch` into: one GRPO group's `[prompt, c_1, ...,
    c_G]` unit at full length, `P + G * T` (P and T the batch's padded prompt and completion
    widths, G its largest group), at most `AUTO_MAX_ROWS * (P + T)`. Every rollout fits a row
    (the packed step is the padded one's, exactly), a group's completions share one copy of its
    prompt as far as the row allows, and the length is a function of the batch's shapes, so the
    step compiles once per padded shape as before (rows per group are bucketed)."""
    group_ids = np.asarray(batch.group_id_b)[np.asarray(batch.valid_b).astype(bool)]
    largest = int(np.unique(group_ids, return_counts=True)[1].max()) if group_ids.size else 1
    padded_row = batch.prompt_len + batch.completion_len
    return min(batch.prompt_len + largest * batch.completion_len, AUTO_MAX_ROWS * padded_row)


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

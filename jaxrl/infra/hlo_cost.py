"""Per-kernel costs of a compiled program (XLA:CPU, XLA:GPU, TPU), read from its optimized HLO
text, with loops counted as many times as they run.

`compiled.cost_analysis()` sums the whole module and counts a while loop's body once (scanned
layers, decode loops, RNG rounds), so it cannot time a program whose work sits in loops. This
walks the executed instructions instead: every instruction of the entry computation, of called
computations, and of while bodies (times the trip count: XLA's `known_trip_count`, else
`default_trips`) that is a kernel on XLA:CPU (a fusion, dot, copy, custom call, ...; not
parameters, constants, tuples, bitcasts). Per kernel k:

    flops_k = sum over its dots of 2 * prod(output dims) * prod(contracted dims)
    bytes_k = bytes of its operands + bytes of its output

except, as XLA's own cost analysis does, where a kernel touches only part of a buffer: an operand
read only through slices counts the slices, a buffer updated in place (`dynamic-update-slice`,
`scatter` into an operand) counts the update written, not the whole buffer (the decode loop's KV
cache writes, the engine's cache prefix).

(elementwise arithmetic is not counted as FLOPs: it is bound by its bytes). A conditional
counts its most expensive branch.

XLA's own cost analysis differs there on GPU programs: it counts a fused gather as reading its
whole operand (32 embedding rows of Llama 3 8B: 1.05 GB, the table) and a fused scatter as reading
and writing its whole operand (one key per row into a 134 MB cache layer: 268 MB).

Pallas kernels (custom calls XLA cannot look into) are counted by `KERNEL_MODELS`, keyed by the
kernel's name (the `pallas_call` name in the instruction's metadata): FLOPs of the matmuls the
kernel runs, bytes of its operands read once and outputs written once (a kernel's re-reads of a
K / V block across query blocks are served by the L2 cache: 1 MB per head at 2,048 tokens); a
custom call without a model counts its operands and outputs and no FLOPs.
"""

from __future__ import annotations

import dataclasses
import math
import re

FREE = {
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
    "opt-barrier", "partition-id", "replica-id",
}  # fmt: skip
CONTROL = {"while", "call", "conditional"}
_HEAD = re.compile(r"^(ENTRY )?%?([\w.\-]+) \(.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*)$")
_OPCODE = re.compile(r"([a-z][a-z0-9\-]*)\(")
# Element types: pred, s8 / u32 / f16 ..., bf16, complex, and the small floats (f8e4m3fn,
# f8e5m2, f4e2m1fn ...: their width is the digit after the f).
_ARRAY = re.compile(r"\b(pred|f\de\dm\d\w*|[suf]\d+|bf16|c64|c128)\[([\d,]*)\]")
_BITS = {"pred": 8, "bf16": 16, "c64": 64, "c128": 128}


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape string (an array or a tuple of arrays)."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        bits = _BITS.get(dtype) or int(re.match(r"[suf](\d+)", dtype).group(1))
        total += math.prod(int(d) for d in dims.split(",") if d) * bits // 8
    return total


def _dims(shape: str) -> list[int]:
    match = _ARRAY.search(shape)
    return [int(d) for d in match.group(2).split(",") if d] if match else []


@dataclasses.dataclass
class _Instr:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    attrs: str
    args: str = ""  # the text inside the opcode's parentheses (a parameter's index)
    root: bool = False


def _split(rhs: str) -> tuple[str, str, list[str], str]:
    match = _OPCODE.search(rhs)
    shape, opcode = rhs[: match.start()].strip(), match.group(1)
    depth, i = 0, match.end() - 1
    for i in range(match.end() - 1, len(rhs)):
        depth += {"(": 1, ")": -1}.get(rhs[i], 0)
        if depth == 0:
            break
    args = rhs[match.end() : i]
    return shape, opcode, re.findall(r"%([\w.\-]+)", args), rhs[i + 1 :], args


def parse_module(text: str) -> tuple[dict[str, list[_Instr]], str]:
    """{computation name: instructions}, and the entry computation's name."""
    computations: dict[str, list[_Instr]] = {}
    current, entry = None, None
    for line in text.splitlines():
        if current is None:
            head = _HEAD.match(line)
            if head:
                current = head.group(2)
                computations[current] = []
                entry = current if head.group(1) else entry
            continue
        if line.strip() == "}":
            current = None
            continue
        instr = _INSTR.match(line)
        if instr and _OPCODE.search(instr.group(2)):
            parsed = _Instr(instr.group(1), *_split(instr.group(2)))
            parsed.root = line.lstrip().startswith("ROOT ")
            computations[current].append(parsed)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text: pass compiled.as_text()")
    return computations, entry


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One executed kernel: dot FLOPs and bytes per execution, and how many times it runs."""

    name: str
    flops: float
    bytes: float
    count: int
    opcode: str = ""  # "fusion", or the lone instruction's opcode ("all-reduce", "dot", ...)
    group: int = 0  # a collective's devices per group (0: all of them, or not a collective)


def _conv_flops(instr: _Instr, shapes: dict[str, str]) -> float:
    """2 x output elements x the input features x the window taps that meet the input (the TPU
    compiler's matmuls are convolutions; one with a window over a size-1 dim padded on both
    sides, `window={size=32 pad=31_31}`, multiplies each output by one input element)."""
    labels = re.search(r"dim_labels=(\w+)_(\w+)->\w+", instr.attrs)
    if not labels or len(instr.operands) < 2:
        return 0.0
    lhs = _dims(shapes.get(instr.operands[0], ""))
    rhs = _dims(shapes.get(instr.operands[1], ""))
    lhs_labels, rhs_labels = labels.groups()
    if len(lhs) != len(lhs_labels) or len(rhs) != len(rhs_labels):
        return 0.0
    window = re.search(r"window=\{size=([\dx]+)", instr.attrs)
    sizes = [int(x) for x in window.group(1).split("x")] if window else []
    k = rhs[rhs_labels.index("i")]
    for d, size in enumerate(sizes):
        k *= min(size, lhs[lhs_labels.index(str(d))])
    return 2.0 * math.prod(_dims(instr.shape)) * k


def _dot_flops(instrs: list[_Instr]) -> float:
    shapes = {i.name: i.shape for i in instrs}
    flops = 0.0
    for i in instrs:
        if i.opcode == "convolution":
            flops += _conv_flops(i, shapes)
            continue
        if i.opcode != "dot":
            continue
        contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", i.attrs)
        lhs = _dims(shapes.get(i.operands[0], ""))
        k = math.prod(lhs[int(d)] for d in contracting.group(1).split(",") if d) if lhs else 1
        flops += 2.0 * math.prod(_dims(i.shape)) * k
    return flops


def kernels(text: str, default_trips: int = 1) -> list[Kernel]:
    """The kernels a run of the program executes (see the module docstring)."""
    computations, entry = parse_module(text)
    out: list[Kernel] = []

    def attr(instr: _Instr, key: str) -> str:
        return re.search(key + r"=%?([\w.\-]+)", instr.attrs).group(1)

    def walk(name: str, times: int) -> None:
        instrs = computations[name]
        shapes = {i.name: i.shape for i in instrs}
        for i in instrs:
            if i.opcode in FREE:
                continue
            if i.opcode == "while":
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', i.attrs)
                cond, body = attr(i, "condition"), attr(i, "body")
                counted = _trip_count(computations.get(cond, []), computations.get(body, []))
                n = int(trips.group(1)) if trips else counted or default_trips
                walk(body, times * n)
                walk(cond, times * (n + 1))
            elif i.opcode == "call":
                walk(attr(i, "to_apply"), times)
            elif i.opcode == "conditional":
                branches = re.findall(r"%([\w.\-]+)", i.attrs.split("branch_computations=")[-1])
                branches = [b for b in branches if b in computations][:8]
                costs = []
                for b in branches:
                    before = len(out)
                    walk(b, times)
                    costs.append((sum(k.flops + k.bytes for k in out[before:]), out[before:]))
                    del out[before:]
                if costs:
                    out.extend(max(costs, key=lambda c: c[0])[1])
            elif i.opcode == "custom-call" and (model := _kernel_model(i, shapes)):
                out.append(Kernel(i.name, *model, times, i.opcode))
            else:
                calls = re.search(r"calls=%([\w.\-]+)", i.attrs)
                if calls and calls.group(1) in computations:
                    body = computations[calls.group(1)]
                    flops = _dot_flops(body)
                    moved = _fusion_bytes(i, body, shapes, computations)
                else:
                    flops = _dot_flops([i] + _operand_defs(i, shapes))
                    moved = _fusion_bytes(i, _as_body(i, shapes), shapes)
                out.append(Kernel(i.name, flops, moved, times, i.opcode, _group(i)))

    walk(entry, 1)
    return out


def _trip_count(condition: list[_Instr], body: list[_Instr]) -> int | None:
    """A loop's trip count from its condition `counter < constant(N)` and the body's
    `counter + constant(k)` (a counter from 0, as XLA emits the loops it writes, e.g. the TPU
    compiler's windowed einsums, whose backend config carries no `known_trip_count`; k is 2 in
    a loop unrolled twice); None for any other loop."""
    root = next((i for i in condition if i.root), None)
    if root is None or root.opcode != "compare" or "direction=LT" not in root.attrs:
        return None
    by_name = {i.name: i for i in condition}
    counter = by_name.get(root.operands[0])
    bound = by_name.get(root.operands[1]) if len(root.operands) > 1 else None
    if counter is None or counter.opcode != "get-tuple-element" or bound is None:
        return None
    index = re.search(r"index=(\d+)", counter.attrs)
    if bound.opcode != "constant" or not bound.args.strip().isdigit() or index is None:
        return None
    step = 1
    body_root = next((i for i in body if i.root), None)
    by_name = {i.name: i for i in body}
    if body_root is not None and body_root.opcode == "tuple":
        update = by_name.get(body_root.operands[int(index.group(1))])
        if update is not None and update.opcode == "add":
            steps = [by_name.get(o) for o in update.operands]
            constant = next((x for x in steps if x is not None and x.opcode == "constant"), None)
            if constant is not None and constant.args.strip().isdigit():
                step = max(int(constant.args), 1)
    return -(-int(bound.args) // step)


IN_PLACE = {"dynamic-update-slice": 1, "scatter": 2}  # opcode: index of the update operand
SLICES = {"dynamic-slice", "slice", "gather"}


def _users(body: list[_Instr]) -> dict[str, list[_Instr]]:
    users: dict[str, list[_Instr]] = {}
    for i in body:
        for o in i.operands:
            users.setdefault(o, []).append(i)
    return users


def _params(body: list[_Instr]) -> dict[int, _Instr]:
    return {int(i.args): i for i in body if i.opcode == "parameter" and i.args.isdigit()}


def _relayout(instr: _Instr, computations: dict[str, list[_Instr]] | None) -> bool:
    """Whether `instr` only lays its one operand out anew: a copy, a bitcast, or a fusion of
    them (the TPU compiler retiles stacked int8 weights this way before slicing a layer)."""
    if len(instr.operands) != 1:
        return False
    if instr.opcode in ("copy", "bitcast"):
        return True
    calls = re.search(r"calls=%([\w.\-]+)", instr.attrs)
    nested = computations.get(calls.group(1)) if calls and computations else None
    if instr.opcode != "fusion" or not nested:
        return False
    return all(i.opcode in ("parameter", "copy", "bitcast") for i in nested)


def _sliced_read(
    param: _Instr, body: list[_Instr], computations: dict[str, list[_Instr]] | None, depth: int = 0
) -> int | None:
    """Bytes read of a fused computation's parameter used only through slices, directly, through
    relayouts (`_relayout`) or through fusions nested in it (the TPU compiler nests a layer's
    dynamic slice of stacked weights in the matmul's fusion); None if any use reads it whole."""
    us = _users(body).get(param.name, [])
    if not us or depth > 4:
        return None
    total = 0
    for u in us:
        if u.opcode in SLICES and u.operands[0] == param.name:
            total += shape_bytes(u.shape)
            continue
        if _relayout(u, computations):  # its slices read the elements they select, no more
            read = _sliced_read(u, body, computations, depth + 1)
            if read is None:
                return None
            total += read
            continue
        calls = re.search(r"calls=%([\w.\-]+)", u.attrs)
        nested = computations.get(calls.group(1)) if calls and computations else None
        if u.opcode != "fusion" or nested is None:
            return None
        for index, operand in enumerate(u.operands):
            if operand != param.name:
                continue
            inner = _params(nested).get(index)
            read = None if inner is None else _sliced_read(inner, nested, computations, depth + 1)
            if read is None:
                return None
            total += read
    return total


def _fusion_bytes(
    instr: _Instr,
    body: list[_Instr],
    shapes: dict[str, str],
    computations: dict[str, list[_Instr]] | None = None,
) -> int:
    """Bytes a kernel moves: its operands (as read) and its outputs (as written)."""
    inner = {i.name: i for i in body}
    users = _users(body)
    params = _params(body)
    total = 0
    for index, name in enumerate(instr.operands):
        param = params.get(index)
        us = users.get(param.name, []) if param else []
        read = _sliced_read(param, body, computations) if param is not None else None
        if read is not None:
            total += read
        elif us and all(u.opcode in IN_PLACE and u.operands[0] == param.name for u in us):
            continue  # updated in place: the write is counted with the outputs
        else:
            total += shape_bytes(shapes.get(name, ""))
    root = next((i for i in body if i.root), None)
    outs = (
        [inner[o] for o in root.operands if o in inner]
        if root and root.opcode == "tuple"
        else [root]
    )
    for out in outs:
        if out is None:
            continue
        if out.opcode in IN_PLACE:
            update = out.operands[IN_PLACE[out.opcode]]
            total += shape_bytes(inner[update].shape if update in inner else "")
        else:
            total += shape_bytes(out.shape)
    return total


def _as_body(instr: _Instr, shapes: dict[str, str]) -> list[_Instr]:
    """A lone instruction as a one-instruction fused computation (its operands as parameters)."""
    params = [
        _Instr(f"p{k}", shapes.get(o, ""), "parameter", [], "", str(k))
        for k, o in enumerate(instr.operands)
    ]
    lone = dataclasses.replace(instr, operands=[f"p{k}" for k in range(len(params))], root=True)
    return params + [lone]


def _operand_defs(instr: _Instr, shapes: dict[str, str]) -> list[_Instr]:
    """Stand-ins carrying the operands' shapes (for a dot outside a fusion)."""
    return [_Instr(o, shapes.get(o, ""), "parameter", [], "") for o in instr.operands]


COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")


def _group(instr: _Instr) -> int:
    """Devices per group of a collective: `replica_groups={{0,1},{2,3}}` (listed) or
    `replica_groups=[4,2]<=[8]` (iota: 4 groups of 2); a collective-permute pairs devices (2);
    0 for all devices (`{}`) and for anything that is not a collective."""
    if instr.opcode.removesuffix("-start") not in COLLECTIVES:
        return 0
    if instr.opcode.startswith("collective-permute"):
        return 2
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]", instr.attrs)
    if iota:
        return int(iota.group(2))
    listed = re.search(r"replica_groups=\{\{([\d,]*)\}", instr.attrs)
    return len(listed.group(1).split(",")) if listed else 0


def collectives(ks: list[Kernel]) -> tuple[tuple[int, int], ...]:
    """(devices per group, executions) of a run's collectives, by group size (an async pair
    `*-start` / `*-done` counts once)."""
    counts: dict[int, int] = {}
    for k in ks:
        if k.opcode.removesuffix("-start") in COLLECTIVES:
            counts[k.group] = counts.get(k.group, 0) + k.count
    return tuple(sorted(counts.items()))


def totals(ks: list[Kernel]) -> tuple[float, float, int]:
    """(dot FLOPs, bytes, kernel launches) of a run."""
    return (
        sum(k.flops * k.count for k in ks),
        sum(k.bytes * k.count for k in ks),
        sum(k.count for k in ks),
    )


# --- Pallas kernels -------------------------------------------------------------------------------

# Query / key blocks the fused attention kernels skip above the diagonal: a causal mask visits
# (n + 1) / 2n of an n x n grid of tiles (`gpu_attention.block_visits`; padding, packing and
# shared prompts skip more, which the program's shapes do not say).
ATTENTION_BLOCK = 64


def _causal_share(t: int) -> float:
    n = max(t // ATTENTION_BLOCK, 1)
    return (n + 1) / (2 * n)


def _flash(matmuls: int):
    """A fused-attention kernel of `matmuls` [T, T] x [T, D] products per head (forward 2: scores,
    output; dq 3: scores, dp, dq; dk / dv 4: scores, dp, dv, dk), q `[B, T, H, D]` its second
    operand; bytes: operands and outputs once."""

    def model(operands: list[str], output: str) -> tuple[float, float]:
        b, t, h, d = _dims(operands[1])
        flops = matmuls * 2.0 * b * h * t * t * d * _causal_share(t)
        return flops, sum(shape_bytes(x) for x in operands) + shape_bytes(output)

    return model


def _decode(q: int):
    """`decode_kernel` (q operand 2) / `decode_kernel_tpu` (q operand 3): q `[B, K, Gp, D]`
    against keys / values `[L, B, C, K, D]` (layer l read) or `[B, C, K, D]`, the two operands
    after q: each row's keys and values read once, at the cache's length (positions past a row's
    length are not read: a plan's cache is as long as the span)."""

    def model(operands: list[str], output: str) -> tuple[float, float]:
        b, kv, gp, d = _dims(operands[q])
        dims = _dims(operands[q + 1])
        layers = dims[0] if len(dims) == 5 else 1
        c = dims[-3]
        cache = sum(shape_bytes(x) for x in operands[q + 1 : q + 3]) // layers
        rest = sum(shape_bytes(x) for i, x in enumerate(operands) if i not in (q + 1, q + 2))
        return 4.0 * b * kv * gp * c * d, cache + rest + shape_bytes(output)

    return model


TPU_ATTENTION_BLOCK = 256  # `tpu_attention.flash_attention`'s default blocks


def _tpu_flash(matmuls: int, streamed: tuple[int, ...]):
    """A `tpu_attention` kernel, q `[B, H, T, D]` its second operand: FLOPs as `_flash`; bytes:
    operands and outputs once, plus the `streamed` operands fetched again for every visited tile
    (a TPU has no cache to keep them: the kv blocks per q block and q head in the forward and dq,
    the q / dout blocks per kv block in dk / dv)."""

    def model(operands: list[str], output: str) -> tuple[float, float]:
        b, h, t, d = _dims(operands[1])
        share = _causal_share(t)
        tiles = max(t // TPU_ATTENTION_BLOCK, 1) * share
        again = sum(shape_bytes(operands[i]) for i in streamed)
        kv_heads = _dims(operands[2])[1]
        repeats = tiles * (h // kv_heads if streamed == (2, 3) else 1)
        flops = matmuls * 2.0 * b * h * t * t * d * share
        once = sum(shape_bytes(x) for x in operands) + shape_bytes(output)
        return flops, once + again * max(repeats - 1, 0)

    return model


def _grouped(operands: list[str], output: str) -> tuple[float, float]:
    """A grouped matmul (`jaxrl.models.grouped_matmul`; megablox `gmm` / `tgmm`): FLOPs of each
    row through its own group's matrix only, `2 M K N`; `gmm` out `[M, N]` from lhs `[M, K]`,
    `tgmm` out `[G, K, N]` from lhs `[K, M]` (M rows of all groups together); bytes: operands
    and output once."""
    out = _dims(output)
    arrays = [_dims(x) for x in operands]
    # The kernel's first vector operand, group offsets `[G + 1]` (after a scalar, the tiles to
    # visit); a device holding G_local of the G groups (`group_offset`) multiplies their rows
    # only: M G_local / G on average.
    offsets = next((a for a in arrays if len(a) == 1), None)
    groups = offsets[0] - 1 if offsets else 0
    if len(out) == 2:
        lhs = next((a for a in arrays if len(a) == 2 and a[0] == out[0]), None)
        rhs = next((a for a in arrays if len(a) == 3), None)
        flops = 2.0 * out[0] * out[1] * lhs[1] if lhs else 0.0
        local = rhs[0] if rhs else groups
    else:
        lhs = next((a for a in arrays if len(a) == 2 and out[1] in a), None)
        flops = 2.0 * out[2] * math.prod(lhs) if lhs else 0.0
        local = out[0]
    share = local / groups if 0 < local < groups else 1.0
    return flops * share, sum(shape_bytes(x) for x in operands) + shape_bytes(output)


def _grouped_gpu(transposed_lhs: bool):
    """The Triton grouped matmul (`jaxrl.models.grouped_matmul_gpu`): FLOPs of each row through
    its own group's matrix, `2 M K N` (the grouped work; the kernels' masked products where
    groups share a 16-row block, at most `(G - 1) 16` rows more, are not counted, nor are
    megablox's on its shared tiles).
    `gmm` (forward, and dx with w read transposed): operands (tile groups, tile counts, offsets
    `[G + 1]`, first, x `[M, C]`, w), out `[M, O]`; `tgmm`: operands (offsets, first, x `[M, K]`,
    dy `[M, N]`), out `[G_held, K, N]`. A device holding G_held of the G groups multiplies their
    rows only: `G_held / G` of the rows on average. Bytes: operands and output once."""

    def model(operands: list[str], output: str) -> tuple[float, float]:
        out = _dims(output)
        arrays = [_dims(x) for x in operands]
        if transposed_lhs:
            groups = arrays[0][0] - 1
            (m, k), n, held = arrays[2], out[2], out[0]
        else:
            groups = arrays[2][0] - 1
            (m, k), n, held = arrays[4], out[1], arrays[5][0]
        share = held / groups if 0 < held < groups else 1.0
        moved = sum(shape_bytes(x) for x in operands) + shape_bytes(output)
        return 2.0 * m * k * n * share, moved

    return model


KERNEL_MODELS = {
    "flash_attention_forward": _flash(2),
    "flash_attention_dq": _flash(3),
    "flash_attention_dkdv": _flash(4),
    "decode_attention_in_place": _decode(2),
    "tpu_flash_attention_forward": _tpu_flash(2, (2, 3)),
    "tpu_flash_attention_dq": _tpu_flash(3, (2, 3)),
    "tpu_flash_attention_dkdv": _tpu_flash(4, (1, 4)),
    "decode_attention_in_place_tpu": _decode(3),
    "gmm": _grouped,
    "tgmm": _grouped,
    "grouped_matmul_gpu": _grouped_gpu(False),
    "grouped_matmul_gpu_t": _grouped_gpu(False),
    "grouped_matmul_gpu_tgmm": _grouped_gpu(True),
}


def _kernel_model(instr: _Instr, shapes: dict[str, str]) -> tuple[float, float] | None:
    """(FLOPs, bytes) of a Pallas kernel's custom call from `KERNEL_MODELS`, None for others."""
    op_name = re.search(r'op_name="([^"]*)"', instr.attrs)
    if not op_name:
        return None
    # A scope's name, also inside transformations (`transpose(jvp(jit(gmm)))`: a kernel of a
    # jitted function's gradient).
    path = set(re.findall(r"[\w.\-<>]+", op_name.group(1)))
    for name, model in KERNEL_MODELS.items():
        if name in path:
            return model([shapes.get(o, "") for o in instr.operands], instr.shape)
    return None


def dims(shape: str) -> list[int]:
    """The dimensions of an HLO array shape (`bf16[8,2048]` -> [8, 2048])."""
    return _dims(shape)


def largest_arrays(text: str, count: int | None = 5) -> list[tuple[str, int]]:
    """The `count` largest arrays produced by instructions of the program's unfused computations
    (the entry, loop bodies, called computations: the buffers a program allocates; a fusion's
    inner values live in registers), as (shape, bytes), largest first; parameters excluded."""
    computations, _ = parse_module(text)
    fused = set()
    for instrs in computations.values():
        for i in instrs:
            if i.opcode == "fusion" or i.opcode == "custom-call" or i.opcode in ("reduce", "map"):
                fused.update(re.findall(r"(?:calls|to_apply)=%([\w.\-]+)", i.attrs))
    sizes: dict[str, int] = {}
    for name, instrs in computations.items():
        if name in fused:
            continue
        for i in instrs:
            if i.opcode in FREE:
                continue
            for dtype, dims in _ARRAY.findall(i.shape):
                shape = f"{dtype}[{dims}]"
                sizes[shape] = max(sizes.get(shape, 0), shape_bytes(shape))
    return sorted(sizes.items(), key=lambda x: -x[1])[:count]


def largest_collectives(text: str, count: int = 3) -> list[tuple[str, str, int, int, str]]:
    """The `count` largest collectives of a compiled program's HLO text (any computation; an
    async `*-start` once), as (opcode, largest array shape, its bytes, devices per group, the
    op_name of the JAX operation it came from), largest first."""
    computations, _ = parse_module(text)
    found = []
    for instrs in computations.values():
        for i in instrs:
            opcode = i.opcode.removesuffix("-start")
            if opcode not in COLLECTIVES:
                continue
            arrays = [f"{t}[{d}]" for t, d in _ARRAY.findall(i.shape)]
            if not arrays:
                continue
            shape = max(arrays, key=shape_bytes)
            op_name = re.search(r'op_name="([^"]*)"', i.attrs)
            found.append(
                (opcode, shape, shape_bytes(shape), _group(i), op_name.group(1) if op_name else "")
            )
    return sorted(found, key=lambda x: -x[2])[:count]

"""Synthetic arithmetic: the embedded default task (a tiny model learns it on a CPU in minutes).

A problem is `a op b` with operands drawn uniformly from the operand range (`min_digits` to
`max_digits` digits; 0-99 for the default 1-2 digit addition). Its prompt is `"37+45="` and its
answer the exact result `"82"`; an SFT demonstration is prompt + answer + `<eos>`.

Everything is a pure function of the task's fields, with no random state and no dependence on
library versions: draws come from BLAKE2b hashes of (seed, split, index, attempt). So

- `problem(i, split)` is the i-th problem of a split: a data iterator's position is one integer,
  and a resumed run sees exactly the same problems;
- the held-out split is the set of problems whose hash (keyed by the seed only) falls below
  `heldout_fraction`; training draws reject them, so the splits are disjoint by construction, for
  any number of digits, without enumerating the problem space.

Reward (`arithmetic_reward`): 1.0 when the completion, up to `<eos>` and without surrounding
spaces, is exactly an ASCII integer equal to the answer, else 0.0.
"""

from __future__ import annotations

import dataclasses
import hashlib
import operator
import re
from collections.abc import Iterator

import numpy as np

from jaxrl.tasks.tokenizer import EOS_TOKEN

OPERATORS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
SPLITS = ("train", "heldout")
MAX_DIGITS = 9
# Completions are a few characters; anything longer than this is wrong without being parsed.
MAX_COMPLETION_CHARS = 256
_INTEGER = re.compile(r"-?[0-9]{1,32}")
_MAX_ATTEMPTS = 10_000


def hash_u64(*parts: object) -> int:
    """A stable 64-bit hash of `parts` (blake2b of their "/"-joined text): seeded draws."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


@dataclasses.dataclass(frozen=True)
class ArithmeticProblem:
    a: int
    op: str
    b: int

    @property
    def prompt(self) -> str:
        return f"{self.a}{self.op}{self.b}="

    @property
    def answer(self) -> str:
        return str(OPERATORS[self.op](self.a, self.b))


@dataclasses.dataclass(frozen=True, kw_only=True)
class ArithmeticTask:
    """Problem generator and split definition (see the module docstring).

    Attributes:
      min_digits, max_digits: operand range [0 or 10^(min-1), 10^max - 1].
      operators: any of "+-*", drawn uniformly.
      heldout_fraction: fraction of the problem space reserved for evaluation, in (0, 1).
      seed: defines the split and the problem streams.
    """

    min_digits: int = 1
    max_digits: int = 2
    operators: str = "+"
    heldout_fraction: float = 0.1
    seed: int = 0

    def __post_init__(self):
        if not 1 <= self.min_digits <= self.max_digits <= MAX_DIGITS:
            raise ValueError(
                f"need 1 <= min_digits <= max_digits <= {MAX_DIGITS}; got "
                f"{self.min_digits}, {self.max_digits}"
            )
        if (
            not self.operators
            or set(self.operators) - set(OPERATORS)
            or (len(set(self.operators)) != len(self.operators))
        ):
            raise ValueError(
                f"operators must be distinct characters of '+-*', got {self.operators!r}"
            )
        if not 0.0 < self.heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction must be in (0, 1), got {self.heldout_fraction}")

    @property
    def operand_range(self) -> tuple[int, int]:
        low = 0 if self.min_digits == 1 else 10 ** (self.min_digits - 1)
        return low, 10**self.max_digits - 1

    @property
    def num_problems(self) -> int:
        low, high = self.operand_range
        return len(self.operators) * (high - low + 1) ** 2

    def is_heldout(self, problem: ArithmeticProblem) -> bool:
        threshold = self.heldout_fraction * 2.0**64
        return hash_u64("heldout", self.seed, problem.a, problem.op, problem.b) < threshold

    def problem(self, index: int, split: str = "train") -> ArithmeticProblem:
        """The `index`-th problem of `split`, deterministic in (fields, split, index)."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        low, high = self.operand_range
        size = high - low + 1
        want_heldout = split == "heldout"
        for attempt in range(_MAX_ATTEMPTS):
            h = hash_u64("draw", self.seed, split, index, attempt)
            # 64-bit hash: modulo bias below 1e-9 for these ranges.
            op = self.operators[h % len(self.operators)]
            h //= len(self.operators)
            candidate = ArithmeticProblem(low + h % size, op, low + (h // size) % size)
            if self.is_heldout(candidate) == want_heldout:
                return candidate
        raise RuntimeError(
            f"no {split} problem found in {_MAX_ATTEMPTS} draws: the {split} split of this task "
            f"({self.num_problems} problems, heldout_fraction={self.heldout_fraction}) is empty "
            "or nearly so; change heldout_fraction or the digit range"
        )

    def problems(self, split: str = "train", start: int = 0) -> Iterator[ArithmeticProblem]:
        """Endless stream `problem(start), problem(start + 1), ...` of a split."""
        index = start
        while True:
            yield self.problem(index, split)
            index += 1

    def heldout_problems(self, limit: int | None = None) -> list[ArithmeticProblem]:
        """Distinct held-out problems in a fixed order: all of them when the space is enumerable
        (<= 10^6 problems), else the first `limit` distinct draws of the held-out stream."""
        if self.num_problems <= 1_000_000:
            low, high = self.operand_range
            found = [
                p
                for op in self.operators
                for a in range(low, high + 1)
                for b in range(low, high + 1)
                if self.is_heldout(p := ArithmeticProblem(a, op, b))
            ]
            found.sort(key=lambda p: hash_u64("order", self.seed, p.a, p.op, p.b))
            return found if limit is None else found[:limit]
        if limit is None:
            raise ValueError(f"{self.num_problems} problems: pass a limit for the held-out set")
        seen: dict[ArithmeticProblem, None] = {}
        index = 0
        while len(seen) < limit:
            seen.setdefault(self.problem(index, "heldout"))
            index += 1
        return list(seen)


def demonstration(problem: ArithmeticProblem, eos_token: str = EOS_TOKEN) -> str:
    """SFT text: prompt + answer + eos, e.g. `"37+45=82<eos>"`."""
    return f"{problem.prompt}{problem.answer}{eos_token}"


def encode_demonstrations(
    problems: list[ArithmeticProblem], tokenizer, seq_len: int
) -> tuple[np.ndarray, np.ndarray]:
    """Tokenised SFT batch: `(tokens_bs int32, loss_mask_bs bool)`, right-padded to `seq_len`.

    `tokens = <bos> prompt answer <eos> <pad>...`; `loss_mask_bs` is True on the answer and
    `<eos>` tokens (the ones the model must learn to emit), aligned with `tokens_bs`: a
    next-token loss uses logits at s-1 for targets at s where `loss_mask_bs[:, s]`.
    """
    return encode_prompt_targets([(p.prompt, p.answer) for p in problems], tokenizer, seq_len)


def encode_prompt_targets(
    pairs: list[tuple[str, str]], tokenizer, seq_len: int, hint: str = ""
) -> tuple[np.ndarray, np.ndarray]:
    """`encode_demonstrations` for (prompt, target) texts: `<bos> prompt target <eos> <pad>...`,
    the loss on the target and `<eos>`. A pair longer than `seq_len` raises, with `hint`."""
    tokens = np.full((len(pairs), seq_len), tokenizer.pad_token_id, np.int32)
    loss_mask = np.zeros((len(pairs), seq_len), bool)
    for i, (prompt, target) in enumerate(pairs):
        prompt_ids = tokenizer.encode(prompt)  # adds <bos>
        target_ids = tokenizer.encode(target, add_special_tokens=False)
        ids = prompt_ids + target_ids + [tokenizer.eos_token_id]
        if len(ids) > seq_len:
            raise ValueError(
                f"{prompt + target + EOS_TOKEN!r} needs {len(ids)} tokens > seq_len={seq_len}; "
                f"raise SFTConfig.seq_len{hint}"
            )
        tokens[i, : len(ids)] = ids
        loss_mask[i, len(prompt_ids) : len(ids)] = True
    return tokens, loss_mask


def parse_integer_answer(completion: str) -> int | None:
    """The integer a completion states, or None: the text up to `<eos>`, stripped, must be exactly
    an ASCII integer of at most 32 digits (so `int()` is cheap and '٣' is not 3)."""
    if not isinstance(completion, str):
        return None
    head = completion[:MAX_COMPLETION_CHARS]
    eos = head.find(EOS_TOKEN)
    if eos >= 0:
        head = head[:eos]
    elif len(completion) > MAX_COMPLETION_CHARS:
        return None
    head = head.strip()
    return int(head) if _INTEGER.fullmatch(head) else None


def arithmetic_reward(completion: str, answer: str) -> float:
    """1.0 if the completion's integer equals the reference answer, else 0.0."""
    predicted, reference = parse_integer_answer(completion), parse_integer_answer(answer)
    return float(predicted is not None and predicted == reference)

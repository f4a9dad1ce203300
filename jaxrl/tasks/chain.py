"""Chain sums: a long-tailed, verifiable task (multi-operand addition with written partial sums).

A problem is `k` one-digit operands, `k` in [min_operands, max_operands] (default 2..16). Its
prompt is `"3+5+9+2="` and its completion the chain of partial sums, comma separated, the last
one the answer: `"8,17,19"`. So the completion length grows with `k`: 1-2 characters for two
operands, about 50 for sixteen (25x), and `k` is drawn long-tailed, P(k) proportional to
1 / (k - 1): 30% of the prompts have two operands, 2% have sixteen. That is the workload of
reasoning RL in miniature (most completions short, a few long), on which a generator that waits
for its longest row wastes most of its slots.

Everything is a pure function of the task's fields (BLAKE2b hashes of (seed, split, index,
attempt)), as in `jaxrl.tasks.arithmetic`: `problem(i, split)` is the i-th problem of a split, and
the held-out split is the set of problems whose hash (keyed by the seed only) falls below
`heldout_fraction`; training draws reject them, so the splits are disjoint by construction.

Reward (`chain_reward`): 1.0 when the completion, up to `<eos>` and stripped, is comma-separated
ASCII integers (at most `MAX_COMPLETION_CHARS` characters) whose last one equals the sum, else
0.0. The partial sums are the model's written work: not checked, never evaluated as code.
`chain_partial_reward` ("chain_sum_partial") also credits the right leading partial sums of a
wrong answer (under 0.5: evaluations, which count a reward > 0.5 as correct, are unchanged).
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from jaxrl.tasks.arithmetic import encode_prompt_targets, hash_u64
from jaxrl.tasks.tokenizer import EOS_TOKEN

SPLITS = ("train", "heldout")
MAX_OPERANDS = 32
MAX_COMPLETION_CHARS = 256
_CHAIN = re.compile(r"[0-9]{1,8}(,[0-9]{1,8}){0,63}")
_PROMPT = re.compile(rf"[0-9](\+[0-9]){{1,{MAX_OPERANDS - 1}}}=")
_MAX_ATTEMPTS = 10_000


@dataclasses.dataclass(frozen=True)
class ChainProblem:
    operands: tuple[int, ...]

    @property
    def prompt(self) -> str:
        return "+".join(map(str, self.operands)) + "="

    @property
    def partial_sums(self) -> list[int]:
        return np.cumsum(self.operands)[1:].tolist()

    @property
    def completion(self) -> str:
        """The demonstration's completion: every partial sum after the first operand."""
        return ",".join(map(str, self.partial_sums))

    @property
    def answer(self) -> str:
        return str(sum(self.operands))


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChainTask:
    """Problem generator and split definition (see the module docstring).

    Attributes:
      min_operands, max_operands: the operand count k's range; P(k) ~ 1 / (k - 1).
      heldout_fraction: fraction of the problem space reserved for evaluation, in (0, 1).
      seed: defines the split and the problem streams.
    """

    min_operands: int = 2
    max_operands: int = 16
    heldout_fraction: float = 0.1
    seed: int = 0

    def __post_init__(self):
        if not 2 <= self.min_operands <= self.max_operands <= MAX_OPERANDS:
            raise ValueError(
                f"need 2 <= min_operands <= max_operands <= {MAX_OPERANDS}; got "
                f"{self.min_operands}, {self.max_operands}"
            )
        if not 0.0 < self.heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction must be in (0, 1), got {self.heldout_fraction}")

    @property
    def count_probabilities(self) -> dict[int, float]:
        """P(k) for each operand count k: proportional to 1 / (k - 1)."""
        ks = range(self.min_operands, self.max_operands + 1)
        weights = np.array([1.0 / (k - 1) for k in ks])
        return dict(zip(ks, (weights / weights.sum()).tolist(), strict=True))

    def max_completion_tokens(self) -> int:
        """The longest demonstration completion in characters (= tokens), `<eos>` included."""
        worst = ChainProblem((9,) * self.max_operands)
        return len(worst.completion) + 1

    def max_prompt_tokens(self) -> int:
        """The longest prompt in tokens, `<bos>` included."""
        return 2 * self.max_operands + 1

    def is_heldout(self, problem: ChainProblem) -> bool:
        threshold = self.heldout_fraction * 2.0**64
        return hash_u64("chain-heldout", self.seed, *problem.operands) < threshold

    def _draw(self, h: int) -> ChainProblem:
        # The count by inverse CDF on the top 24 bits, the digits from the rest (a second hash
        # when 16 operands need more than the 40 bits left).
        cdf = np.cumsum(list(self.count_probabilities.values()))
        u = (h >> 40) / 2.0**24
        k = self.min_operands + min(int(np.searchsorted(cdf, u, side="right")), len(cdf) - 1)
        digits, bits = [], h & ((1 << 40) - 1)
        for i in range(k):
            if i and i % 12 == 0:
                bits = hash_u64("chain-digits", h, i)
            digits.append(bits % 10)
            bits //= 10
        return ChainProblem(tuple(digits))

    def problem(self, index: int, split: str = "train") -> ChainProblem:
        """The `index`-th problem of `split`, deterministic in (fields, split, index)."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        want_heldout = split == "heldout"
        for attempt in range(_MAX_ATTEMPTS):
            candidate = self._draw(hash_u64("chain-draw", self.seed, split, index, attempt))
            if self.is_heldout(candidate) == want_heldout:
                return candidate
        raise RuntimeError(f"no {split} problem found in {_MAX_ATTEMPTS} draws")

    def heldout_problems(self, limit: int) -> list[ChainProblem]:
        """The first `limit` distinct problems of the held-out stream, in a fixed order."""
        seen: dict[ChainProblem, None] = {}
        index = 0
        while len(seen) < limit:
            seen.setdefault(self.problem(index, "heldout"))
            index += 1
        return list(seen)


def chain_demonstration(problem: ChainProblem, eos_token: str = EOS_TOKEN) -> str:
    """SFT text: prompt + chain + eos, e.g. `"3+5+9=8,17<eos>"`."""
    return f"{problem.prompt}{problem.completion}{eos_token}"


def encode_chain_demonstrations(
    problems: list[ChainProblem], tokenizer, seq_len: int
) -> tuple[np.ndarray, np.ndarray]:
    """`(tokens_bs int32, loss_mask_bs bool)` right-padded to `seq_len`: `<bos> prompt chain
    <eos> <pad>...`, the loss on the chain and `<eos>` (as `encode_demonstrations`)."""
    longest = max((len(p.operands) for p in problems), default=0)
    return encode_prompt_targets(
        [(p.prompt, p.completion) for p in problems], tokenizer, seq_len,
        f" (chain sums of up to {longest} operands)",
    )  # fmt: skip


def parse_chain_answer(completion: str) -> int | None:
    """The final sum a completion states, or None: the text up to `<eos>`, stripped, must be
    comma-separated ASCII integers (so '٣' is not 3 and nothing is evaluated)."""
    if not isinstance(completion, str):
        return None
    head = completion[:MAX_COMPLETION_CHARS]
    eos = head.find(EOS_TOKEN)
    if eos >= 0:
        head = head[:eos]
    elif len(completion) > MAX_COMPLETION_CHARS:
        return None
    head = head.strip()
    if not _CHAIN.fullmatch(head):
        return None
    return int(head.rsplit(",", 1)[-1])


def chain_reward(completion: str, answer: str) -> float:
    """1.0 if the chain's last number equals the reference sum, else 0.0."""
    predicted = parse_chain_answer(completion)
    return float(predicted is not None and str(predicted) == answer.strip())


def chain_partial_reward(prompt: str, completion: str, answer: str) -> float:
    """`chain_reward`, with partial credit for the written work when the answer is wrong:
    0.5 x (leading partial sums that are right) / (partial sums the prompt needs), so always
    under 0.5, and a reward > 0.5 (what evaluations count as correct) is exactly a right answer.

    The partial sums come from the prompt's operands (`"3+5+9+2="`, parsed as digits, never
    evaluated); a prompt that is not a chain, or a completion that is not one, earns 0.0."""
    if chain_reward(completion, answer):
        return 1.0
    if not isinstance(prompt, str) or not _PROMPT.fullmatch(prompt.strip()):
        return 0.0
    if parse_chain_answer(completion) is None:
        return 0.0
    want = ChainProblem(tuple(int(d) for d in prompt.strip()[:-1].split("+"))).partial_sums
    head = completion[:MAX_COMPLETION_CHARS].split(EOS_TOKEN, 1)[0].strip()
    right = 0
    for got, expected in zip(head.split(","), want, strict=False):
        if int(got) != expected:
            break
        right += 1
    # A wrong answer has at most all but the last partial sum right (more were written after).
    return 0.5 * min(right, len(want) - 1) / len(want)

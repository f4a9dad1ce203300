"""The workloads every side of `bench.peers` runs: prompts, rewards, per-step summaries.

Standard library and NumPy only: the peer sides import this module from their own virtual
environments (the repository root on `PYTHONPATH`).

Shapes:

- "tiny" (rlbench-tiny, DESIGN section 6): the library's random-init `rlbench_tiny` Llama
  (~3.4M parameters, vocab 512) exported as an HF folder with a word-level tokenizer whose token
  for id i is the text "i", so a prompt's text is its ids and every side tokenizes it to the same
  ids; 8 prompts of 16 random ids (3..511) x 4 samples, 32 new tokens at temperature 1; reward:
  the fraction of even ids in the completion.
- "smol" (SmolLM2-135M-Instruct): chat-templated arithmetic questions ("What is 37 + 48?"),
  G = 8, 128 new tokens at temperature 1; reward: 1 if the last integer in the completion is the
  answer.

Every side does one RL step as: sample G completions per prompt, score them, one GRPO update
(group mean/std advantages, clip 0.2, no KL term, one AdamW step over the whole batch) and
reports per step `generate_s` (sampling, to host tokens), `train_s` (the rest of the update,
through the optimizer step) and `step_s` (the whole step).
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
import statistics
import sys

import numpy as np


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    num_prompts: int
    samples: int
    prompt_len: int  # prompts are padded (left) to this many tokens
    new_tokens: int
    learning_rate: float = 1e-5
    temperature: float = 1.0

    @property
    def rows(self) -> int:
        return self.num_prompts * self.samples


TINY = Shape("tiny", num_prompts=8, samples=4, prompt_len=16, new_tokens=32)
TINY_SMOKE = Shape("tiny-smoke", num_prompts=2, samples=2, prompt_len=16, new_tokens=4)
SMOL = Shape("smol", num_prompts=4, samples=8, prompt_len=64, new_tokens=128, learning_rate=1e-6)
SHAPES = {s.name: s for s in (TINY, TINY_SMOKE, SMOL)}


def shape(name: str, **overrides) -> Shape:
    """The named shape; overrides that are set (not 0 / None) replace its fields."""
    if name not in SHAPES:
        raise SystemExit(f"unknown shape {name!r}; choose one of {sorted(SHAPES)}")
    return dataclasses.replace(SHAPES[name], **{k: v for k, v in overrides.items() if v})


def add_shape_flags(parser) -> None:
    """`--shape` and the overrides every side takes."""
    parser.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    parser.add_argument("--num_prompts", type=int, default=0, help="override the shape's")
    parser.add_argument("--samples", type=int, default=0, help="override the shape's G")
    parser.add_argument("--new_tokens", type=int, default=0, help="override the shape's")


def shape_from_args(args) -> Shape:
    return shape(
        args.shape,
        num_prompts=args.num_prompts,
        samples=args.samples,
        new_tokens=args.new_tokens,
    )


# --- prompts -------------------------------------------------------------------------------------


def tiny_prompt_ids(step: int, num_prompts: int, vocab_size: int = 512, length: int = 16):
    """Step `step`'s prompts: `num_prompts` lists of `length` ids in 3..vocab-1 (0-2 are pad,
    bos, eos), drawn from a generator seeded by the prompt's global index."""
    return [
        [
            int(t)
            for t in np.random.default_rng(step * num_prompts + i).integers(3, vocab_size, length)
        ]
        for i in range(num_prompts)
    ]


def tiny_prompt_texts(step: int, num_prompts: int, vocab_size: int = 512, length: int = 16):
    return [
        " ".join(map(str, ids)) for ids in tiny_prompt_ids(step, num_prompts, vocab_size, length)
    ]


def arithmetic(index: int) -> tuple[str, str]:
    """Question `index` (a user message) and its answer."""
    rng = random.Random(index)
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    op = rng.choice("+-*")
    answer = {"+": a + b, "-": a - b, "*": a * b}[op]
    return f"What is {a} {op} {b}? Think step by step, then give the number.", str(answer)


def smol_messages(step: int, num_prompts: int):
    """Step `step`'s chat prompts (one user message each) and their answers."""
    items = [arithmetic(step * num_prompts + i) for i in range(num_prompts)]
    return [[{"role": "user", "content": q}] for q, _ in items], [a for _, a in items]


# --- rewards -------------------------------------------------------------------------------------


def even_ids(completions: list[str]) -> list[float]:
    """The tiny shape's reward: the fraction of even ids in each completion's text."""
    out = []
    for text in completions:
        ids = [int(t) for t in text.split() if t.isdigit()]
        out.append(sum(i % 2 == 0 for i in ids) / max(len(ids), 1))
    return out


def arithmetic_correct(completions: list[str], answers: list[str]) -> list[float]:
    """The smol shape's reward: 1 if the completion's last integer is the answer."""
    out = []
    for text, answer in zip(completions, answers, strict=True):
        numbers = re.findall(r"-?\d+", text.replace(",", ""))
        out.append(float(bool(numbers) and numbers[-1] == answer))
    return out


# --- what each side prints -----------------------------------------------------------------------


def summarise(steps: list[dict], warmup: int) -> dict:
    """Medians over the steps after `warmup` (compiles, caches) of each phase."""
    window = steps[warmup:] or steps[-1:]
    row = {"steps_measured": len(window)}
    for key in ("step_s", "generate_s", "train_s"):
        row[key] = statistics.median(s[key] for s in window)
    row["first_step_s"] = steps[0]["step_s"]
    row["steps_s"] = [round(s["step_s"], 4) for s in steps]
    row["completion_tokens"] = statistics.median(s.get("completion_tokens", 0) for s in window)
    return row


def generation_summary(times: list[float], tokens: list[int], rounds: int, ids) -> dict:
    """A generation side's figures: per-call seconds and tokens, tokens/s over the timed calls
    (all but the first, a warm-up, when there were `rounds` after it), the first call's seconds
    and the mean prompt length of `ids`."""
    window = slice(1, None) if rounds else slice(0, None)
    total_s, total_tokens = sum(times[window]), sum(tokens[window])
    return dict(
        seconds=total_s / len(times[window]),
        tokens=total_tokens / len(times[window]),
        tokens_per_s=total_tokens / total_s,
        first_round_s=times[0],
        prompt_tokens_mean=float(np.mean([len(p) for p in ids])),
    )


def emit(row: dict) -> None:
    """The side's result, as the one line the orchestrator reads."""
    print("ROW " + json.dumps(row), flush=True)
    sys.stdout.flush()

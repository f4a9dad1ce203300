"""reasoning-gym tasks: any of its seeded generators by name, as a chat-templated prompt source.

`reasoning-gym` (the `tasks` extra: `pip install -e ".[tasks]"`) holds ~100 offline procedural
datasets, each with an answer checker (`score_answer`). Item `k` of a dataset with seed `s` is
drawn from `random.Random(s + k)`, so it is a pure function of (name, config, s, k). This source
splits it by question text: a question is held out when the hash of its text falls in one
bucket of HELDOUT_BUCKETS (`is_heldout`, blake2b: the same in every process), so

    held-out  the draws Random(s), Random(s + 1), ... whose question is held out: the first
              `heldout_size` of them (repeats kept: the eval set is a sample of the task's own
              distribution over held-out questions, easy and hard ones in their proportions)
    train     item(i) = the draw Random(s + TRAIN_BASE + i + a * FAR) for the smallest a >= 0
              whose question is not held out

and the train stream never holds a held-out question, by construction (small configs repeat
questions, "3 + 4" is drawn again and again, and seeds alone would not keep them apart; set
aside as "the first N distinct questions", a held-out set would take every easy question of a
small config and leave the train stream the hard ones). Both are pure functions of (config, i); a
resumed run reads the same items. The train stream is read in chunks of CHUNK draws, chunk c a
dataset of size CHUNK with seed s + TRAIN_BASE + c * CHUNK (its item j the draw Random(s +
TRAIN_BASE + c * CHUNK + j)): the same draws, while datasets that pregenerate per-item choices
(gsm_symbolic) stay small.

Prompts: the question rendered with the tokenizer's chat template (`jaxrl.tasks.chat`), with
`TaskSpec.system_prompt` and `TaskSpec.instruction`. Reward "reasoning_gym": the final answer is
extracted from the assistant's reply in the task's answer format and scored by the dataset's
own `score_answer` (1.0 right; some datasets give partial credit). An item's reference is a JSON
record (dataset, config, seed, rg index, answer format) from which the reward rebuilds the entry,
so the reward needs no state of the source (it runs in another process in a role-split job).

Datasets whose `score_answer` evaluates the model's text (`eval`, `sympy.parse_expr`,
`literal_eval`: countdown, puzzle24, ...) are refused: rewards here parse, never evaluate.

SFT demonstrations (`demonstrations`): the prompt, then the dataset's worked solution where it has
one (gsm_symbolic's `answer_cot`, its `#### N` line rewritten in the answer format) or the answer
alone, then the end-of-turn token.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import hashlib
import inspect
import json
import re
from typing import Any

import numpy as np

from jaxrl.tasks.chat import (
    answer_format,
    check_format_is_asked,
    end_of_turn_id,
    render_prompt,
    require_chat_template,
    tokenizer_name,
)
from jaxrl.tasks.prompt import PromptItem

TRAIN_BASE = 2**31  # seed offset of the train stream: past any held-out scan
CHUNK = 2**20  # the rg datasets' size (gsm_symbolic pregenerates one choice per item)
FAR = 2**30  # stride of a train item's redraws (no run reads this many items)
HELDOUT_BUCKETS = 8  # 1 in 8 questions is held out
MAX_SCAN = 64  # the held-out scan looks at most MAX_SCAN x heldout_size draws
MAX_REDRAWS = 1000  # redraws of one train item whose questions are all held out (or too long)


def is_heldout(question: str) -> bool:
    """Whether a question belongs to the held-out split (1 in HELDOUT_BUCKETS, by its text)."""
    digest = hashlib.blake2b(question.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") % HELDOUT_BUCKETS == 0


_EVALUATES = re.compile(r"\beval\(|\bexec\(|parse_expr|sympify|literal_eval|parse_latex")


def _registry() -> dict[str, tuple[type, type]]:
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError as e:
        raise ImportError(
            "task 'reasoning_gym' needs the reasoning-gym package: pip install -e '.[tasks]'"
        ) from e
    return DATASETS


def _config_fields(config_cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(config_cls) if f.name not in ("seed", "size")]


def check_dataset(name: str, config: dict[str, Any]) -> None:
    """ValueError, naming the fix, for an unknown dataset (with the close names), one whose
    scorer evaluates text, or a config its dataclass rejects (unknown field, failed check)."""
    datasets = _registry()
    if name not in datasets:
        close = difflib.get_close_matches(name, list(datasets), n=5, cutoff=0.5)
        hint = f"close names: {close}" if close else f"known: {sorted(datasets)}"
        raise ValueError(
            f"TaskSpec.dataset={name!r} is not a reasoning-gym dataset; {hint} "
            f"(reasoning_gym.factory.DATASETS lists all {len(datasets)})"
        )
    dataset_cls, config_cls = datasets[name]
    if _EVALUATES.search(inspect.getsource(dataset_cls.score_answer)):
        raise ValueError(
            f"reasoning-gym dataset {name!r} scores answers by evaluating the model's text "
            f"({dataset_cls.__name__}.score_answer calls eval / a parser that evaluates); "
            "rewards here only parse text: choose another dataset"
        )
    if "seed" in config:
        raise ValueError(
            "TaskSpec.dataset_config sets 'seed': set TaskSpec.seed instead (it seeds both splits)"
        )
    fields = _config_fields(config_cls)
    unknown = sorted(set(config) - set(fields))
    if unknown:
        raise ValueError(
            f"TaskSpec.dataset_config for {name!r}: unknown field(s) {unknown}; "
            f"{config_cls.__name__} takes {fields} (seed and size are set by the task)"
        )
    try:
        _make_dataset(name, json.dumps(config, sort_keys=True), 0)
    except (AssertionError, ValueError, TypeError) as e:
        raise ValueError(
            f"TaskSpec.dataset_config={config} is rejected by {config_cls.__name__}: "
            f"{e or type(e).__name__}"
        ) from None


@functools.lru_cache(maxsize=64)
def _make_dataset(name: str, config_json: str, seed: int):
    """The rg dataset (cached: the reward rebuilds entries for every completion)."""
    dataset_cls, config_cls = _registry()[name]
    return dataset_cls(config_cls(**json.loads(config_json), seed=seed, size=CHUNK))


def _normalised(config: dict[str, Any]) -> str:
    """The config as canonical JSON (gin tuples become lists, as the reward will read them)."""
    try:
        return json.dumps(config, sort_keys=True)
    except TypeError as e:
        raise ValueError(f"TaskSpec.dataset_config={config!r} must hold JSON values: {e}") from None


class ReasoningGymSource:
    """A reasoning-gym dataset as a `PromptSource` (layout, split and reward: module docstring).

    `item(i)` and `eval_items(limit)` are pure functions of (dataset, config, seed, i). Prompts
    longer than `max_prompt_tokens` raise at construction for the held-out set (a held-out set
    cannot silently shrink) and are replaced like held-out questions in the train stream.
    """

    reward_name = "reasoning_gym"
    chat_formatted = True  # the chat template writes the special tokens itself

    def __init__(
        self,
        dataset: str,
        config: dict[str, Any],
        tokenizer,
        *,
        seed: int = 0,
        instruction: str = "",
        system_prompt: str | None = None,
        answer_format_name: str = "boxed",
        heldout_size: int = 1024,
        max_prompt_tokens: int | None = None,
    ):
        check_dataset(dataset, config)
        require_chat_template(tokenizer, "reasoning_gym")
        check_format_is_asked(answer_format_name, instruction, system_prompt)
        if heldout_size < 1:
            raise ValueError(f"TaskSpec.heldout_size={heldout_size} must be >= 1")
        self.name, self.seed, self.tokenizer = dataset, int(seed), tokenizer
        self.config_json = _normalised(config)
        self.instruction, self.system_prompt = instruction, system_prompt
        self.format = answer_format(answer_format_name)
        self.max_prompt_tokens = max_prompt_tokens
        if MAX_SCAN * heldout_size > CHUNK:
            raise ValueError(f"TaskSpec.heldout_size={heldout_size} must be <= {CHUNK // MAX_SCAN}")
        self.heldout = _make_dataset(dataset, self.config_json, self.seed)
        self.heldout_indices = self._scan_heldout(heldout_size)
        self._check_spelled(self.heldout[self.heldout_indices[0]]["question"])

    def _check_spelled(self, question: str) -> None:
        """ValueError when the tokenizer maps part of a question to its unknown token: the
        offline character tokenizer of the synthetic tasks (no PolicySpec.init_from) cannot
        spell reasoning-gym's questions."""
        unk = getattr(self.tokenizer, "unk_token_id", None)
        if unk is not None and unk in self.tokenizer.encode(question, add_special_tokens=False):
            raise ValueError(
                f"the tokenizer of {tokenizer_name(self.tokenizer)!r} cannot spell reasoning-gym "
                f"{self.name!r} questions ({question!r} encodes to its unknown token): start "
                "from a pretrained model, PolicySpec.init_from = its directory (e.g. the output "
                "of `python -m launch.fetch smollm2-135m-instruct`)"
            )

    # Layout ---------------------------------------------------------------------------------

    def _fits(self, question: str) -> bool:
        if self.max_prompt_tokens is None:
            return True
        ids = self.tokenizer.encode(self.prompt(question), add_special_tokens=False)
        return len(ids) <= self.max_prompt_tokens

    def _scan_heldout(self, count: int) -> list[int]:
        indices = []
        for k in range(MAX_SCAN * count):
            question = self.heldout[k]["question"]
            if not is_heldout(question):
                continue
            if not self._fits(question):
                raise ValueError(
                    f"reasoning-gym {self.name!r} item {k}: its prompt exceeds "
                    f"{self.max_prompt_tokens} tokens (the model's context minus the tokens to "
                    "generate); lower RLConfig.max_new_tokens or choose a smaller config"
                )
            indices.append(k)
            if len(indices) == count:
                return indices
        raise ValueError(
            f"reasoning-gym {self.name!r} with {self.config_json}: only {len(indices)} held-out "
            f"questions in its first {MAX_SCAN * count} draws, fewer than TaskSpec.heldout_size="
            f"{count}: the config has too few distinct questions; lower heldout_size or widen it"
        )

    def _train_entry(self, position: int) -> tuple[int, int]:
        """(rg seed, rg index) of train stream position `position` (see the module docstring)."""
        chunk, offset = divmod(position, CHUNK)
        return self.seed + TRAIN_BASE + chunk * CHUNK, offset

    def train_key(self, index: int) -> tuple[int, int]:
        """(rg seed, rg index) of train item `index`: stream position `index + a * FAR` for the
        smallest a >= 0 whose question is not held out (and whose prompt fits)."""
        if index < 0:
            raise ValueError(f"item index {index} must be >= 0")
        for attempt in range(MAX_REDRAWS):
            seed, k = self._train_entry(index + attempt * FAR)
            question = self._dataset(seed)[k]["question"]
            if not is_heldout(question) and self._fits(question):
                return seed, k
        raise RuntimeError(
            f"reasoning-gym {self.name!r}: {MAX_REDRAWS} draws for train item {index} were all "
            "held-out questions (or too long): the config has (nearly) no other questions; "
            "widen it"
        )

    def _dataset(self, seed: int):
        return _make_dataset(self.name, self.config_json, seed)

    def entry(self, key: tuple[int, int]) -> dict:
        """The rg entry (question, answer, metadata) at (rg seed, rg index)."""
        seed, k = key
        return self._dataset(seed)[k]

    # PromptSource ---------------------------------------------------------------------------

    def prompt(self, question: str) -> str:
        return render_prompt(
            self.tokenizer,
            question,
            instruction=self.instruction,
            system_prompt=self.system_prompt,
        )

    def reference(self, key: tuple[int, int]) -> str:
        """The JSON record the "reasoning_gym" reward rebuilds the entry from."""
        seed, k = key
        return json.dumps(
            {
                "dataset": self.name,
                "config": json.loads(self.config_json),
                "seed": seed,
                "index": k,
                "format": self.format.name,
            },
            sort_keys=True,
        )

    def _item(self, key: tuple[int, int]) -> PromptItem:
        return PromptItem(self.prompt(self.entry(key)["question"]), self.reference(key))

    def item(self, index: int) -> PromptItem:
        return self._item(self.train_key(index))

    def eval_items(self, limit: int) -> list[PromptItem]:
        if limit > len(self.heldout_indices):
            raise ValueError(
                f"{limit} held-out problems asked for, TaskSpec.heldout_size="
                f"{len(self.heldout_indices)}: raise heldout_size to at least the eval size"
            )
        return [self._item((self.seed, k)) for k in self.heldout_indices[:limit]]

    # SFT ------------------------------------------------------------------------------------

    def demonstration_text(self, index: int) -> str:
        """The assistant's reply that train item `index` is taught: the worked solution (its
        `#### N` line in the answer format) where the dataset has one, else the answer alone."""
        entry = self.entry(self.train_key(index))
        solution = (entry.get("metadata") or {}).get("answer_cot")
        answer = self.format.write(entry["answer"])
        if not solution:
            return answer
        lines = [line for line in solution.rstrip().split("\n") if not line.startswith("####")]
        return "\n".join([*lines, answer])

    def demonstrations(self, start: int, count: int, tokenizer, seq_len: int, pool: int = 0):
        """SFT batch `(tokens_bs, loss_mask_bs)` of train items [start, start + count) (with
        `pool` > 0, of items [0, pool) cycled): the chat prompt, the reply
        (`demonstration_text`) and the end-of-turn token, right-padded to `seq_len`; the loss
        mask covers the reply and the end-of-turn token."""
        stop = end_of_turn_id(tokenizer)
        stop = tokenizer.eos_token_id if stop is None else stop
        tokens = np.full((count, seq_len), tokenizer.pad_token_id, np.int32)
        loss_mask = np.zeros((count, seq_len), bool)
        for row, index in enumerate(range(start, start + count)):
            index = index % pool if pool else index
            question = self.entry(self.train_key(index))["question"]
            prompt_ids = tokenizer.encode(self.prompt(question), add_special_tokens=False)
            reply_ids = tokenizer.encode(self.demonstration_text(index), add_special_tokens=False)
            ids = prompt_ids + reply_ids + [stop]
            if len(ids) > seq_len:
                raise ValueError(
                    f"reasoning-gym {self.name!r} train item {index}: the demonstration has "
                    f"{len(ids)} tokens > SFTConfig.seq_len={seq_len}; raise seq_len"
                )
            tokens[row, : len(ids)] = ids
            loss_mask[row, len(prompt_ids) : len(ids)] = True
        return tokens, loss_mask


# Reward --------------------------------------------------------------------------------------


def score_reply(reply: str, reference: str | None) -> float:
    """The "reasoning_gym" reward of one reply: the final answer extracted in the reference's
    answer format, scored by the dataset's `score_answer` against the rebuilt entry. A reply
    without an answer, or one the scorer rejects with an exception, scores 0."""
    if reference is None:
        return 0.0
    record = json.loads(reference)
    dataset = _make_dataset(
        record["dataset"], json.dumps(record["config"], sort_keys=True), int(record["seed"])
    )
    entry = dataset[int(record["index"])]
    answer = answer_format(record["format"]).extract(reply)
    if answer is None:
        return 0.0
    try:
        score = float(dataset.score_answer(answer, entry))
    except (ArithmeticError, AttributeError, IndexError, KeyError, TypeError, ValueError):
        return 0.0
    return score if np.isfinite(score) else 0.0


def reasoning_gym_task(spec, tokenizer, max_prompt_tokens: int | None = None) -> ReasoningGymSource:
    """Task factory: `TaskSpec.dataset` with `dataset_config`, `seed`, `instruction`,
    `system_prompt`, `answer_format` and `heldout_size`."""
    if not spec.dataset:
        raise ValueError(
            "task 'reasoning_gym' needs TaskSpec.dataset (a reasoning-gym dataset name, e.g. "
            "'basic_arithmetic')"
        )
    return ReasoningGymSource(
        spec.dataset,
        dict(spec.dataset_config),
        tokenizer,
        seed=spec.seed,
        instruction=spec.instruction,
        system_prompt=spec.system_prompt,
        answer_format_name=spec.answer_format,
        heldout_size=spec.heldout_size,
        max_prompt_tokens=max_prompt_tokens,
    )

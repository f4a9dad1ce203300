"""What every prompt source yields and offers: `PromptItem` and the `PromptSource` protocol.

Their documented home is `jaxrl.tasks.source` (which re-exports both, beside the task registry);
they live here so that a task module the registry loads (`jaxrl.tasks.reasoning_gym`) can build
items without importing the registry back.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, runtime_checkable


@dataclasses.dataclass(frozen=True)
class PromptItem:
    text: str  # the prompt as the model sees it (before tokenisation)
    reference: str | None  # gold answer for verifiable rewards


@runtime_checkable
class PromptSource(Protocol):
    """What the controller reads prompts from.

    `item(i)` must be a pure function of (the source's config, i): batch k of a run samples items
    [k * n, (k + 1) * n), and a resumed run asks for the same indices again. `eval_items(limit)`
    are held-out prompts (disjoint from the train stream), the same list on every call.

    Optional attributes: `reward_name` (the reward used when `TaskSpec.reward` is empty) and
    `demonstrations(start, count, tokenizer, seq_len, pool=0) -> (tokens_bs, loss_mask_bs)` (the
    SFT warm start, `jaxrl.train.sft`). Prompts are encoded with `tokenizer.encode(text)`, which
    adds the tokenizer's special tokens (e.g. `<bos>`).
    """

    def item(self, index: int) -> PromptItem: ...

    def eval_items(self, limit: int) -> list[PromptItem]: ...

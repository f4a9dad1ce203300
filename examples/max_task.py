"""A user's own task and reward, trained by `launch.rl` with no edit of the library.

"max(37,45)=" -> "45". Run from the repository root (this directory on PYTHONPATH, so that the
gin file's `import max_task` finds this module):

    PYTHONPATH=examples python -m launch.rl --gin_file=examples/max_task.gin --workdir=runs/max

Importing the module registers the task ("max") and the reward ("max_exact"); the gin file then
selects both by name (`TaskSpec.name`, `TaskSpec.reward`) and binds the task's own setting
(`max_source.max_value`). The prompts use only characters of the built-in offline tokenizer.
"""

from __future__ import annotations

import hashlib

import gin

from jaxrl.tasks.rewards import register_reward
from jaxrl.tasks.source import PromptItem, register_task


def _pair(seed: int, index: int, attempt: int, max_value: int) -> tuple[int, int]:
    """A pure function of its arguments: item i never changes, so a resumed run continues."""
    digest = hashlib.blake2b(f"{seed}/{index}/{attempt}".encode(), digest_size=8).digest()
    h = int.from_bytes(digest, "little")
    return h % (max_value + 1), (h // (max_value + 1)) % (max_value + 1)


def _is_heldout(a: int, b: int) -> bool:
    return (31 * a + b) % 10 == 0  # a tenth of the pairs, never trained on


class MaxSource:
    """A `jaxrl.tasks.source.PromptSource`: item(i) and a held-out eval set."""

    reward_name = "max_exact"

    def __init__(self, seed: int, max_value: int):
        self.seed, self.max_value = seed, max_value

    def _item(self, index: int, heldout: bool) -> PromptItem:
        attempt = 0
        while _is_heldout(*(pair := _pair(self.seed, index, attempt, self.max_value))) != heldout:
            attempt += 1
        return PromptItem(f"max({pair[0]},{pair[1]})=", str(max(pair)))

    def item(self, index: int) -> PromptItem:
        return self._item(index, heldout=False)

    def eval_items(self, limit: int) -> list[PromptItem]:
        return [self._item(-1 - i, heldout=True) for i in range(limit)]


@register_task("max")
@gin.configurable
def max_source(spec, tokenizer, max_value: int = 99) -> MaxSource:
    """The task factory: the run's TaskSpec and tokenizer -> a prompt source."""
    del tokenizer
    return MaxSource(spec.seed, max_value)


@register_reward("max_exact", per_sample=True)
def max_exact(prompt: str, completion: str, reference: str | None) -> float:
    """1 for the larger number, 0.1 for another integer (a little shaping), else 0. The
    completion arrives decoded without special tokens (no `<eos>`)."""
    text = completion.strip()
    if text == reference:
        return 1.0
    return 0.1 if text.isdigit() and len(text) <= 4 else 0.0

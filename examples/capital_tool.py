"""A user's own multi-turn tool, trained by `launch.rl` with no edit of the library: a lookup of
a country's capital in a small table.

The model asks the tool by writing `ask <country>?`; generation stops at `?` (the source's
`stop_ids`), the environment appends `=` and the capital, and the model goes on:

    prompt   <bos>capital of peru:
    turn 1   ask peru?          sampled, trained
    step 1   =lima              appended by the environment, attended, not trained
    turn 2   lima<eos>          sampled, trained; reward 1 when it is the answer

Run from the repository root (this directory on PYTHONPATH, so that the gin file's
`import capital_tool` finds this module):

    PYTHONPATH=examples python -m launch.rl --gin_file=examples/capital_tool.gin --workdir=runs/cap

Importing the module registers the task ("capitals") and the reward ("capital_exact"). Only the
documented environment API is used: `jaxrl.env.base.Step`, an environment with `reset(item)` and
`step(turn ids)`, a source with `make_env()` and `stop_ids`.

The tool reads a call with a bounded parser (`parse_call`: lowercase words after the last
`ask `, at most `MAX_KEY_CHARS` characters); it never evaluates the model's text. A call it
cannot read gets the observation `=error` and the step status "malformed"; a country the table
does not hold gets `=unknown` and the status "unknown_key"; either way the episode goes on. A
turn ended by `<eos>` is the final answer, scored by `capital_exact`. Held-out countries (an
eighth of the table, `heldout_countries`) never appear in training prompts, though the tool knows
them: the evaluation asks about countries whose capitals only the tool can give.
"""

from __future__ import annotations

import collections
import hashlib
import re
import threading
from collections.abc import Sequence

from jaxrl.env.base import Step
from jaxrl.tasks.rewards import register_reward
from jaxrl.tasks.source import PromptItem, register_task

CAPITALS = {
    "algeria": "algiers",
    "argentina": "buenos aires",
    "armenia": "yerevan",
    "austria": "vienna",
    "belgium": "brussels",
    "brazil": "brasilia",
    "bulgaria": "sofia",
    "canada": "ottawa",
    "chile": "santiago",
    "china": "beijing",
    "colombia": "bogota",
    "croatia": "zagreb",
    "cuba": "havana",
    "denmark": "copenhagen",
    "ecuador": "quito",
    "egypt": "cairo",
    "estonia": "tallinn",
    "ethiopia": "addis ababa",
    "finland": "helsinki",
    "france": "paris",
    "georgia": "tbilisi",
    "germany": "berlin",
    "ghana": "accra",
    "greece": "athens",
    "hungary": "budapest",
    "iceland": "reykjavik",
    "india": "new delhi",
    "iran": "tehran",
    "iraq": "baghdad",
    "ireland": "dublin",
    "italy": "rome",
    "jamaica": "kingston",
    "japan": "tokyo",
    "jordan": "amman",
    "kenya": "nairobi",
    "latvia": "riga",
    "lebanon": "beirut",
    "lithuania": "vilnius",
    "mali": "bamako",
    "mexico": "mexico city",
    "mongolia": "ulaanbaatar",
    "morocco": "rabat",
    "nepal": "kathmandu",
    "new zealand": "wellington",
    "nigeria": "abuja",
    "norway": "oslo",
    "oman": "muscat",
    "peru": "lima",
    "poland": "warsaw",
    "portugal": "lisbon",
    "qatar": "doha",
    "romania": "bucharest",
    "russia": "moscow",
    "senegal": "dakar",
    "serbia": "belgrade",
    "south korea": "seoul",
    "spain": "madrid",
    "sweden": "stockholm",
    "thailand": "bangkok",
    "tunisia": "tunis",
    "turkey": "ankara",
    "uganda": "kampala",
    "uruguay": "montevideo",
    "vietnam": "hanoi",
}

CALL_PREFIX = "ask "
CLOSE = "?"
MAX_KEY_CHARS = 24
ERROR_REPLY = "=error"
UNKNOWN_REPLY = "=unknown"
_KEY = re.compile(r"[a-z]+(?: [a-z]+)*")

# Steps run on the episode driver's thread pool; a fast tokenizer is not safe to call from
# several threads at once, so every encode and decode of this module holds this lock.
_TOKENIZER_LOCK = threading.Lock()

# The calls the tool answered in this process, by step status ("ok", "malformed",
# "unknown_key"): a tally a caller can read after a run (`calls_by_status`).
_CALLS: collections.Counter[str] = collections.Counter()
_CALLS_LOCK = threading.Lock()


def calls_by_status() -> dict[str, int]:
    """A copy of the process-wide tally of answered calls, by step status."""
    with _CALLS_LOCK:
        return dict(_CALLS)


def _count(status: str) -> None:
    with _CALLS_LOCK:
        _CALLS[status] += 1


class CallError(ValueError):
    """The turn holds no call the tool reads."""


def parse_call(text: str) -> str:
    """The country a call asks about: the text after the last `ask ` and before the closing `?`,
    lowercase words separated by single spaces, at most `MAX_KEY_CHARS` characters. Raises
    `CallError` for anything else (no `ask `, no closing `?`, digits, punctuation, an empty or
    overlong name)."""
    if not text.endswith(CLOSE):
        raise CallError(f"the call is not closed by {CLOSE!r}")
    start = text.rfind(CALL_PREFIX)
    if start < 0:
        raise CallError(f"no {CALL_PREFIX!r} before {CLOSE!r}")
    key = text[start + len(CALL_PREFIX) : -len(CLOSE)]
    if len(key) > MAX_KEY_CHARS:
        raise CallError(f"{len(key)} characters > {MAX_KEY_CHARS}")
    if not _KEY.fullmatch(key):
        raise CallError(f"not lowercase words: {key!r}")
    return key


def lookup(key: str) -> str | None:
    """The capital of country `key`, or None when the table does not hold it."""
    return CAPITALS.get(key)


@register_reward("capital_exact", per_sample=True)
def capital_exact(prompt: str, completion: str, reference: str | None) -> float:
    """1 for the capital exactly (surrounding spaces ignored), else 0. The completion arrives
    decoded without special tokens."""
    del prompt
    return float(reference is not None and completion.strip() == reference)


class CapitalEnv:
    """One episode (module docstring): the model's turns in, the tool's replies out, as ids."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.close_id = capital_stop_ids(tokenizer)[0]
        self.eos_ids = {int(tokenizer.eos_token_id)}
        self.prompt: str = ""
        self.reference: str | None = None

    def _encode(self, text: str, special: bool = False) -> list[int]:
        with _TOKENIZER_LOCK:
            return list(self.tokenizer.encode(text, add_special_tokens=special))

    def _decode(self, ids: Sequence[int]) -> str:
        with _TOKENIZER_LOCK:
            return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def reset(self, item: PromptItem) -> list[int]:
        self.prompt, self.reference = item.text, item.reference
        return self._encode(item.text, special=True)  # <bos> first

    def step(self, turn_ids: Sequence[int]) -> Step:
        ids = [int(t) for t in turn_ids]
        if ids and ids[-1] in self.eos_ids:  # the final answer
            text = self._decode(ids)
            return Step(reward=capital_exact(self.prompt, text, self.reference), done=True)
        if not ids or ids[-1] != self.close_id:
            # The driver ends a turn that stops at neither `?` nor `<eos>` itself ("truncated");
            # handed one anyway, the episode ends unscored.
            return Step(done=True, status="unclosed")
        try:
            key = parse_call(self._decode(ids))
        except CallError:
            _count("malformed")
            return Step(self._encode(ERROR_REPLY), status="malformed")
        capital = lookup(key)
        if capital is None:
            _count("unknown_key")
            return Step(self._encode(UNKNOWN_REPLY), status="unknown_key")
        _count("ok")
        return Step(self._encode(f"={capital}"))


def capital_stop_ids(tokenizer) -> tuple[int, ...]:
    """The id that closes a call (`?`), a stop id of every turn."""
    return (int(tokenizer.convert_tokens_to_ids(CLOSE)),)


def heldout_countries(seed: int) -> list[str]:
    """The countries kept out of training prompts: an eighth of the table, those whose hash
    of (seed, country) is smallest."""

    def rank(country: str) -> int:
        digest = hashlib.blake2b(f"{seed}/{country}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little")

    return sorted(sorted(CAPITALS, key=rank)[: len(CAPITALS) // 8])


class CapitalSource:
    """The task as a `jaxrl.tasks.source.PromptSource` (item(i), held-out eval items), with an
    environment per episode (`make_env`) and the id that ends a call (`stop_ids`)."""

    reward_name = "capital_exact"  # single-turn scoring of a final answer

    def __init__(self, tokenizer, seed: int = 0):
        self.tokenizer, self.seed = tokenizer, seed
        self.heldout = heldout_countries(seed)
        self.train = [c for c in sorted(CAPITALS) if c not in self.heldout]

    @staticmethod
    def _item(country: str) -> PromptItem:
        return PromptItem(f"capital of {country}:", CAPITALS[country])

    def item(self, index: int) -> PromptItem:
        """Train item `index`: a pure function of the seed and the index (a resumed run
        continues)."""
        digest = hashlib.blake2b(f"{self.seed}/{index}".encode(), digest_size=8).digest()
        return self._item(self.train[int.from_bytes(digest, "little") % len(self.train)])

    def eval_items(self, limit: int) -> list[PromptItem]:
        return [self._item(self.heldout[i % len(self.heldout)]) for i in range(limit)]

    def make_env(self) -> CapitalEnv:
        return CapitalEnv(self.tokenizer)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return capital_stop_ids(self.tokenizer)


@register_task("capitals")
def capital_source(spec, tokenizer) -> CapitalSource:
    """The task factory: the run's TaskSpec (its seed) and tokenizer -> the source."""
    return CapitalSource(tokenizer, spec.seed)

"""A multi-turn task that lives outside the library, named in configs as
`envs_for_tests:calculator_even_length` (tests put this directory on PYTHONPATH): the
calculator's prompts and tokenizer, but a turn that ends at `)` or at a digit 0-3 is a tool call
(answered `=<turn length>`), and every step scores 0.5 when its turn has an even number of
tokens, so that an untrained policy calls the tool often and its episodes get different
rewards (RL moves its weights)."""

from __future__ import annotations

from jaxrl.env.base import Step
from jaxrl.env.calculator import CalculatorEnv, CalculatorSource, CalculatorTask


class EvenLengthEnv(CalculatorEnv):
    def step(self, turn_ids) -> Step:
        ids = [int(t) for t in turn_ids]
        reward = 0.5 * float(len(ids) % 2 == 0)
        if not ids or ids[-1] == self.tokenizer.eos_token_id:
            return Step(reward=reward, done=True)
        return Step(self._encode(f"={len(ids)}"), reward=reward)


class EvenLengthSource(CalculatorSource):
    def make_env(self, **kwargs) -> EvenLengthEnv:
        return EvenLengthEnv(self.tokenizer, **kwargs)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return tuple(self.tokenizer.convert_tokens_to_ids(c) for c in ")0123")


def calculator_even_length(spec, tokenizer) -> EvenLengthSource:
    return EvenLengthSource(CalculatorTask(seed=spec.seed), tokenizer)

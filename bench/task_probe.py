"""Greedy start accuracy of a chat model on candidate reasoning-gym tasks (which task to train on).

    python -m bench task-probe --hf_dir ~/.cache/jaxrl/smollm2-135m-instruct

For each candidate (`CANDIDATES`: a reasoning-gym dataset, its config and a label), the task is
built as `configs/rl/smollm2_arith.gin` builds it, with only the dataset, its config and
`TaskSpec.seed` (= `--seed`) replaced: `TaskSpec.name`, `instruction`, `answer_format` and
`heldout_size` are read from the config, the system turn is the chat template's default (the
config sets none), and the source comes from `jaxrl.job.specs.build_source` with the room the
model's context leaves for the prompt. The problems are the first `--draws` draws of the task's
seed (rg item k of seed s, drawn from `Random(s + k)`: held-out and train questions alike, in
the task's own proportions), rendered by the source's `prompt` and scored through its
`reference` by the task's reward (`reasoning_gym`: the last number of the reply scored by the
dataset's `score_answer`, > 0.5 counting as right). Generation is greedy on the engine
(`EngineSampler`, stopping at the model's EOS ids and the chat template's end-of-turn token),
`--max_new_tokens` new tokens, through `jaxrl.train.evaluation.evaluate`, as `launch.eval`
evaluates a held-out split.

Rows: dataset, config (the label; the config itself under `dataset_config`), greedy accuracy
(%), the share of replies that the end-of-turn token ended rather than the token limit (%), the
mean reply length in tokens (the end-of-turn token counted where it ended the reply) and the
seconds the candidate took (building the task, generating, scoring; the first candidate's
include the engine's compiles); the note gives the machine load at the start and the end.
Written to bench/results/task_probe_smollm2.{json,md}; `--smoke` (4 draws of 8 tokens, for a
test's tiny model) to task_probe_smoke.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, "configs", "rl", "smollm2_arith.gin")
RESULT = "task_probe_smollm2"
SMOKE_RESULT = "task_probe_smoke"


@dataclasses.dataclass(frozen=True)
class Candidate:
    dataset: str
    label: str
    config: dict


NO_EXTRAS = {"allow_parentheses": False, "allow_negation": False}
CANDIDATES = (
    Candidate(
        "basic_arithmetic",
        "2 terms, 1-2 digits, `+ -`, no parentheses / negation",
        {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2,
         "operators": ["+", "-"], **NO_EXTRAS},
    ),
    Candidate(
        "basic_arithmetic",
        "2 terms, 2 digits, `+`, no parentheses / negation",
        {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2,
         "operators": ["+"], **NO_EXTRAS},
    ),
    Candidate(
        "chain_sum", "2-3 terms, 1-2 digits",
        {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2},
    ),
    Candidate(
        "chain_sum", "3 terms, 1 digit",
        {"min_terms": 3, "max_terms": 3, "min_digits": 1, "max_digits": 1},
    ),
    Candidate(
        "products", "2 terms, 1 digit",
        {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
    ),
)  # fmt: skip

COLUMNS = [
    ("dataset", "dataset"),
    ("config", "config"),
    ("greedy_pct", "greedy %"),
    ("ended_pct", "replies ended by the end-of-turn token %"),
    ("reply_tokens", "mean reply tokens"),
]


def config_task():
    """The TaskSpec of `configs/rl/smollm2_arith.gin` (its TaskSpec bindings, nothing else) and
    its `RLConfig.max_new_tokens`."""
    import launch.rl  # noqa: F401  (registers rl_main, which the config binds)
    from bench.common import gin_values
    from jaxrl.job.specs import TaskSpec

    fields = ("name", "dataset", "dataset_config", "instruction", "answer_format", "heldout_size")
    names = [f"TaskSpec.{f}" for f in fields]
    values = gin_values(CONFIG, [], *names, "RLConfig.max_new_tokens")
    task = TaskSpec(**{f: values[name] for f, name in zip(fields, names, strict=True)})
    return task, values["RLConfig.max_new_tokens"]


class ReplyRecorder:
    """A sampler that passes calls through and keeps each returned reply's length and whether
    the end-of-turn token ended it."""

    def __init__(self, sampler, end_of_turn: int):
        self.sampler, self.end_of_turn = sampler, end_of_turn
        self.eos_ids = sampler.eos_ids
        self.lengths: list[int] = []
        self.ended: list[bool] = []

    def generate(self, params, prompt_ids, sampling, key, *args, **kwargs):
        out = self.sampler.generate(params, prompt_ids, sampling, key, *args, **kwargs)
        for row in range(len(prompt_ids)):
            n = int(out.lengths_b[row])
            self.lengths.append(n)
            self.ended.append(n > 0 and int(out.tokens_bn[row, n - 1]) == self.end_of_turn)
        return out


def probe(sampler, params, tokenizer, context: int, task, candidate: Candidate, args) -> dict:
    """One candidate's row (module docstring)."""
    import numpy as np

    from jaxrl.job.specs import build_source, reward_name
    from jaxrl.tasks.chat import end_of_turn_id
    from jaxrl.tasks.prompt import PromptItem
    from jaxrl.tasks.source import encode_prompts
    from jaxrl.train.evaluation import evaluate

    start = time.perf_counter()
    task = dataclasses.replace(
        task, dataset=candidate.dataset, dataset_config=dict(candidate.config), seed=args.seed
    )
    if args.heldout_size:
        task = dataclasses.replace(task, heldout_size=args.heldout_size)
    task.validate()
    source = build_source(task, tokenizer, max_prompt_tokens=context - args.max_new_tokens)
    keys = [(task.seed, k) for k in range(args.draws)]  # the first draws of the task's seed
    items = [
        PromptItem(source.prompt(source.entry(k)["question"]), source.reference(k)) for k in keys
    ]
    ids = encode_prompts(tokenizer, items, source.chat_formatted)
    recorder = ReplyRecorder(sampler, end_of_turn_id(tokenizer))
    metrics = evaluate(
        recorder, params, tokenizer, reward_name(task, source), items, ids,
        max_new_tokens=args.max_new_tokens, samples=0, seed=args.seed,
    )  # fmt: skip
    assert len(recorder.lengths) == len(items), (len(recorder.lengths), len(items))
    return {
        "dataset": candidate.dataset,
        "config": candidate.label,
        "greedy_pct": round(100 * metrics["eval/accuracy"], 2),
        "ended_pct": round(100 * float(np.mean(recorder.ended)), 2),
        "reply_tokens": round(float(np.mean(recorder.lengths)), 2),
        "dataset_config": dict(candidate.config),
        "draws": len(items),
        "seconds": round(time.perf_counter() - start, 2),
    }


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hf_dir", required=True, help="the model (a save_pretrained directory)")
    p.add_argument("--draws", type=int, default=128, help="problems per candidate")
    p.add_argument("--seed", type=int, default=777, help="TaskSpec.seed: whose draws")
    p.add_argument("--max_new_tokens", type=int, default=None, help="default: the config's")
    p.add_argument(
        "--heldout_size", type=int, default=None, help="default: the config's (its scan runs)"
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="4 draws of 8 tokens, a held-out pool of 8 (a test's model)",
    )
    args = p.parse_args(argv)
    from bench.common import write_results
    from jaxrl.generation.engine_sampler import EngineSampler
    from jaxrl.infra.paths import user_path
    from jaxrl.models import hf
    from jaxrl.tasks.chat import end_of_turn_id, stop_token_ids

    if args.smoke:
        args.draws, args.max_new_tokens = min(args.draws, 4), args.max_new_tokens or 8
        args.heldout_size = args.heldout_size or 8
    task, config_max_new_tokens = config_task()
    if args.max_new_tokens is None:
        args.max_new_tokens = config_max_new_tokens
    first = CANDIDATES[0]
    assert (task.dataset, dict(task.dataset_config)) == (first.dataset, first.config), (
        f"{CONFIG}'s task is no longer the first candidate: update bench/task_probe.py"
    )
    hf_dir = user_path(args.hf_dir)
    config, tokenizer = hf.load_config(hf_dir), hf.load_tokenizer(hf_dir)
    if end_of_turn_id(tokenizer) is None:
        raise SystemExit(f"{hf_dir}: the tokenizer has no chat template with an end-of-turn token")
    model = hf.load_model(hf_dir)
    eos_ids = stop_token_ids(model.config.eos_token_ids, tokenizer)
    sampler, params = EngineSampler.for_model(model, pad_id=tokenizer.pad_token_id, eos_ids=eos_ids)
    rows, start, load = [], time.perf_counter(), os.getloadavg()[0]
    for candidate in CANDIDATES:
        row = probe(
            sampler, params, tokenizer, config.max_position_embeddings, task, candidate, args
        )
        print(json.dumps(row), flush=True)
        rows.append(row)
    total = time.perf_counter() - start
    note = (
        f"greedy start accuracy of {os.path.basename(hf_dir.rstrip('/'))} on candidate "
        f"reasoning-gym tasks: the first {args.draws} draws of TaskSpec.seed={args.seed}, the "
        f"prompt and reward of configs/rl/smollm2_arith.gin (instruction {task.instruction!r}, "
        f"answer format {task.answer_format}, the template's default system turn), "
        f"{args.max_new_tokens} new tokens, engine; {total:.0f} s for all, machine load (1-min "
        f"average) {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"
    )
    print(write_results(SMOKE_RESULT if args.smoke else RESULT, rows, COLUMNS, note))
    return rows


if __name__ == "__main__":
    main()

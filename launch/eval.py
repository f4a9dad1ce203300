"""Held-out evaluation of a run or a HF checkpoint: greedy accuracy and pass@k.

    python -m launch.eval --workdir=runs/arith_sync [--step=N]
    python -m launch.eval --hf_dir=exported/ --task=arithmetic --eval_size=512 --samples=8

Prints one JSON line of metrics (eval/accuracy, eval/accuracy_t1, eval/pass@k).
"""

from __future__ import annotations

import argparse
import json
import sys

from jaxrl import workdir as run_dir
from jaxrl.evaluation import evaluate
from jaxrl.generation.sampler import Sampler
from jaxrl.models import hf
from jaxrl.specs import TaskSpec, build_source, reward_name
from jaxrl.tasks.source import encode_prompts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--workdir", help="a jaxrl run (newest checkpoint unless --step)")
    source.add_argument("--hf_dir", help="a save_pretrained directory")
    p.add_argument("--step", type=int, default=None)
    p.add_argument("--task", default="arithmetic", choices=("arithmetic", "math_jsonl"))
    p.add_argument("--eval_path", default="", help="jsonl of held-out problems (math_jsonl)")
    p.add_argument("--min_digits", type=int, default=1)
    p.add_argument("--max_digits", type=int, default=2)
    p.add_argument("--eval_size", type=int, default=512)
    p.add_argument("--samples", type=int, default=4, help="k of pass@k (draws at temperature)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max_new_tokens", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    if args.workdir:
        step, model, tokenizer = run_dir.load_policy(args.workdir, step=args.step)
    else:
        step, model, tokenizer = None, hf.load_model(args.hf_dir), hf.load_tokenizer(args.hf_dir)
    task = TaskSpec(
        name=args.task,
        min_digits=args.min_digits,
        max_digits=args.max_digits,
        train_path=args.eval_path,
        eval_path=args.eval_path,
    )
    task.validate()
    source = build_source(task, tokenizer)
    items = source.eval_items(args.eval_size)
    if not items:
        raise SystemExit("no evaluation problems: pass --eval_path for a math_jsonl task")
    ids = encode_prompts(tokenizer, items, chat_formatted=args.task == "math_jsonl")
    sampler, params = Sampler.for_model(model, pad_id=tokenizer.pad_token_id)
    metrics = evaluate(
        sampler, params, tokenizer, reward_name(task, source), items, ids,
        max_new_tokens=args.max_new_tokens, samples=args.samples,
        temperature=args.temperature, seed=args.seed,
    )
    metrics = {"step": step, **{k: round(v, 4) for k, v in metrics.items()}}
    print(json.dumps(metrics))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Held-out evaluation of a run or a HF checkpoint: greedy accuracy and pass@k.

    python -m launch.eval --workdir=runs/arith_sync [--step=N]
    python -m launch.eval --hf_dir=exported/ --task=arithmetic --eval_size=512 --samples=8
    python -m launch.eval --hf_dir=exported_chain/ --task=chain_sum
    python -m launch.eval --hf_dir=exported_smol/ --task=reasoning_gym --dataset=basic_arithmetic \
        --dataset_config='{"min_terms": 2, "max_terms": 2}' --answer_format=last_number \
        --instruction='Give only the final answer.' --max_new_tokens=48

--task takes any registered task (`jaxrl.tasks.source.list_tasks`) or "package.module:factory".

A run is evaluated on its own task and settings (read from WORKDIR/config.gin; of its files only
the held-out one is read). A HF directory gets the task's completion budget (`task_budget`).
Prints one JSON line of metrics (eval/accuracy, eval/accuracy_t<temperature>, eval/pass_at_k,
eval/truncated: the share of greedy completions no stop token ended), and a warning on standard
error when most were cut at max_new_tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from jaxrl.generation.engine_sampler import EngineSampler
from jaxrl.infra.errors import DataError
from jaxrl.infra.paths import run_path, user_path
from jaxrl.job import workdir as run_dir
from jaxrl.job.specs import TaskSpec, build_source, reward_name
from jaxrl.models import hf
from jaxrl.tasks.chat import stop_token_ids
from jaxrl.tasks.source import encode_prompts, list_tasks
from jaxrl.train.evaluation import evaluate


def run_settings(workdir: str, eval_path: str | None = None) -> tuple[TaskSpec, dict]:
    """The task and the evaluation settings of the run in `workdir`, from its config.gin: an RL
    run's RLConfig (eval_size, eval_samples, max_new_tokens, temperature, seed), an SFT run's
    SFTConfig (at temperature 1). A run trained on another task (operators, task seed, jsonl
    files, reward) is so evaluated on its own held-out split. `eval_path` replaces the run's
    held-out file. Only what an evaluation reads has to exist: a training file that is gone
    gives way to the held-out file, a missing `PolicySpec.init_from` is not read (the weights
    are the run's checkpoints). ValueError (a `ConfigError`) naming the file and the fix when
    the config cannot be read."""
    import gin

    from jaxrl.infra.config import ConfigError, parse_gin, resolve_bindings
    from jaxrl.infra.launcher import CONFIG_FILE

    path = os.path.join(workdir, CONFIG_FILE)
    if not os.path.isfile(path):
        what = "does not exist" if not os.path.exists(workdir) else f"has no {CONFIG_FILE}"
        raise ConfigError(f"--workdir {workdir} {what}, so it is not a run's workdir")
    text = open(path, encoding="utf-8").read()
    if "rl_main." in text:
        from launch.rl import rl_main as launch_fn
    else:
        from launch.sft import sft_main as launch_fn
    try:
        parse_gin([path], [])
        _for_reading(eval_path)
        kwargs = resolve_bindings(launch_fn)
    except ConfigError as err:
        hint = " (pass --eval_path=FILE)" if "eval_path=" in str(err) else ""
        raise ConfigError(f"{path}: {err}{hint}") from None
    finally:
        gin.clear_config()
    stage = kwargs["rl"] if "rl" in kwargs else kwargs["sft"]
    settings = {
        "eval_size": stage.eval_size,
        "samples": stage.eval_samples,
        "max_new_tokens": stage.max_new_tokens,
        "temperature": getattr(stage, "temperature", 1.0),
        "seed": stage.seed,
    }
    return kwargs["task"], settings


def _for_reading(eval_path: str | None) -> None:
    """Rebinds the parsed run config to what a job that reads the run needs (`run_settings`)."""
    import gin

    from jaxrl.infra.config import ConfigError

    task = gin.get_bindings("TaskSpec")
    policy = gin.get_bindings("PolicySpec")
    with gin.unlock_config():
        if eval_path is not None:
            gin.bind_parameter("TaskSpec.eval_path", eval_path)
            task["eval_path"] = eval_path
        train, held_out = task.get("train_path", ""), task.get("eval_path", "")
        if held_out and not os.path.isfile(held_out):
            raise ConfigError(f"TaskSpec: eval_path={held_out!r} does not exist")
        if train and not os.path.isfile(train) and held_out:
            gin.bind_parameter("TaskSpec.train_path", held_out)
        init_from = policy.get("init_from", "")
        if init_from and not os.path.isdir(init_from):
            gin.bind_parameter("PolicySpec.init_from", "")
            gin.bind_parameter("PolicySpec.requires_init_from", "")


# Flags that default to the run's settings (--workdir) or to these (--hf_dir).
DEFAULTS = {"eval_size": 512, "samples": 4, "temperature": 1.0, "max_new_tokens": 6, "seed": 0}
TASK_FLAGS = {  # flag -> TaskSpec field
    "task": "name",
    "min_digits": "min_digits",
    "max_digits": "max_digits",
    "operators": "operators",
    "min_operands": "min_operands",
    "max_operands": "max_operands",
    "task_seed": "seed",
    "eval_path": "eval_path",
    "reward": "reward",
    "dataset": "dataset",
    "dataset_config": "dataset_config",
    "instruction": "instruction",
    "system_prompt": "system_prompt",
    "answer_format": "answer_format",
    "heldout_size": "heldout_size",
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="With --workdir every unset flag takes the run's own value (its TaskSpec and its "
        "RLConfig / SFTConfig evaluation settings, read from WORKDIR/config.gin); a flag that "
        "differs from the run's is used, with a note. With --hf_dir the task defaults are "
        f"TaskSpec's ({TaskSpec()}) and the others {DEFAULTS}.",
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--workdir", type=user_path, help="a jaxrl run (newest checkpoint unless --step)"
    )
    source.add_argument("--hf_dir", type=user_path, help="a save_pretrained directory")
    p.add_argument("--step", type=int, default=None)
    p.add_argument(
        "--task",
        default=None,
        help=f"a registered task ({', '.join(list_tasks())}) or 'package.module:factory'",
    )
    p.add_argument(
        "--eval_path", default=None, type=run_path, help="jsonl of held-out problems (math_jsonl)"
    )
    p.add_argument("--min_digits", type=int, default=None)
    p.add_argument("--max_digits", type=int, default=None)
    p.add_argument("--operators", default=None, help="arithmetic operators, e.g. '+-'")
    p.add_argument("--min_operands", type=int, default=None, help="chain_sum: fewest operands")
    p.add_argument("--max_operands", type=int, default=None, help="chain_sum: most operands")
    p.add_argument("--task_seed", type=int, default=None, help="the task's seed (its split)")
    p.add_argument("--reward", default=None, help="reward name (default: the task's own)")
    p.add_argument("--dataset", default=None, help="reasoning_gym: the dataset name")
    p.add_argument(
        "--dataset_config",
        type=_json_object,
        default=None,
        help="reasoning_gym: the dataset's config as a JSON object, e.g. '{\"max_digits\": 2}'",
    )
    p.add_argument("--instruction", default=None, help="chat tasks: appended to each question")
    p.add_argument("--system_prompt", default=None, help="chat tasks: the system turn")
    p.add_argument("--answer_format", default=None, help="reasoning_gym: where the answer is read")
    p.add_argument("--heldout_size", type=int, default=None, help="reasoning_gym: held-out pool")
    p.add_argument("--eval_size", type=int, default=None)
    p.add_argument("--samples", type=int, default=None, help="k of pass@k (draws at temperature)")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument(
        "--max_new_tokens",
        type=int,
        default=None,
        help="with --hf_dir: default the task's longest completion where it knows it (chain_sum), "
        f"{CHAT_MAX_NEW_TOKENS} for a chat task (math_jsonl, reasoning_gym: within the model's "
        f"context), else {DEFAULTS['max_new_tokens']}",
    )
    p.add_argument("--seed", type=int, default=None)
    args = p.parse_args(argv)

    if args.workdir:
        try:
            try:
                task, settings = run_settings(args.workdir)
            except ValueError:
                if args.eval_path is None:
                    raise
                task, settings = run_settings(args.workdir, args.eval_path)
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
    else:
        task, settings = TaskSpec(), dict(DEFAULTS)
    overrides = {}
    for flag, field in TASK_FLAGS.items():
        value = getattr(args, flag)
        if value is not None and value != getattr(task, field):
            overrides[field] = value
            if args.workdir:
                _note(f"--{flag}={value!r}; the run used TaskSpec.{field}={getattr(task, field)!r}")
    task = dataclasses.replace(task, **overrides)
    if task.name == "math_jsonl" and not task.train_path:
        task = dataclasses.replace(task, train_path=task.eval_path)
    for flag in DEFAULTS:
        value = getattr(args, flag)
        if value is not None and value != settings[flag]:
            if args.workdir:
                _note(f"--{flag}={value!r}; the run evaluated with {flag}={settings[flag]!r}")
            settings[flag] = value
    try:  # a bad task fails here, before the model is loaded
        task.validate()
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    # The tokenizer and config first: a task that cannot use them (no chat template) fails
    # before the weights are read.
    if args.workdir:
        config, tokenizer = run_dir.load_model_spec(args.workdir)
    else:
        config, tokenizer = hf.load_config(args.hf_dir), hf.load_tokenizer(args.hf_dir)
    # The prompts that fit the context, as in the run (jsonl problems that do not are left out).
    room = config.max_position_embeddings - settings["max_new_tokens"]
    try:
        source = build_source(task, tokenizer, max_prompt_tokens=room)
    except (DataError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    if args.workdir:
        step, model, tokenizer = run_dir.load_policy(args.workdir, step=args.step)
    else:
        step, model = None, hf.load_model(args.hf_dir)
    items = source.eval_items(settings["eval_size"])
    if not items:
        raise SystemExit("no evaluation problems: pass --eval_path for a math_jsonl task")
    ids = encode_prompts(tokenizer, items, getattr(source, "chat_formatted", False))
    if args.hf_dir and args.max_new_tokens is None:
        settings["max_new_tokens"] = task_budget(
            source, config.max_position_embeddings, max(map(len, ids))
        )
    # The engine, as in the run: its noise does not depend on the slot count, so the sampled
    # metrics are the run's own.
    # A chat model's reply ends with its turn, also where config.json names another EOS only.
    eos_ids = stop_token_ids(model.config.eos_token_ids, tokenizer)
    sampler, params = EngineSampler.for_model(model, pad_id=tokenizer.pad_token_id, eos_ids=eos_ids)
    metrics = evaluate(
        sampler, params, tokenizer, reward_name(task, source), items, ids,
        max_new_tokens=settings["max_new_tokens"], samples=settings["samples"],
        temperature=settings["temperature"], seed=settings["seed"],
    )  # fmt: skip
    metrics = {"step": step, **{k: round(v, 4) for k, v in metrics.items()}}
    print(json.dumps(metrics))
    cut = metrics.get("eval/truncated", 0.0)
    if cut > TRUNCATED_WARNING:
        budget = f"max_new_tokens={settings['max_new_tokens']}"
        if args.max_new_tokens is None:
            budget += " (the run's)" if args.workdir else " (the task's default)"
        print(
            f"[eval] warning: {cut:.0%} of the greedy completions reached {budget} without a "
            "stop token, so their answers may be cut off; rerun with a larger --max_new_tokens",
            file=sys.stderr,
        )
    return 0


# eval/truncated above this share (most completions cut) is warned about.
TRUNCATED_WARNING = 0.5
# The completion budget of a chat task (free-text answers) with --hf_dir and no --max_new_tokens.
CHAT_MAX_NEW_TOKENS = 256


def task_budget(source, context: int, longest_prompt: int) -> int:
    """The tokens to generate per prompt when no flag or run says: the task's longest completion
    where it knows it (chain_sum: up to 52), `CHAT_MAX_NEW_TOKENS` for a chat task (reasoning
    in free text; within the room the longest prompt leaves in the context), else
    `DEFAULTS["max_new_tokens"]` (arithmetic answers)."""
    longest = getattr(getattr(source, "task", None), "max_completion_tokens", None)
    if callable(longest):
        return longest()
    if getattr(source, "chat_formatted", False):
        budget = max(min(CHAT_MAX_NEW_TOKENS, context - longest_prompt), 1)
        _note(f"max_new_tokens={budget}, the default of a chat task (--max_new_tokens to change)")
        return budget
    return DEFAULTS["max_new_tokens"]


def _json_object(text: str) -> dict:
    """A --dataset_config value: a JSON object (parsed as data, never evaluated)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _note(text: str) -> None:
    print(f"[eval] note: {text}", file=sys.stderr)


if __name__ == "__main__":
    from jaxrl.infra.launcher import run_cli

    run_cli(main)

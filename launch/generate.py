"""Sample completions from a Hugging Face directory or a run's workdir.

    python -m launch.generate --hf_dir=DIR --prompts=prompts.txt --output=out.jsonl
    echo "12+7=" | python -m launch.generate --workdir=runs/arith --prompts=- --output=- --greedy

Prompts: a text file with one prompt per line, or a `.jsonl` file of `{"prompt": ...}` objects;
`-` reads standard input. Each output line holds the prompt, the completion text, its token ids,
their log-probs (under the distribution they were sampled from) and whether a stop token ended it.
On several devices `--tp` / `--dp` lay the model out tensor-parallel with data-parallel replicas.

Prompts go through the tokenizer's chat template as a user turn when a run's task formatted its
prompts so (`--workdir`), or when a HF directory's tokenizer has a chat template (an instruct
model); `--raw` (`--no_chat_template`) sends them as raw text, `--chat_template` always through
the template. Paths may start with `~`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time

import jax

from jaxrl.generation.engine_sampler import GENERATORS, make_sampler
from jaxrl.generation.sampling import SamplingConfig
from jaxrl.infra.errors import DataError
from jaxrl.infra.paths import user_path


def read_prompts(path: str) -> list[str]:
    stream = contextlib.nullcontext(sys.stdin) if path == "-" else open(path, encoding="utf-8")
    prompts = []
    with stream as stream:
        for number, line in enumerate(stream, start=1):
            line = line.rstrip("\n")
            if path.endswith(".jsonl"):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                    prompt = record["prompt"]
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise DataError(
                        f'{path}:{number}: expected a JSON object with a "prompt" string ({e})'
                    ) from None
            else:
                prompt = line
            if not isinstance(prompt, str) or not prompt.strip():
                raise DataError(f"{path}:{number}: empty prompt")
            prompts.append(prompt)
    if not prompts:
        raise DataError(f"{path}: no prompts")
    return prompts


def load(args):
    from jaxrl.job import workdir as run_dir
    from jaxrl.models import hf

    mesh = rules = None
    if args.tp * args.dp > 1:
        from jaxrl.infra.mesh import MeshConfig, make_mesh
        from jaxrl.infra.sharding import GENERATOR_RULES

        mesh = make_mesh(MeshConfig(("dp", "tp"), (args.dp, args.tp)))
        rules = GENERATOR_RULES
    if args.hf_dir:
        model = hf.load_model(args.hf_dir, mesh=mesh, rules=rules)
        tokenizer = hf.load_tokenizer(args.hf_dir)
    else:
        _, model, tokenizer = run_dir.load_policy(args.workdir)
        if mesh is not None:
            from flax import nnx

            from jaxrl.infra.sharding import param_shardings

            graphdef, state = nnx.split(model)
            model = nnx.merge(graphdef, jax.device_put(state, param_shardings(state, mesh, rules)))
    if tokenizer is None:
        raise ValueError("the checkpoint has no tokenizer; save one next to config.json")
    return model, tokenizer, mesh, rules


def encode(tokenizer, prompt: str, chat_template: bool) -> list[int]:
    if chat_template:
        if not tokenizer.chat_template:
            raise ValueError("--chat_template: this tokenizer has no chat template")
        # Rendered as text, then encoded without adding special tokens (the template writes
        # them): `tokenize=True` returns a list in transformers 4 but a BatchEncoding in 5.
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(prompt)


def use_chat_template(mode: str, tokenizer, workdir: str | None) -> bool:
    """Whether prompts go through the chat template: `mode` "on" / "off" as said; "auto" as the
    run in `workdir` formatted its task's prompts (its TaskSpec's source), else (a HF
    directory, or a run whose task cannot be built here) when the tokenizer has a chat
    template: an instruct model answers a bare text prompt with its end of turn at once."""
    if mode != "auto":
        return mode == "on"
    chat = run_chat_formatted(workdir, tokenizer) if workdir else None
    if chat is None:
        chat = bool(getattr(tokenizer, "chat_template", None))
        why = "the tokenizer has a chat template" if chat else "the tokenizer has no chat template"
    else:
        why = "as the run's task formatted its prompts"
    how = "through the chat template (--raw for raw text)" if chat else "as raw text"
    print(f"[generate] prompts {how}: {why}", file=sys.stderr)
    return chat


def run_chat_formatted(workdir: str, tokenizer) -> bool | None:
    """Whether the task of the run in `workdir` renders its prompts with the chat template
    (its source's `chat_formatted`), or None when the run's task cannot be built (a note)."""
    from jaxrl.job.specs import build_source
    from launch.eval import run_settings

    try:
        task, _ = run_settings(workdir)
        if task.name == "math_jsonl" and not task.train_path:
            task = dataclasses.replace(task, train_path=task.eval_path)
        source = build_source(task, tokenizer)
    except Exception as e:  # a task of the user's that fails here, a file that is gone
        print(f"[generate] note: the run's task is not built here ({e})", file=sys.stderr)
        return None
    return bool(getattr(source, "chat_formatted", False))


DEFAULT_MAX_NEW_TOKENS = 64


def completion_budget(requested: int | None, context: int, longest: int, truncate: bool) -> int:
    """Tokens to generate per prompt: `requested`, or by default up to 64 within the room the
    longest prompt leaves in the model's context (with --truncate, at most half the context,
    so a long prompt keeps its last tokens)."""
    if requested is not None:
        if truncate and requested >= context:
            raise ValueError(
                f"--max_new_tokens={requested} leaves no room for a prompt in the model's "
                f"context of {context} tokens; lower it (at most {context - 1})"
            )
        return requested
    room = context - longest
    if room < 1:
        if not truncate:
            raise ValueError(
                f"the longest prompt has {longest} tokens, which fills the model's context of "
                f"{context} tokens; shorten it, or pass --truncate (keeps its last tokens)"
            )
        room = max(context // 2, 1)
    return min(DEFAULT_MAX_NEW_TOKENS, room)


def sampling_help() -> str:
    """The sampling fields the flags set (`SamplingConfig`), for --help."""
    import dataclasses

    fields = ", ".join(
        f"{f.name}={f.default!r}"
        for f in dataclasses.fields(SamplingConfig)
        if f.default is not dataclasses.MISSING
    )
    return f"The flags fill jaxrl.generation.sampling.SamplingConfig (defaults: {fields})."


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description="Sample completions with the continuous-batching engine.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog=sampling_help(),
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--hf_dir", type=user_path, help="a save_pretrained directory (safetensors)"
    )
    source.add_argument(
        "--workdir", type=user_path, help="a jaxrl run's workdir (newest checkpoint)"
    )
    p.add_argument(
        "--prompts", required=True, type=user_path, help="prompt file (.txt lines or .jsonl), or -"
    )
    p.add_argument(
        "--output", required=True, type=user_path, help="output .jsonl, or - for standard output"
    )
    p.add_argument("--greedy", action="store_true")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top_k", type=int, default=0)
    p.add_argument("--top_p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--max_new_tokens",
        type=int,
        default=None,
        help="tokens to generate per prompt (default: 64, or less when the longest prompt "
        "leaves less room in the model's context)",
    )
    p.add_argument("--batch_size", type=int, default=32, help="prompts per generate call")
    p.add_argument(
        "--generator",
        choices=GENERATORS,
        default="engine",
        help="the continuous-batching engine, or the static left-padded sampler",
    )
    p.add_argument("--num_slots", type=int, default=0, help="engine decode slots (0: --batch_size)")
    p.add_argument(
        "--chat_template",
        nargs="?",
        const="on",
        default="auto",
        choices=("auto", "on", "off"),
        help="wrap each prompt as a user turn of the tokenizer's chat template. auto: as the "
        "run's task formatted its prompts (--workdir), else when the tokenizer has a chat "
        "template (an instruct model); --chat_template alone: on",
    )
    p.add_argument(
        "--no_chat_template",
        "--raw",
        dest="chat_template",
        action="store_const",
        const="off",
        help="prompts as raw text (the tokenizer adds its special tokens, e.g. BOS)",
    )
    p.add_argument("--truncate", action="store_true", help="keep the last tokens of long prompts")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel devices")
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas")
    args = p.parse_args(argv)

    prompts = read_prompts(args.prompts)
    model, tokenizer, mesh, rules = load(args)
    from flax import nnx

    graphdef, params = nnx.split(model)
    sampler = make_sampler(
        args.generator,
        graphdef,
        model.config,
        num_slots=args.num_slots or args.batch_size,
        pad_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
        eos_ids=model.config.eos_token_ids,
        mesh=mesh,
        rules=rules,
    )
    chat = use_chat_template(args.chat_template, tokenizer, args.workdir)
    ids_all = [encode(tokenizer, q, chat) for q in prompts]
    max_new_tokens = completion_budget(
        args.max_new_tokens, sampler.max_total_len, max(map(len, ids_all)), args.truncate
    )
    if args.max_new_tokens is None and max_new_tokens < DEFAULT_MAX_NEW_TOKENS:
        print(
            f"max_new_tokens={max_new_tokens}: the room the longest prompt leaves in the "
            f"model's context of {sampler.max_total_len} tokens",
            file=sys.stderr,
        )
    sampling = SamplingConfig(
        max_new_tokens=max_new_tokens,
        greedy=args.greedy,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
    )
    stop_ids = set(sampler.eos_ids) | set(sampling.stop_ids)
    key = jax.random.key(args.seed)
    # Standard output is written to, never closed (a caller in the same process keeps it).
    out = (
        contextlib.nullcontext(sys.stdout)
        if args.output == "-"
        else open(args.output, "w", encoding="utf-8")
    )
    start, total_tokens = time.perf_counter(), 0
    with out as out:
        for first in range(0, len(prompts), args.batch_size):
            batch = prompts[first : first + args.batch_size]
            ids = ids_all[first : first + args.batch_size]
            result = sampler.generate(
                params, ids, sampling, jax.random.fold_in(key, first), truncate=args.truncate
            )
            for i, prompt in enumerate(batch):
                n = int(result.lengths_b[i])
                tokens = result.tokens_bn[i, :n].tolist()
                record = {
                    "prompt": prompt,
                    "completion": tokenizer.decode(tokens, skip_special_tokens=True),
                    "completion_ids": tokens,
                    "logprobs": [round(float(x), 6) for x in result.logprobs_bn[i, :n]],
                    "stopped": bool(n and tokens[-1] in stop_ids),
                }
                out.write(json.dumps(record) + "\n")
                total_tokens += n
            print(
                f"generated {min(first + args.batch_size, len(prompts))}/{len(prompts)} prompts, "
                f"{total_tokens} tokens, {time.perf_counter() - start:.1f}s",
                file=sys.stderr,
            )
    return 0


if __name__ == "__main__":
    from jaxrl.infra.launcher import run_cli

    run_cli(main)

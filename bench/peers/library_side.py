"""The library's side of `bench.peers`: the model export, the RL step through the public API or
the Controller, and generation alone on the continuous-batching engine.

Run by the orchestrators in a fresh process pinned to one core (`python -m
bench.peers.library_side MODE ...`); prints one `ROW` line (`workload.emit`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from bench.peers import workload


def word_tokenizer(vocab_size: int):
    """A tokenizer whose token for id i is the text "i" (0 pad, 1 bos, 2 eos): the tiny shape's
    prompts are their ids written out, so every side tokenizes them to the same ids."""
    import tokenizers
    import transformers

    model = tokenizers.models.WordLevel({str(i): i for i in range(vocab_size)}, unk_token="0")
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="0", bos_token="1", eos_token="2", unk_token="0"
    )


def export_tiny(path: str, smoke: bool) -> None:
    """The rlbench-tiny Llama at the trainer's seed-0 init (the weights `bench.rl` starts from),
    as an HF safetensors folder with `word_tokenizer`."""
    from flax import nnx

    from jaxrl.infra.mesh import MeshConfig, make_mesh
    from jaxrl.infra.sharding import TRAINER_RULES
    from jaxrl.models import hf
    from jaxrl.models.presets import rlbench_tiny
    from jaxrl.models.transformer import Transformer
    from jaxrl.train.trainer import OptimizerConfig, Trainer

    # bench.rl's model (its --smoke: 1 layer, hidden 32)
    small = dict(hidden_size=32, intermediate_size=64, num_layers=1) if smoke else {}
    config = rlbench_tiny(**small)
    mesh = make_mesh(MeshConfig(("fsdp", "tp"), (1, 1), 0, 1))
    trainer = Trainer(config, mesh, TRAINER_RULES, OptimizerConfig().make(1))
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
    nnx.replace_by_pure_dict(state, trainer.init_params(0))
    hf.save_hf(nnx.merge(graphdef, state), path, tokenizer=word_tokenizer(config.vocab_size))


def prompts(shape: workload.Shape, tokenizer, step: int):
    """Step `step`'s prompt ids and the reward function for its completions' texts."""
    if shape.name.startswith("tiny"):
        ids = workload.tiny_prompt_ids(step, shape.num_prompts, tokenizer.vocab_size)
        return ids, workload.even_ids
    messages, answers = workload.smol_messages(step, shape.num_prompts)
    ids = [tokenizer.apply_chat_template(m, add_generation_prompt=True) for m in messages]
    ids = [list(x["input_ids"] if hasattr(x, "keys") else x) for x in ids]
    per_row = [a for a in answers for _ in range(shape.samples)]
    return ids, lambda texts: workload.arithmetic_correct(texts, per_row)


def rl_public(
    model: str,
    shape: workload.Shape,
    steps: int,
    generator: str,
    slots: int = 0,
    pack_length: int = 0,
) -> dict:
    """RL steps as a user writes them: `Trainer.from_hf` (GRPO; `pack_length` > 0: packed
    batches, each group's prompt trained on once), the colocated sampler,
    `rollouts_from_samples` / `collate_rollouts`, `Trainer.rl_step`."""
    import jax
    import numpy as np

    from jaxrl.generation.placement import colocated_sampler
    from jaxrl.generation.sampling import SamplingConfig
    from jaxrl.models import hf
    from jaxrl.rl import collate_rollouts, rollouts_from_samples
    from jaxrl.tasks.rewards import decode_completions
    from jaxrl.train.trainer import LossConfig, OptimizerConfig, Trainer

    trainer, state = Trainer.from_hf(
        model,
        OptimizerConfig(learning_rate=shape.learning_rate),
        total_steps=steps,
        loss=LossConfig(name="grpo", temperature=shape.temperature),
        pack_length=pack_length,
    )
    tokenizer = hf.load_tokenizer(model)
    # slots 0: the library's default engine size (256 decode slots)
    sizing = {"num_slots": slots} if slots else {}
    sampler = colocated_sampler(
        trainer, tokenizer, prompt_buckets=(shape.prompt_len,), generator=generator, **sizing
    )
    sampling = SamplingConfig(max_new_tokens=shape.new_tokens, temperature=shape.temperature)
    g = shape.samples
    records = []
    for step in range(steps):
        prompt_ids, reward_fn = prompts(shape, tokenizer, step)
        start = time.perf_counter()
        out = sampler.generate(
            state.params, prompt_ids, sampling, jax.random.key(step), num_samples=g
        )
        lengths = np.asarray(out.lengths_b)
        tokens = np.asarray(out.tokens_bn)
        generated = time.perf_counter()
        texts = decode_completions(tokenizer, [tokens[i, :n] for i, n in enumerate(lengths)])
        rows = [p for p in prompt_ids for _ in range(g)]
        rollouts = rollouts_from_samples(
            rows, out, reward_fn(texts), group_ids=np.repeat(np.arange(len(prompt_ids)), g)
        )
        batch = collate_rollouts(
            rollouts,
            prompt_len=shape.prompt_len,
            completion_len=shape.new_tokens,
            pad_id=tokenizer.pad_token_id,
        )
        scored = time.perf_counter()
        state, metrics = trainer.rl_step(state, batch)
        jax.block_until_ready((state, metrics))
        end = time.perf_counter()
        records.append(
            dict(
                step_s=end - start,
                generate_s=generated - start,
                train_s=end - scored,
                completion_tokens=int(lengths.sum()),
            )
        )
    return workload.summarise(records, warmup=min(2, steps - 1))


def rl_controller(steps: int, smoke: bool) -> dict:
    """`bench.rl`'s one-core sync row: the library's Controller (AIPO, the engine) on the same
    seed-0 weights."""
    from bench.rl import PROXY_SYNC_1, run_mode

    row = run_mode(PROXY_SYNC_1, steps, smoke)
    return {k: row[k] for k in ("steps_measured", "step_s", "generate_s", "train_s")}


def generate_only(model: str, num_prompts: int, new_tokens: int, rounds: int, slots: int) -> dict:
    """Generation alone: `num_prompts` chat-templated prompts, one sample each, temperature 1,
    EOS respected, on the continuous-batching engine (`slots` decode slots); the mean over
    `rounds` rounds after a warm-up round (compiles) of seconds and completion tokens."""
    import jax
    import numpy as np

    from jaxrl.generation.engine import Engine
    from jaxrl.generation.engine_requests import Request
    from jaxrl.generation.sampling import SamplingConfig
    from jaxrl.models import hf

    model_obj = hf.load_model(model)
    tokenizer = hf.load_tokenizer(model)
    if getattr(tokenizer, "chat_template", None):
        messages, _ = workload.smol_messages(0, num_prompts)
        ids = [tokenizer.apply_chat_template(m, add_generation_prompt=True) for m in messages]
        ids = [list(x["input_ids"] if hasattr(x, "keys") else x) for x in ids]
    else:  # the tiny model's id tokenizer (--smoke)
        ids = workload.tiny_prompt_ids(0, num_prompts, tokenizer.vocab_size)
    engine, params = Engine.for_model(model_obj, num_slots=min(slots, num_prompts))
    sampling = SamplingConfig(max_new_tokens=new_tokens, temperature=1.0)
    times, tokens = [], []
    for r in range(rounds + 1):
        requests = [Request(r * num_prompts + i, p, 1, sampling) for i, p in enumerate(ids)]
        start = time.perf_counter()
        groups = engine.generate(params, requests, jax.random.key(r))
        n = int(sum(np.asarray(g.mask_gn).sum() for g in groups))
        times.append(time.perf_counter() - start)
        tokens.append(n)
    return workload.generation_summary(times, tokens, rounds, ids)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["export", "public", "controller", "generate"])
    parser.add_argument("--model", required=True, help="HF folder (export: where to write it)")
    workload.add_shape_flags(parser)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--generator", default="engine", choices=["engine", "static"])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--slots", type=int, default=64, help="generate: the engine's slots")
    parser.add_argument("--rl_slots", type=int, default=0, help="public: the sampler's slots")
    parser.add_argument(
        "--pack_length", type=int, default=0, help="public: packed rows (0: padded batches)"
    )
    args = parser.parse_args(argv)
    # As the CPU launchers do (launch/__init__.py): XLA:CPU's temporary buffers reuse freed pages.
    from jaxrl.infra.xla_cpu import keep_freed_memory, keep_freed_memory_wanted

    if keep_freed_memory_wanted():
        keep_freed_memory()
    if args.mode == "export":
        export_tiny(args.model, args.smoke)
        return
    if args.mode == "controller":
        workload.emit(rl_controller(args.steps, args.smoke))
    elif args.mode == "public":
        shape = workload.shape_from_args(args)
        row = rl_public(
            args.model, shape, args.steps, args.generator, args.rl_slots, args.pack_length
        )
        workload.emit(row)
    else:
        workload.emit(
            generate_only(args.model, args.prompts, args.new_tokens or 128, args.rounds, args.slots)
        )


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    main(sys.argv[1:])

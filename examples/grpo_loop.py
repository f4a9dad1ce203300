"""GRPO in plain Python from the library's pieces: no controller, no gin, no launcher.

A short SFT warm start on the arithmetic demonstrations, then GRPO (`LossConfig(name="grpo")`:
group mean/std advantages, sequence mean of token means, clip 0.2) without gradient clipping:
sample a group of completions per prompt from the trainer's own params, decode them (no special
tokens), score them, turn them into `Rollout`s, collate, take one optimizer step.

    python examples/grpo_loop.py [--sft_steps 300] [--rl_steps 100] [--hf_dir DIR]

`--hf_dir` starts from a HF `save_pretrained` directory instead (`Trainer.from_hf`, no SFT).
"""

from __future__ import annotations

import argparse

import jax
import numpy as np

from jaxrl.generation.placement import colocated_sampler
from jaxrl.generation.sampling import SamplingConfig
from jaxrl.infra.mesh import MeshConfig, make_mesh
from jaxrl.infra.sharding import TRAINER_RULES
from jaxrl.job.specs import PolicySpec, TaskSpec, build_model_config, build_source, build_tokenizer
from jaxrl.models import hf
from jaxrl.rl import collate_rollouts, rollouts_from_samples
from jaxrl.tasks.rewards import compute_rewards, decode_completions
from jaxrl.tasks.source import encode_prompts
from jaxrl.train.trainer import LossConfig, OptimizerConfig, Trainer


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sft_steps", type=int, default=300)
    parser.add_argument("--rl_steps", type=int, default=100)
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step")
    parser.add_argument("--group", type=int, default=8, help="samples per prompt")
    parser.add_argument("--hf_dir", default="")
    args = parser.parse_args(argv)
    source = build_source(TaskSpec(), None)  # 1-2 digit addition
    max_new_tokens, seq_len = 6, 16

    if args.hf_dir:  # a HF directory straight into a trainer, params in its shardings
        tokenizer = hf.load_tokenizer(args.hf_dir)
        rl_opt = OptimizerConfig(learning_rate=1e-4, max_grad_norm=None)
        trainer, state = Trainer.from_hf(
            args.hf_dir, rl_opt, total_steps=args.rl_steps, loss=LossConfig(name="grpo")
        )
        first_item = 0
    else:
        tokenizer = build_tokenizer(PolicySpec(), TaskSpec())
        model_config = build_model_config(PolicySpec(), tokenizer)  # 0.4M-parameter Llama
        mesh = make_mesh(MeshConfig(("fsdp", "tp"), (-1, 1)))  # every device, FSDP
        sft_opt = OptimizerConfig(2e-3, warmup_steps=20, schedule="linear")
        sft = Trainer(model_config, mesh, TRAINER_RULES, sft_opt.make(args.sft_steps))
        state = sft.init(sft.init_params(seed=0))
        for step in range(args.sft_steps):
            tokens, mask = source.demonstrations(step * 64, 64, tokenizer, seq_len)
            state, _ = sft.sft_step(state, {"tokens_bs": tokens, "loss_mask_bs": mask})
        rl_opt = OptimizerConfig(learning_rate=2e-4, max_grad_norm=None)
        trainer = Trainer(
            model_config, mesh, TRAINER_RULES, rl_opt.make(args.rl_steps),
            loss=LossConfig(name="grpo"),
            pack_length="auto",  # packed rows, each group's prompt once (from_hf's default)
        )  # fmt: skip
        state = trainer.init(state.params)  # fresh optimizer state
        first_item = args.sft_steps * 64  # RL prompts after the ones SFT trained on

    sampler = colocated_sampler(trainer, tokenizer)
    sampling = SamplingConfig(max_new_tokens=max_new_tokens, temperature=1.0)
    key, history = jax.random.key(0), []
    for step in range(args.rl_steps):
        start = first_item + step * args.prompts
        items = [source.item(start + j) for j in range(args.prompts)]
        rows = [it for it in items for _ in range(args.group)]  # each prompt `group` times
        prompt_ids = encode_prompts(tokenizer, rows, chat_formatted=False)
        out = sampler.generate(state.params, prompt_ids, sampling, jax.random.fold_in(key, step))
        texts = decode_completions(
            tokenizer, [out.tokens_bn[i, :n] for i, n in enumerate(out.lengths_b)]
        )
        rewards = compute_rewards(
            source.reward_name, [r.text for r in rows], texts, [r.reference for r in rows]
        )
        groups = np.repeat(np.arange(args.prompts), args.group)
        rollouts = rollouts_from_samples(prompt_ids, out, rewards, groups, policy_version=step)
        prompt_len = max(len(p) for p in prompt_ids)
        prompt_len = next(b for b in sampler.prompt_buckets if b >= prompt_len)  # one compile
        batch = collate_rollouts(
            rollouts, prompt_len=prompt_len, completion_len=max_new_tokens,
            pad_id=tokenizer.pad_token_id,
        )  # fmt: skip
        state, metrics = trainer.rl_step(state, batch)
        record = {"step": step + 1, "reward": float(rewards.mean())}
        record |= {k: float(metrics[k]) for k in ("loss", "grad_norm", "clip_fraction")}
        history.append(record)
        print(" ".join(f"{k}={v:.4g}" for k, v in record.items()), flush=True)
    return history


if __name__ == "__main__":
    main()

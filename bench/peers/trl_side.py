"""TRL's side of `bench.peers`: `trl.GRPOTrainer` on an HF folder, timed per step.

Runs in the TRL virtual environment (docs/peers.md), the repository root on `PYTHONPATH`:

    PYTHONPATH=. /tmp/peers/trl/bin/python -m bench.peers.trl_side rl --model DIR --shape tiny
    PYTHONPATH=. /tmp/peers/trl/bin/python -m bench.peers.trl_side generate --model DIR

The RL step: `GRPOConfig(loss_type="grpo", beta=0, scale_rewards="group", epsilon=0.2)`, one
optimizer step per generation batch (`per_device_train_batch_size` = prompts x G), constant
learning rate, AdamW, sampling with transformers `generate` at temperature 1 (no top-k / top-p),
fp32 on the CPU, no gradient checkpointing (TRL's default turns it on; the library's
remat_policy defaults to none). Per step: `step_s` from the trainer's `on_step_begin` to
`on_step_end` (after the optimizer step), `generate_s` the time in `_generate_single_turn`
(sampling), `train_s` the step less `_generate_and_score_completions` (sampling, rewards,
advantages).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from bench.peers import workload


def _dataset(shape: workload.Shape, steps: int):
    import datasets

    rows = []
    for step in range(steps):
        if shape.name.startswith("tiny"):
            for text in workload.tiny_prompt_texts(step, shape.num_prompts):
                rows.append({"prompt": text, "answer": ""})
        else:
            messages, answers = workload.smol_messages(step, shape.num_prompts)
            rows += [{"prompt": m, "answer": a} for m, a in zip(messages, answers, strict=True)]
    return datasets.Dataset.from_list(rows)


def _text(completion) -> str:
    return completion if isinstance(completion, str) else completion[-1]["content"]


def rl(model_dir: str, shape: workload.Shape, steps: int) -> dict:
    import torch
    import transformers
    import trl

    torch.set_num_threads(1)
    torch.manual_seed(0)
    tiny = shape.name.startswith("tiny")

    def reward(prompts, completions, answer, **kwargs):
        texts = [_text(c) for c in completions]
        return workload.even_ids(texts) if tiny else workload.arithmetic_correct(texts, answer)

    timings = {"generate": 0.0, "score": 0.0}
    records = []

    class Timed(trl.GRPOTrainer):
        def _generate_single_turn(self, *args, **kwargs):
            start = time.perf_counter()
            try:
                return super()._generate_single_turn(*args, **kwargs)
            finally:
                timings["generate"] += time.perf_counter() - start

        def _generate_and_score_completions(self, *args, **kwargs):
            start = time.perf_counter()
            try:
                out = super()._generate_and_score_completions(*args, **kwargs)
            finally:
                timings["score"] += time.perf_counter() - start
            timings["tokens"] = int(out["completion_mask"].sum())
            return out

    class StepTimer(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            timings.update(generate=0.0, score=0.0, start=time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            step_s = time.perf_counter() - timings["start"]
            records.append(
                dict(
                    step_s=step_s,
                    generate_s=timings["generate"],
                    train_s=step_s - timings["score"],
                    completion_tokens=timings.get("tokens", 0),
                )
            )

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = tempfile.mkdtemp(prefix="trl_side_")
    config = trl.GRPOConfig(
        output_dir=out,
        per_device_train_batch_size=shape.rows,
        gradient_accumulation_steps=1,
        num_generations=shape.samples,
        max_completion_length=shape.new_tokens,
        temperature=shape.temperature,
        top_p=1.0,
        top_k=0,
        learning_rate=shape.learning_rate,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        gradient_checkpointing=False,  # TRL's default is True; the library's remat is off
        loss_type="grpo",
        beta=0.0,
        epsilon=0.2,
        scale_rewards="group",
        max_steps=steps,
        shuffle_dataset=False,
        logging_steps=10**6,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = Timed(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=_dataset(shape, steps),
        processing_class=tokenizer,
        callbacks=[StepTimer()],
    )
    trainer.train()
    return workload.summarise(records, warmup=min(2, steps - 1)) | {
        "versions": f"trl {trl.__version__}, transformers {transformers.__version__}, "
        f"torch {torch.__version__}"
    }


def generate(model_dir: str, num_prompts: int, new_tokens: int, rounds: int, way: str) -> dict:
    """Generation alone: `num_prompts` chat-templated prompts, one sample each, temperature 1,
    EOS respected; `way` "generate" (one left-padded batch) or "generate_batch" (transformers'
    continuous batching, its paged cache bounded to the prompts' pages)."""
    import torch
    import transformers

    torch.set_num_threads(1)
    torch.manual_seed(0)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    messages, _ = workload.smol_messages(0, num_prompts)
    ids = [
        tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True)
        for m in messages
    ]
    ids = [list(x["input_ids"]) if hasattr(x, "keys") else list(x) for x in ids]
    config = transformers.GenerationConfig(
        max_new_tokens=new_tokens,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if way == "generate_batch" and not hasattr(model, "generate_batch"):
        raise SystemExit(f"transformers {transformers.__version__} has no generate_batch")
    batching = None
    if way == "generate_batch":
        # A bounded paged cache: left to itself it sizes the cache from free memory (0.9 of it),
        # 11 GB and growing for 16 prompts on a 23 GB host. One 256-token page per sequence
        # holds a prompt and its completion; at most 1024 tokens per forward.
        pages = -(-(max(map(len, ids)) + new_tokens) // 256)
        batching = transformers.ContinuousBatchingConfig(
            page_size=256,
            num_blocks=pages * len(ids) + 8,
            max_batch_tokens=1024,
            max_requests_per_batch=len(ids),
        )
    times, tokens = [], []
    for _ in range(rounds + 1):
        start = time.perf_counter()
        with torch.no_grad():
            if way == "generate":
                batch = tokenizer.pad({"input_ids": ids}, return_tensors="pt")
                out = model.generate(**batch, generation_config=config)
                new = out[:, batch["input_ids"].shape[1] :]
                done = (new == tokenizer.eos_token_id).int().cumsum(-1)
                # tokens up to and including the first EOS
                n = int(((done == 0) | ((done == 1) & (new == tokenizer.eos_token_id))).sum())
            else:
                results = model.generate_batch(
                    ids,
                    generation_config=config,
                    continuous_batching_config=batching,
                    progress_bar=False,
                )
                n = sum(len(r.generated_tokens) for r in results.values())
        times.append(time.perf_counter() - start)
        tokens.append(n)
    return workload.generation_summary(times, tokens, rounds, ids) | dict(
        versions=f"transformers {transformers.__version__}, torch {torch.__version__}",
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["rl", "generate", "generate_batch"])
    parser.add_argument("--model", required=True)
    workload.add_shape_flags(parser)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    if args.mode == "rl":
        workload.emit(rl(args.model, workload.shape_from_args(args), args.steps))
    else:
        workload.emit(
            generate(args.model, args.prompts, args.new_tokens or 128, args.rounds, args.mode)
        )


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main(sys.argv[1:])

"""Tunix's side of `bench.peers`: `tunix.rl.grpo.grpo_learner.GRPOLearner` on an HF folder,
timed per step.

Runs in the Tunix virtual environment (docs/peers.md), the repository root on `PYTHONPATH`:

    PYTHONPATH=. /tmp/peers/tunix/bin/python -m bench.peers.tunix_side --model DIR --shape tiny

The model: Tunix's llama3 `Llama3` from `create_model_from_safe_tensors`, its `ModelConfig` built
from the folder's config.json (Tunix's llama3 loader takes no HF config: layers, vocab, hidden,
intermediate, heads, head_dim, KV heads, rope theta, RMS eps and tied embeddings are copied;
it has no RoPE scaling, no attention bias). One device mesh (fsdp 1 x tp 1), the actor, rollout
and (unused, beta 0) reference roles colocated; the "vanilla" rollout engine (Tunix's JAX
sampler) at temperature 1, top_p 1; `GRPOConfig(num_generations=G, beta=0, epsilon=0.2)`, one
optimizer step (optax AdamW, clipped to norm 1) per global step over the whole batch.

Per step: `step_s` one global step (`_run_global_step`, through the actor's update, blocked on its
params) plus any weight sync; `generate_s` the time in `RLCluster.generate`; `train_s` the time
in `RLCluster.update_actor` (blocked on the actor's params).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from bench.peers import workload


class IdTokenizer:
    """The tiny shape's tokenizer for Tunix: a prompt's text is its ids; no BOS is added (Tunix's
    sampler prepends `bos_id()` when it is truthy; the other sides' prompts have none)."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode(self, text: str, **kwargs) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids, **kwargs) -> str:
        return " ".join(str(int(i)) for i in ids if int(i) > 2)

    def bos_id(self):
        return None

    def eos_id(self) -> int:
        return 2

    def pad_id(self) -> int:
        return 0


def model_config(model_dir: str):
    """Tunix's llama3 `ModelConfig` from an HF config.json."""
    from tunix.models.llama3 import model as llama3

    with open(os.path.join(model_dir, "config.json")) as f:
        hf = json.load(f)
    if hf.get("model_type") != "llama":
        raise SystemExit(
            f"{model_dir}: model_type {hf.get('model_type')!r}; Tunix's llama3 needs llama"
        )
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_type", "default") not in ("default", None):
        raise SystemExit(f"{model_dir}: RoPE {rope}; Tunix's llama3 model has no RoPE scaling")
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    return llama3.ModelConfig(
        num_layers=hf["num_hidden_layers"],
        vocab_size=hf["vocab_size"],
        embed_dim=hf["hidden_size"],
        hidden_dim=hf["intermediate_size"],
        num_heads=hf["num_attention_heads"],
        head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        num_kv_heads=hf["num_key_value_heads"],
        rope_theta=int(theta),
        norm_eps=hf["rms_norm_eps"],
        weight_tying=bool(hf.get("tie_word_embeddings", False)),
    )


def _batches(shape: workload.Shape, steps: int, tokenizer):
    """One dict per step: "prompts" (texts; smol ones chat-templated) and "answer"."""
    import numpy as np

    out = []
    for step in range(steps):
        if shape.name.startswith("tiny"):
            texts = workload.tiny_prompt_texts(step, shape.num_prompts)
            answers = [""] * len(texts)
        else:
            messages, answers = workload.smol_messages(step, shape.num_prompts)
            texts = [
                tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False)
                for m in messages
            ]
        # Arrays, not lists: Tunix repeats each leaf G times with `jax.tree.map(np.repeat)`.
        out.append({"prompts": np.array(texts), "answer": np.array(answers)})
    return out


def rl(model_dir: str, shape: workload.Shape, steps: int) -> dict:
    import jax
    import jax.numpy as jnp
    import optax
    import transformers
    from flax import nnx
    from tunix.models.llama3 import params as llama3_params
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout

    tiny = shape.name.startswith("tiny")
    auto = (jax.sharding.AxisType.Auto,) * 2  # Tunix's models index with implicit shardings
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=auto)
    config = model_config(model_dir)
    with mesh:
        model = llama3_params.create_model_from_safe_tensors(
            model_dir, config, mesh, dtype=jnp.float32
        )
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    tokenizer = IdTokenizer(config.vocab_size) if tiny else hf_tokenizer
    prompt_len = shape.prompt_len
    cluster_config = rl_cluster_lib.ClusterConfig(
        role_to_mesh={
            rl_cluster_lib.Role.ACTOR: mesh,
            rl_cluster_lib.Role.REFERENCE: mesh,
            rl_cluster_lib.Role.ROLLOUT: mesh,
        },
        rollout_engine="vanilla",
        offload_to_cpu=False,
        training_config=rl_cluster_lib.RLTrainingConfig(
            actor_optimizer=optax.chain(
                optax.clip_by_global_norm(1.0), optax.adamw(shape.learning_rate, weight_decay=0.0)
            ),
            eval_every_n_steps=10**6,
            max_steps=steps,
            mini_batch_size=shape.num_prompts,
            pbar_description=None,
        ),
        rollout_config=base_rollout.RolloutConfig(
            max_tokens_to_generate=shape.new_tokens,
            max_prompt_length=prompt_len,
            kv_cache_size=prompt_len + shape.new_tokens + 8,
            temperature=shape.temperature,
            top_p=1.0,
            top_k=None,
        ),
    )
    cluster = rl_cluster_lib.RLCluster(
        actor=model, tokenizer=tokenizer, cluster_config=cluster_config
    )

    def reward(prompts, completions, answer=None, **kwargs):
        if tiny:
            return workload.even_ids(completions)
        return workload.arithmetic_correct(completions, list(answer))

    learner = grpo_learner.GRPOLearner(
        rl_cluster=cluster,
        algo_config=grpo_learner.GRPOConfig(
            num_generations=shape.samples, num_iterations=1, beta=0.0, epsilon=0.2
        ),
        reward_fns=[reward],
    )
    timings = {"generate": 0.0, "train": 0.0, "tokens": 0}
    records = []

    def params_ready():
        jax.block_until_ready(nnx.state(cluster.actor_trainer.model))

    generate, update_actor = cluster.generate, cluster.update_actor
    run_step, sync = learner._run_global_step, cluster.sync_weights

    def timed_generate(*args, **kwargs):
        start = time.perf_counter()
        out = generate(*args, **kwargs)
        jax.block_until_ready(getattr(out, "tokens", None))
        timings["generate"] += time.perf_counter() - start
        try:
            timings["tokens"] += int(sum(len(t) for t in out.tokens))
        except TypeError:
            pass
        return out

    def timed_update(*args, **kwargs):
        start = time.perf_counter()
        update_actor(*args, **kwargs)
        params_ready()
        timings["train"] += time.perf_counter() - start

    def timed_step(*args, **kwargs):
        timings.update(generate=0.0, train=0.0, tokens=0, start=time.perf_counter())
        run_step(*args, **kwargs)
        params_ready()
        records.append(
            dict(
                step_s=time.perf_counter() - timings["start"],
                generate_s=timings["generate"],
                train_s=timings["train"],
                completion_tokens=timings["tokens"],
            )
        )

    def timed_sync():
        start = time.perf_counter()
        sync()
        if records:
            records[-1]["step_s"] += time.perf_counter() - start

    cluster.generate, cluster.update_actor = timed_generate, timed_update
    learner._run_global_step, cluster.sync_weights = timed_step, timed_sync
    learner.train(_batches(shape, steps, hf_tokenizer))
    import importlib.metadata as md

    return workload.summarise(records, warmup=min(2, len(records) - 1)) | {
        "versions": f"google-tunix {md.version('google-tunix')}, jax {jax.__version__}, "
        f"flax {md.version('flax')}"
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    workload.add_shape_flags(parser)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args(argv)
    workload.emit(rl(args.model, workload.shape_from_args(args), args.steps))


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    main(sys.argv[1:])

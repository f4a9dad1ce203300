"""Supervised warm start on the task's demonstrations.

A finished stage means its learning-rate schedule has decayed (to zero by default): RL started
from a checkpoint cut off at full learning rate would "improve" under any further low-rate
training, RL or not.
"""

from __future__ import annotations

import dataclasses

import jax

from jaxrl.generation.placement import colocated_sampler
from jaxrl.infra.mesh import MeshConfig, make_mesh
from jaxrl.infra.run_io import RunIO, to_host
from jaxrl.infra.sharding import TRAINER_RULES
from jaxrl.job import workdir as run_dir
from jaxrl.job.specs import (
    PolicySpec,
    TaskSpec,
    build_model_config,
    build_source,
    build_tokenizer,
    reward_name,
)
from jaxrl.loop.report import StepReport
from jaxrl.tasks.source import PromptSource, SkipSource, encode_prompts
from jaxrl.train.evaluation import evaluate
from jaxrl.train.state import Params
from jaxrl.train.trainer import OptimizerConfig, Trainer

__all__ = ["SFTConfig", "rl_source_after_sft", "run_sft", "sft_items_used"]


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """The supervised warm start: `steps` AdamW steps on batches of `batch_size` demonstrations
    (padded to `seq_len` tokens), evaluated greedily on `eval_size` held-out problems (0: no
    evaluation).
    `num_demonstrations` > 0 limits the demonstrations to a pool of that many worked problems,
    cycled (a scarce-data warm start); 0 draws fresh ones from the task's unlimited stream.
    Without a terminal, a progress line every `log_every_steps` steps. `pack_length` > 0 packs
    each batch's demonstrations (up to their last answer token) into rows of that many tokens
    (`jaxrl.rl.packing`; at most `seq_len` is needed)."""

    steps: int = 300
    batch_size: int = 64
    seq_len: int = 16
    optimizer: OptimizerConfig = OptimizerConfig(
        learning_rate=1e-3, warmup_steps=20, schedule="linear", end_learning_rate=0.0
    )
    eval_every_steps: int = 100
    eval_size: int = 512
    eval_samples: int = 4
    max_new_tokens: int = 6
    save_every_steps: int = 100
    keep_last_n: int = 2
    seed: int = 0
    num_demonstrations: int = 0
    log_every_steps: int = 50
    pack_length: int = 0

    def validate(self) -> None:
        if self.num_demonstrations < 0:
            raise ValueError(
                f"SFTConfig.num_demonstrations={self.num_demonstrations}: use 0 (an unlimited "
                "stream of demonstrations) or a positive pool size"
            )
        for name in (
            "steps",
            "batch_size",
            "seq_len",
            "eval_every_steps",
            "save_every_steps",
            "log_every_steps",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"SFTConfig.{name}={getattr(self, name)} must be >= 1")


def sft_items_used(config: SFTConfig) -> int:
    """The SFT stage trains on items [0, n) of the task's train stream (the demonstration pool, or
    every item its batches drew); RL after an SFT warm start starts its prompt stream at n, so
    its first batches are not memorised demonstrations."""
    return config.num_demonstrations or config.steps * config.batch_size


def rl_source_after_sft(source: PromptSource, config: SFTConfig) -> SkipSource:
    """The RL prompt stream after an SFT warm start on `source`: it starts after the items the SFT
    stage trained on and, for a demonstration pool, never yields one of the pool's prompts (a
    stream drawn with replacement repeats prompts; the pool's are memorised, reward ~1, and
    teach RL nothing). With an unlimited demonstration stream only the offset applies."""
    pool = config.num_demonstrations
    exclude = frozenset(source.item(i).text for i in range(pool))
    return SkipSource(source, sft_items_used(config), exclude)


def run_sft(
    workdir: str, policy: PolicySpec, task: TaskSpec, config: SFTConfig, mesh_config: MeshConfig
) -> Params:
    """Trains (or resumes, or finds finished) the SFT stage in `workdir`; returns its params."""
    tokenizer = build_tokenizer(policy, task)
    model_config = build_model_config(policy, tokenizer)
    room = model_config.max_position_embeddings - config.max_new_tokens
    source = build_source(task, tokenizer, max_prompt_tokens=room)
    mesh = make_mesh(mesh_config)
    optimizer = config.optimizer.make(config.steps)
    trainer = Trainer(
        model_config,
        mesh,
        TRAINER_RULES,
        optimizer,
        grad_accum_steps=config.optimizer.grad_accum_steps,
        pack_length=config.pack_length,
    )
    run_dir.save_model_spec(workdir, model_config, tokenizer)
    io = RunIO(
        workdir,
        total_steps=config.steps,
        save_every_steps=config.save_every_steps,
        keep_last_n=config.keep_last_n,
        desc="sft",
        log_every_steps=config.log_every_steps,
    )
    try:
        restored = io.restore(trainer.abstract_state())
        if restored is None:
            if policy.init_from:
                from jaxrl.models import hf

                params = hf.load_params(policy.init_from, model_config, trainer.param_shardings)
                import flax.nnx as nnx

                params = nnx.to_pure_dict(params)
            else:
                params = trainer.init_params(config.seed)
            state = trainer.init(params)
        else:
            state, _ = restored
        step = int(state.step)
        if step >= config.steps:
            return state.params

        sampler = colocated_sampler(trainer, tokenizer)
        eval_items = source.eval_items(config.eval_size)
        eval_ids = encode_prompts(tokenizer, eval_items, getattr(source, "chat_formatted", False))

        def run_eval(params) -> dict:
            if not eval_items:  # eval_size = 0: no evaluation
                return {}
            return evaluate(
                sampler,
                params,
                tokenizer,
                reward_name(task, source),
                eval_items,
                eval_ids,
                max_new_tokens=config.max_new_tokens,
                samples=config.eval_samples,
                seed=config.seed,
            )

        report = StepReport(
            io,
            total_steps=config.steps,
            eval_every_steps=config.eval_every_steps,
            evaluate=run_eval,
        )
        report.start(step)
        while step < config.steps:
            tokens, loss_mask = source.demonstrations(
                step * config.batch_size,
                config.batch_size,
                tokenizer,
                config.seq_len,
                pool=config.num_demonstrations,
            )
            state, metrics = trainer.sft_step(
                state, {"tokens_bs": tokens, "loss_mask_bs": loss_mask}
            )
            step += 1
            metrics = to_host(metrics)
            metrics["learning_rate"] = float(config.optimizer.schedule_fn(config.steps)(step - 1))
            headline = {"loss": f"{metrics['loss']:.3f}"}
            report.step(step, state, metrics, headline, _sft_extra(config))
        jax.block_until_ready(state.params)
        return state.params
    finally:
        io.close()


def _sft_extra(config: SFTConfig):
    """The checkpoint's run state of an SFT step: where the demonstrations continue."""
    return lambda step: {"data_position": step * config.batch_size, "stage": "sft"}

"""RL post-training of a policy (LlamaRL-style controller).

    python -m launch.rl --gin_file=configs/rl/arith_tiny_sync.gin --workdir=runs/arith_sync

Recipe: config (already validated by `launch`) -> tokenizer, model config, task -> trainer mesh
and shardings -> initial params (this run's newest checkpoint, else `init_from`, else the SFT
stage in WORKDIR/sft, else random) -> executors -> controller loop -> wait for checkpoints.
"""

from __future__ import annotations

import os

import gin
from flax import nnx

from jaxrl import workdir as run_dir
from jaxrl.controller import Controller, sampling_config
from jaxrl.executors import GeneratorExecutor, RewardExecutor
from jaxrl.infra.config import launch
from jaxrl.infra.mesh import make_mesh
from jaxrl.infra.sharding import TRAINER_RULES
from jaxrl.run_io import RunIO
from jaxrl.sft import colocated_sampler, run_sft
from jaxrl.specs import build_model_config, build_source, build_tokenizer, reward_name
from jaxrl.trainer import Trainer
from launch.configs import (
    LossConfig,
    MeshConfig,
    OptimizerConfig,
    PolicySpec,
    RLConfig,
    SFTConfig,
    TaskSpec,
)


def initial_params(workdir, policy, task, sft, mesh_config, trainer, model_config):
    """Params to start RL from when the run has no checkpoint of its own."""
    if policy.init_from:
        if os.path.isdir(run_dir.checkpoint_dir(policy.init_from)):
            _, params = run_dir.restore_params(
                policy.init_from, model_config, shardings=trainer.param_shardings
            )
            print(f"[rl] starting from the run in {policy.init_from}")
        else:
            from jaxrl.models import hf

            params = hf.load_params(policy.init_from, model_config, trainer.param_shardings)
            print(f"[rl] starting from the HF checkpoint {policy.init_from}")
        return nnx.to_pure_dict(params)
    if sft is not None:
        sft_dir = os.path.join(workdir, "sft")
        print(f"[rl] SFT warm start in {sft_dir}")
        return run_sft(sft_dir, policy, task, sft, mesh_config)
    print("[rl] starting from random weights")
    return trainer.init_params(0)


@gin.configurable
def rl_main(
    workdir: str,
    policy: PolicySpec = gin.REQUIRED,
    task: TaskSpec = gin.REQUIRED,
    rl: RLConfig = gin.REQUIRED,
    optimizer: OptimizerConfig = gin.REQUIRED,
    loss: LossConfig = LossConfig(),
    mesh: MeshConfig = MeshConfig(("fsdp", "tp"), (1, 1)),
    sft: SFTConfig | None = None,
) -> dict:
    tokenizer = build_tokenizer(policy, task)
    model_config = build_model_config(policy, tokenizer)
    source = build_source(task, tokenizer)
    reward = reward_name(task, source)
    if abs(loss.temperature - rl.temperature) > 0:
        raise SystemExit(
            f"LossConfig.temperature={loss.temperature} differs from RLConfig.temperature="
            f"{rl.temperature}: the trainer must score tokens under the sampling distribution"
        )

    trainer = Trainer(
        model_config,
        make_mesh(mesh),
        TRAINER_RULES,
        optimizer.make(rl.total_steps),
        grad_accum_steps=optimizer.grad_accum_steps,
        loss=loss,
    )
    run_dir.save_model_spec(workdir, model_config, tokenizer)
    io = RunIO(
        workdir,
        total_steps=rl.total_steps,
        save_every_steps=rl.save_every_steps,
        keep_last_n=rl.keep_last_n,
        desc="rl",
        log_every_steps=rl.log_every_steps,
    )
    try:
        restored = io.restore(trainer.abstract_state())
        if restored is not None:
            state, _ = restored
        else:
            state = trainer.init(
                initial_params(workdir, policy, task, sft, mesh, trainer, model_config)
            )
        # The frozen reference policy of the KL term: the initial weights, on the trainer mesh.
        ref_params = None
        if loss.kl_coef > 0:
            ref_params = initial_params(workdir, policy, task, sft, mesh, trainer, model_config)

        sampler = colocated_sampler(trainer, tokenizer)
        generator = GeneratorExecutor(
            sampler, sampling_config(rl), rl.samples_per_prompt, seed=rl.seed
        )
        rewarder = RewardExecutor(
            reward, tokenizer, shuffle_seed=rl.seed if rl.shuffle_rewards else None
        )
        controller = Controller(
            rl,
            trainer,
            generator,
            rewarder,
            source,
            tokenizer,
            io,
            reward=reward,
            ref_params=ref_params,
        )
        state = controller.run_sync(state)
    finally:
        io.close()

    from launch.plot import write_plot

    plot = write_plot(workdir)
    print(f"metrics:     {os.path.abspath(os.path.join(workdir, 'metrics.jsonl'))}")
    print(f"plot:        {plot}")
    print(f"checkpoints: {os.path.abspath(run_dir.checkpoint_dir(workdir))}")
    return {"workdir": workdir, "plot": plot, "final_step": int(state.step)}


if __name__ == "__main__":
    launch(rl_main, description=__doc__.splitlines()[0])

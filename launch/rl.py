"""RL post-training of a policy (LlamaRL-style controller).

    python -m launch.rl --gin_file=configs/rl/arith_tiny.gin --workdir=runs/arith        # async
    python -m launch.rl --gin_file=configs/rl/arith_tiny_sync.gin --workdir=runs/arith_sync

Recipe: config (already validated by `launch`) -> tokenizer, model config, task -> meshes (the
trainer's; in async mode also the generator's, on disjoint devices) and shardings -> initial
params (this run's newest checkpoint, else `init_from`, else the SFT stage in WORKDIR/sft, else
random) -> executors (async: the generator's sampler on its mesh, the trainer -> generator
WeightSync) -> controller loop -> wait for checkpoints.
"""

from __future__ import annotations

import os
import traceback

import gin
from flax import nnx

from jaxrl import lora as lora_lib
from jaxrl import workdir as run_dir
from jaxrl.generation.engine_sampler import GENERATORS
from jaxrl.generation.executor import GeneratorExecutor
from jaxrl.generation.placement import colocated_sampler, generator_param_shardings, mesh_sampler
from jaxrl.infra.config import keep_torch_out, launch
from jaxrl.infra.distributed import check_mesh_fits, initialize_from_argv, is_main_process
from jaxrl.infra.mesh import check_disjoint, cpu_overlap_note, make_mesh
from jaxrl.infra.sharding import GENERATOR_RULES, TRAINER_RULES
from jaxrl.loop.config import sampling_config
from jaxrl.loop.controller import Controller
from jaxrl.loop.reward import RewardExecutor
from jaxrl.run_io import RunIO
from jaxrl.sft import rl_source_after_sft, run_sft
from jaxrl.specs import build_model_config, build_source, build_tokenizer, reward_name
from jaxrl.sync.cross_process import make_weight_sync
from jaxrl.sync.store import GeneratorWeights
from jaxrl.trainer import Trainer
from launch.configs import (
    LoraConfig,
    LossConfig,
    MeshConfig,
    OptimizerConfig,
    PolicySpec,
    RLConfig,
    SFTConfig,
    TaskSpec,
)

GENERATOR_DTYPES = ("auto", "float32", "bfloat16")


def resolve_generator_dtype(name: str, generator_mesh) -> str | None:
    """The dtype a weight push casts to (None: the trainer's own) for `rl_main.generator_dtype`."""
    if name != "auto":
        return name
    platform = generator_mesh.devices.flat[0].platform
    return None if platform == "cpu" else "bfloat16"


def _say(line: str) -> None:
    """Progress output, from process 0 only."""
    if is_main_process():
        print(line, flush=True)


def initial_source(workdir, policy, sft) -> str | None:
    """Where `initial_params` reads from (None: random weights)."""
    if policy.init_from:
        return policy.init_from
    return os.path.join(workdir, "sft") if sft is not None else None


def initial_params(workdir, policy, task, sft, mesh_config, trainer, model_config):
    """Params to start RL from when the run has no checkpoint of its own (with LoRA: the
    frozen base, read again on every start since checkpoints hold the adapters only)."""
    if policy.init_from:
        if os.path.isdir(run_dir.checkpoint_dir(policy.init_from)):
            _, params = run_dir.restore_params(
                policy.init_from, model_config, shardings=trainer.base_param_shardings
            )
            _say(f"[rl] starting from the run in {policy.init_from}")
        else:
            from jaxrl.models import hf

            params = hf.load_params(policy.init_from, model_config, trainer.base_param_shardings)
            _say(f"[rl] starting from the HF checkpoint {policy.init_from}")
        return nnx.to_pure_dict(params)
    if sft is not None:
        sft_dir = os.path.join(workdir, "sft")
        _say(f"[rl] SFT warm start in {sft_dir}")
        return run_sft(sft_dir, policy, task, sft, mesh_config)
    _say("[rl] starting from random weights")
    return trainer.init_params(0)


def _keep_cause_visible(error: BaseException) -> None:
    """gin re-raises an exception that escapes a configurable as a proxy `from None`, which
    hides its cause (e.g. a user reward's own traceback under the RewardError); keep it as a
    note, which the proxy shows."""
    if error.__cause__ is not None:
        cause = "".join(traceback.format_exception(error.__cause__)).rstrip()
        error.add_note(f"Caused by:\n{cause}")


@gin.configurable
def rl_main(
    workdir: str,
    policy: PolicySpec = gin.REQUIRED,
    task: TaskSpec = gin.REQUIRED,
    rl: RLConfig = gin.REQUIRED,
    optimizer: OptimizerConfig = gin.REQUIRED,
    loss: LossConfig = LossConfig(),
    mesh: MeshConfig = MeshConfig(("fsdp", "tp"), (1, 1)),
    generator_mesh: MeshConfig | None = None,
    sft: SFTConfig | None = None,
    generator_dtype: str = "auto",
    lora: LoraConfig | None = None,
    roles: tuple[str, ...] | None = None,
    generator: str = "engine",
    engine_slots: int = 0,
    engine_steps_per_call: int = 8,
    engine_max_len: int = 0,
    engine_precompile: bool = False,
) -> dict:
    """`mesh`: the trainer's (and, in sync mode, the colocated generator's) devices and axes.
    `generator_mesh` (async mode): the generator's own devices, disjoint from the trainer's,
    laid out by GENERATOR_RULES (axes ("dp", "tp")). `generator_dtype` (async mode): the dtype
    of the generator's copy of the weights, cast on the trainer during each push: "bfloat16",
    "float32", or "auto" (bfloat16 on GPU / TPU, where decoding is bound by reading the weights;
    the trainer's parameter dtype on CPU, where bf16 matmuls are slower and the fp32 log-ratio
    checks hold exactly). AIPO's per-token ratio corrects for the bf16 sampler like any lag.
    `lora` (`@LoraConfig()`): train LoRA adapters on the frozen initial policy (`jaxrl.lora`):
    checkpoints and weight pushes hold the adapters only, the KL reference is the base with the
    adapters off, and the generator keeps one copy of the base and applies each pushed version's
    adapters unmerged.
    `roles` (async, fixed lag): one role per process of the job, "trainer" or "generator"
    (`jaxrl.loop.roles`; process 0 a trainer): each process runs only its role's programs on its
    role's devices. In a one-process job it is ignored (both roles in one process, as without
    it), so the same config runs on one process for comparison.
    `generator`: "engine" (the continuous-batching engine, `jaxrl.generation.engine`: each
    prompt's G samples share one prefill, finished rows free their slots at once) or "static"
    (the left-padded `Sampler`); meshes spanning several processes always use the static one.
    `engine_slots`: the engine's decode slots (0: the rows of one generate call,
    num_prompts x oversample x samples_per_prompt; streaming: num_prompts x samples_per_prompt,
    one step's groups in flight, however many dynamic sampling leaves out).
    `engine_steps_per_call`: decode steps per device call (capped at max_new_tokens).
    `engine_max_len`: the engine's cache length, the longest prompt + max_new_tokens it takes
    (0: sized from the prompts it gets, the next power of two above the longest prompt +
    max_new_tokens, growing up to the model's context). The engine holds one cache of slots x
    that length x layers x 2 x kv_heads x head_dim values (e.g. 256 slots x 4096 on Llama 3 8B
    in bf16: 128 GiB); one that cannot fit in free memory is refused before it is allocated.
    `engine_precompile`: the generator's engine compiles every program it can call (each decode
    span x active-slot bucket, prefill batch x prompt-length bucket, slot move) before its first
    batch, instead of one at a time when a new shape first comes up: a streaming run otherwise
    stalls its generator, and then its trainer, for each compile during its first hundred or
    so steps. Costs their compile time once at the start (how many programs and seconds for
    configs/rl/chain_tiny_streaming.gin: docs/benchmarks.md, "Engine precompile")."""
    if generator not in GENERATORS:
        raise SystemExit(f"rl_main.generator={generator!r}; expected one of {GENERATORS}")
    if engine_slots < 0 or engine_steps_per_call < 1 or engine_max_len < 0:
        raise SystemExit(
            f"rl_main.engine_slots={engine_slots}, rl_main.engine_steps_per_call="
            f"{engine_steps_per_call}, rl_main.engine_max_len={engine_max_len}: need "
            "engine_slots >= 0 (0: automatic), engine_steps_per_call >= 1, engine_max_len >= 0 "
            "(0: the model's context)"
        )
    if generator_dtype not in GENERATOR_DTYPES:
        raise SystemExit(
            f"rl_main.generator_dtype={generator_dtype!r}; expected one of {GENERATOR_DTYPES}"
        )
    tokenizer = build_tokenizer(policy, task)
    model_config = build_model_config(policy, tokenizer, lora=lora is not None)
    source = build_source(
        task, tokenizer, max_prompt_tokens=model_config.max_position_embeddings - rl.max_new_tokens
    )
    reward = reward_name(task, source)
    if sft is not None and not policy.init_from:
        # After the SFT warm start, RL reads the stream after the items SFT trained on, without
        # the pool's prompts: its first batches were memorised demonstrations (reward ~1).
        source = rl_source_after_sft(source, sft)
    if abs(loss.temperature - rl.temperature) > 0:
        raise SystemExit(
            f"LossConfig.temperature={loss.temperature} differs from RLConfig.temperature="
            f"{rl.temperature}: the trainer must score tokens under the sampling distribution"
        )
    if (rl.mode == "async") != (generator_mesh is not None):
        raise SystemExit(
            f"RLConfig.mode={rl.mode!r} with rl_main.generator_mesh="
            f"{'set' if generator_mesh else 'None'}: async mode needs the generator's own "
            "devices (bind rl_main.generator_mesh = @generator/MeshConfig()); sync mode is "
            "colocated (no generator_mesh; for on-policy on disjoint meshes use async with "
            "RLConfig.lag = 0)"
        )

    import jax

    if jax.process_count() > 1 and rl.mode == "async" and rl.schedule != "fixed_lag":
        raise SystemExit(
            f"RLConfig.schedule={rl.schedule!r} in a job of {jax.process_count()} processes: "
            "every process runs the same controller, and free-running choices (which version "
            "samples a batch, which batches are dropped) follow each process's own timing; "
            "use RLConfig.schedule = 'fixed_lag'"
        )
    split = roles is not None and jax.process_count() > 1
    if roles is not None and generator_mesh is None:
        raise SystemExit("rl_main.roles needs async mode and rl_main.generator_mesh")
    if roles is not None and not set(roles) <= {"trainer", "generator"}:
        raise SystemExit(f"rl_main.roles={tuple(roles)}: each role is 'trainer' or 'generator'")
    check_mesh_fits({"trainer": mesh} | ({"generator": generator_mesh} if generator_mesh else {}))
    trainer_mesh = make_mesh(mesh)
    # Placement is checked before any work (the SFT stage used to run first, then this failed).
    gen_mesh = make_mesh(generator_mesh) if generator_mesh is not None else None
    if gen_mesh is not None:
        check_disjoint({"trainer": trainer_mesh, "generator": gen_mesh})
        note = cpu_overlap_note(trainer_mesh, gen_mesh)
        if note is not None and is_main_process():
            print(note, flush=True)
    layout = None
    if split:
        from jaxrl.loop.roles import RoleLayoutError, check_roles

        try:
            layout = check_roles(roles, trainer_mesh, gen_mesh)
        except RoleLayoutError as err:
            raise SystemExit(str(err)) from None
        if rl.schedule != "fixed_lag" or lora is not None:
            raise SystemExit(
                "rl_main.roles across processes needs RLConfig.schedule = 'fixed_lag' (both "
                "roles must know every pushed version in advance) and no rl_main.lora"
            )
    trainer = Trainer(
        model_config,
        trainer_mesh,
        TRAINER_RULES,
        optimizer.make(rl.total_steps),
        grad_accum_steps=optimizer.grad_accum_steps,
        loss=loss,
        lora=lora,
        pack_length=rl.pack_length,
    )
    run_dir.save_model_spec(workdir, model_config, tokenizer)
    engine = {
        "generator": generator,
        "num_slots": engine_slots
        or rl.samples_per_prompt
        * rl.num_prompts
        * (1 if rl.schedule == "streaming" else rl.oversample),
        "steps_per_call": min(engine_steps_per_call, rl.max_new_tokens),
        "max_total_len": engine_max_len or None,
    }
    generator_engine = engine | {"precompile": engine_precompile}  # evals compile lazily
    if layout is not None:
        return _run_roles(
            workdir, layout, rl, trainer, tokenizer, source, reward, gen_mesh, generator_dtype,
            policy, task, sft, mesh, loss, optimizer, model_config, generator_engine,
        )  # fmt: skip
    if lora is not None:
        if initial_source(workdir, policy, sft) is None:
            raise SystemExit(
                "LoRA trains adapters on a frozen base: set PolicySpec.init_from or an SFT stage "
                "(rl_main.sft); a random base has nothing to adapt"
            )
        if jax.process_count() > 1:
            raise SystemExit("LoRA runs are single-process for now; drop rl_main.lora")
        if is_main_process():
            lora_lib.save_run_lora(workdir, lora, initial_source(workdir, policy, sft))
    io = _run_io(workdir, rl)
    try:
        restored = io.restore(trainer.abstract_state())
        extra = None
        if restored is not None:
            state, extra = restored
            if lora is not None:
                trainer.set_base(
                    initial_params(workdir, policy, task, sft, mesh, trainer, model_config)
                )
        else:
            state = trainer.init(
                initial_params(workdir, policy, task, sft, mesh, trainer, model_config)
            )
        # The frozen reference policy of the KL term: the initial weights, on the trainer mesh.
        ref_params = None
        if loss.kl_coef > 0 and lora is None:  # LoRA: the base with the adapters off
            ref_params = initial_params(workdir, policy, task, sft, mesh, trainer, model_config)

        weights = None
        if generator_mesh is None:
            sampler = colocated_sampler(trainer, tokenizer, **generator_engine)
        else:
            gen_dtype = resolve_generator_dtype(generator_dtype, gen_mesh)
            sampler = mesh_sampler(
                trainer, tokenizer, gen_mesh, GENERATOR_RULES, base_dtype=gen_dtype,
                **generator_engine,
            )  # fmt: skip
            sync = make_weight_sync(
                trainer.param_shardings,
                generator_param_shardings(trainer, gen_mesh, GENERATOR_RULES),
                generator_dtype=gen_dtype,
            )
            weights = GeneratorWeights(
                sync, latest_only=rl.schedule in ("free_running", "streaming")
            )
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
            weights=weights,
            eval_sampler=colocated_sampler(trainer, tokenizer, **engine) if weights else None,
            learning_rate=optimizer.schedule_fn(rl.total_steps),
        )
        try:
            state = controller.run(state, extra)
        except Exception as error:
            _keep_cause_visible(error)
            raise
    finally:
        io.close()

    from launch.plot import write_plot

    if jax.process_index() != 0:  # process 0 wrote the metrics and reports
        return {"workdir": workdir, "plot": None, "final_step": int(state.step)}
    plot = write_plot(workdir)
    print(f"metrics:     {os.path.abspath(os.path.join(workdir, 'metrics.jsonl'))}")
    print(f"plot:        {plot}")
    print(f"checkpoints: {os.path.abspath(run_dir.checkpoint_dir(workdir))}")
    return {"workdir": workdir, "plot": plot, "final_step": int(state.step)}


def _run_io(workdir: str, rl: RLConfig) -> RunIO:
    """The run's metrics, checkpoints and progress line, on `rl`'s schedule."""
    return RunIO(
        workdir,
        total_steps=rl.total_steps,
        save_every_steps=rl.save_every_steps,
        keep_last_n=rl.keep_last_n,
        desc="rl",
        log_every_steps=rl.log_every_steps,
    )


def _run_roles(
    workdir, layout, rl, trainer, tokenizer, source, reward, gen_mesh, generator_dtype,
    policy, task, sft, mesh, loss, optimizer, model_config, engine,
) -> dict:  # fmt: skip
    """`rl_main` on one process of a role-split job (`jaxrl.loop.roles`): a trainer process restores
    or initialises the train state (checkpoints over the trainer processes only), a generator
    process builds the sampler on its devices; both build the same cross-process push."""
    import jax

    from jaxrl.infra import checkpoint
    from jaxrl.loop.roles import RoleController

    role = layout.role_of(jax.process_index())
    gen_dtype = resolve_generator_dtype(generator_dtype, gen_mesh)
    sync = make_weight_sync(
        trainer.param_shardings,
        generator_param_shardings(trainer, gen_mesh, GENERATOR_RULES),
        generator_dtype=gen_dtype,
    )
    if role == "generator":
        sampler = mesh_sampler(
            trainer, tokenizer, gen_mesh, GENERATOR_RULES, base_dtype=gen_dtype, **engine
        )
    else:  # evaluations, on the trainer's devices
        sampler = colocated_sampler(trainer, tokenizer, **(engine | {"precompile": False}))
    generator = GeneratorExecutor(sampler, sampling_config(rl), rl.samples_per_prompt, seed=rl.seed)
    rewarder = RewardExecutor(
        reward, tokenizer, shuffle_seed=rl.seed if rl.shuffle_rewards else None
    )
    io = state = extra = ref_params = None
    if role == "trainer":
        checkpoint.restrict_to_processes(layout.trainer_processes)
        io = _run_io(workdir, rl)
    try:
        if role == "trainer":
            restored = io.restore(trainer.abstract_state())
            if restored is not None:
                state, extra = restored
            else:
                state = trainer.init(
                    initial_params(workdir, policy, task, sft, mesh, trainer, model_config)
                )
            if loss.kl_coef > 0:
                ref_params = initial_params(workdir, policy, task, sft, mesh, trainer, model_config)
        controller = RoleController(
            rl,
            trainer,
            generator,
            rewarder,
            source,
            tokenizer,
            io,
            reward=reward,
            ref_params=ref_params,
            weights=sync,
            layout=layout,
            learning_rate=optimizer.schedule_fn(rl.total_steps),
        )
        try:
            state = controller.run(state, extra)
        except Exception as error:
            _keep_cause_visible(error)
            raise
    finally:
        if io is not None:
            io.close()
    if jax.process_index() != 0:
        return {"workdir": workdir, "plot": None, "final_step": rl.total_steps}
    from launch.plot import write_plot

    plot = write_plot(workdir)
    print(f"metrics:     {os.path.abspath(os.path.join(workdir, 'metrics.jsonl'))}")
    print(f"plot:        {plot}")
    print(f"checkpoints: {os.path.abspath(run_dir.checkpoint_dir(workdir))}")
    return {"workdir": workdir, "plot": plot, "final_step": int(state.step)}


if __name__ == "__main__":
    keep_torch_out()
    launch(rl_main, initialize_from_argv(), description=__doc__.splitlines()[0])

"""RL post-training of a policy (LlamaRL-style controller).

    python -m launch.rl --gin_file=configs/rl/arith_tiny.gin --workdir=runs/arith        # async
    python -m launch.rl --gin_file=configs/rl/arith_tiny_sync.gin --workdir=runs/arith_sync

Recipe (`rl_main`, one function a step): config (already validated by `launch`) ->
`resolve_generator_config` -> `build_model` (tokenizer, model config) -> `build_task` (prompt
source, reward) -> `check_job` (the checks across configs, before any device work) ->
`build_placement` (the trainer's mesh; in async mode also the generator's, on disjoint devices; a
role-split job: this process's role) -> `build_policy` (the trainer) -> `_initial_state` (this
run's newest checkpoint, else `init_from`, else the SFT stage in WORKDIR/sft, else random; read
once, the KL reference too) -> `build_feed` (sampler and weight store; async: the generator's
sampler on its mesh, the trainer -> generator weight sync; the rollout feed) ->
`build_controller` -> its loop (a generator process of a role-split job:
`roles.run_generator`) -> wait for checkpoints -> `_report`.
"""

from __future__ import annotations

import os
import traceback
from typing import NamedTuple

import gin
import jax
from flax import nnx

from jaxrl.generation.episodes import EpisodeBudget
from jaxrl.generation.executor import GeneratorExecutor
from jaxrl.generation.placement import (
    GeneratorConfig,
    colocated_sampler,
    generator_param_shardings,
    mesh_sampler,
)
from jaxrl.infra import checkpoint
from jaxrl.infra.config import from_gin
from jaxrl.infra.distributed import check_mesh_fits, initialize_from_argv, is_main_process
from jaxrl.infra.launcher import launch
from jaxrl.infra.mesh import check_disjoint, cpu_overlap_note, make_mesh
from jaxrl.infra.moved import removed_bindings
from jaxrl.infra.run_io import RunIO
from jaxrl.infra.sharding import GENERATOR_RULES, TRAINER_RULES
from jaxrl.infra.user_code import keep_torch_out
from jaxrl.job import workdir as run_dir
from jaxrl.job.specs import build_model_config, build_source, build_tokenizer, reward_name
from jaxrl.loop import roles as roles_lib
from jaxrl.loop.config import check_rl_job, sampling_config
from jaxrl.loop.controller import Controller
from jaxrl.loop.feeds import feed_class
from jaxrl.loop.feeds.episodes import check_episode_job, episode_feed
from jaxrl.loop.reward import RewardExecutor
from jaxrl.sync.cross_process import make_weight_sync
from jaxrl.sync.quantized import QuantizingSync
from jaxrl.sync.store import GeneratorWeights
from jaxrl.train.sft import rl_source_after_sft, run_sft
from jaxrl.train.trainer import Trainer
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

# rl_main's flat generator knobs, removed in 0.3.0: a config that binds one is refused when it
# is parsed, naming the GeneratorConfig field to bind instead (`jaxrl.infra.moved`).
removed_bindings(
    "rl_main",
    {
        "generator": "GeneratorConfig.kind = {value}",
        "generator_dtype": "GeneratorConfig.dtype = {value}",
        "engine_slots": "GeneratorConfig.slots = {value}",
        "engine_steps_per_call": "GeneratorConfig.steps_per_call = {value}",
        "engine_max_len": "GeneratorConfig.max_len = {value}",
        "engine_precompile": "GeneratorConfig.precompile = {value}",
    },
    since="0.3.0",
)


def resolve_generator_config(config: GeneratorConfig | None) -> GeneratorConfig:
    """`rl_main.generator_config`, else the one gin's `GeneratorConfig.*` bindings make (they
    apply without `rl_main.generator_config = @GeneratorConfig()` too); checked, SystemExit
    naming the field otherwise."""
    try:
        config = config if config is not None else from_gin(GeneratorConfig)
        config.validate()
    except ValueError as err:
        raise SystemExit(str(err)) from None
    return config


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
    lora: LoraConfig | None = None,
    roles: tuple[str, ...] | None = None,
    generator_config: GeneratorConfig | None = None,
    episodes: EpisodeBudget | None = None,
    episode_tool_workers: int = 8,
    mask_observations: bool = True,
    plot: bool = True,
) -> dict:
    """`mesh`: the trainer's (and, in sync mode, the colocated generator's) devices and axes.
    `generator_mesh` (async mode): the generator's own devices, disjoint from the trainer's,
    laid out by GENERATOR_RULES (axes ("dp", "tp")). `generator_config` (`@GeneratorConfig()`):
    the sampler, its engine's size and the dtype of the generator's weights
    (`jaxrl.generation.placement.GeneratorConfig`; without it, gin's `GeneratorConfig.*`
    bindings still apply). The flat knobs `generator`, `generator_dtype` and `engine_*` were
    removed in 0.3.0: a config that binds one is refused, naming the field to bind.
    `lora` (`@LoraConfig()`): train LoRA adapters on the frozen initial policy (`jaxrl.train.lora`):
    checkpoints and weight pushes hold the adapters only, the KL reference is the base with the
    adapters off, and the generator keeps one copy of the base and applies each pushed version's
    adapters unmerged.
    `roles` (async, fixed lag): one role per process of the job, "trainer" or "generator"
    (`jaxrl.loop.roles`; process 0 a trainer): each process runs only its role's programs on its
    role's devices. In a one-process job it is ignored (both roles in one process, as without
    it), so the same config runs on one process for comparison.
    `episodes` (`@EpisodeBudget()`): multi-turn episodes, each in an environment of the task's
    source (`make_env()`, e.g. the "calculator" task), within these budgets, in sync mode or
    async (fixed lag, free running, streaming; not role-split) (`jaxrl.loop.feeds.episodes`).
    `episode_tool_workers`: threads for the environments' steps (0: inline, which keeps sync
    and fixed-lag runs reproducible bit for bit). `mask_observations=False`: the control
    experiment of training on the environment's observation tokens too (never for real
    training). `plot=False`: no curves PNG at the end (`python -m launch.plot WORKDIR` draws it
    later)."""
    gen = resolve_generator_config(generator_config)
    tokenizer, model_config = build_model(policy, task, lora)
    rl_task = build_task(policy, task, rl, sft, tokenizer, model_config)
    check_job(rl, loss, gen, model_config, rl_task, generator_mesh, roles, lora, episodes)
    place = build_placement(mesh, generator_mesh, roles)
    trainer = build_policy(
        workdir, policy, rl, optimizer, loss, lora, sft, tokenizer, model_config, place
    )
    if place.layout is not None:  # checkpoints are written by the trainer processes alone
        checkpoint.restrict_to_processes(place.layout.trainer_processes)
    io = roles_lib.NoIO() if place.role == "generator" else _run_io(workdir, rl)
    try:
        state = extra = ref_params = None
        if place.role != "generator":
            state, extra, ref_params = _initial_state(
                io, trainer, lora, loss,
                lambda: initial_params(workdir, policy, task, sft, mesh, trainer, model_config),
            )  # fmt: skip
        feed = build_feed(
            rl, gen, trainer, tokenizer, place, rl_task, episodes, episode_tool_workers,
            mask_observations,
        )  # fmt: skip
        controller = build_controller(
            rl, optimizer, trainer, tokenizer, rl_task, io, feed, ref_params, gen.mismatch
        )
        try:
            if place.role == "generator":
                roles_lib.run_generator(controller, place.layout)
            else:
                state = controller.run(state, extra)
        except Exception as error:
            _keep_cause_visible(error)
            raise
    finally:
        io.close()
    return _report(workdir, state, rl, plot)


def build_model(policy: PolicySpec, task: TaskSpec, lora: LoraConfig | None):
    """(tokenizer, model config) of the policy (`jaxrl.job.specs`)."""
    tokenizer = build_tokenizer(policy, task)
    return tokenizer, build_model_config(policy, tokenizer, lora=lora is not None)


class RLTask(NamedTuple):
    """What the run trains on: `source` (the prompts RL reads), `env_source` (the environments
    of multi-turn episodes: the source before any SFT wrapper) and the reward's name."""

    source: object
    env_source: object
    reward: str


def build_task(policy, task, rl, sft, tokenizer, model_config) -> RLTask:
    """The task's prompt source and reward. After an SFT warm start (no `init_from`), RL reads
    the stream after the items SFT trained on, without the pool's prompts: its first batches
    were memorised demonstrations (reward ~1)."""
    source = build_source(
        task, tokenizer, max_prompt_tokens=model_config.max_position_embeddings - rl.max_new_tokens
    )
    reward = reward_name(task, source)
    env_source = source
    if sft is not None and not policy.init_from:
        source = rl_source_after_sft(source, sft)
    return RLTask(source, env_source, reward)


def check_job(rl, loss, gen, model_config, rl_task, generator_mesh, roles, lora, episodes):
    """The checks across configs, before any device work (SystemExit naming the setting)."""
    try:
        check_rl_job(
            rl,
            loss_temperature=loss.temperature,
            generator_mesh=generator_mesh is not None,
            roles=roles,
            lora=lora is not None,
            processes=jax.process_count(),
        )
        if episodes is not None:
            check_episode_job(
                rl, episodes, rl_task.env_source, roles if jax.process_count() > 1 else None
            )
        loss.check_replay(model_config, gen.kind, episodes=episodes is not None)
        if gen.mismatch == "uncorrected" and (rl.schedule == "streaming" or episodes):
            raise ValueError(
                "GeneratorConfig.mismatch='uncorrected' replaces whole batches' behaviour "
                "log-probs; a streaming run's samples span versions whose weights are gone and "
                "multi-turn episodes are not scored: use a sync or fixed-lag run for the control"
            )
        if gen.mismatch == "measure" and episodes is not None:
            raise ValueError(
                "GeneratorConfig.mismatch='measure' is not built for multi-turn episodes: use "
                "mismatch='auto' (off for episodes) or single-turn RL"
            )
    except ValueError as err:
        raise SystemExit(str(err)) from None


class Placement(NamedTuple):
    """Where the run's programs go: the trainer's mesh, the generator's (async mode; None:
    colocated), a role-split job's layout (None otherwise) and this process's role ("trainer",
    "generator" or "both")."""

    trainer_mesh: jax.sharding.Mesh
    gen_mesh: jax.sharding.Mesh | None
    layout: roles_lib.RoleLayout | None
    role: str


def build_placement(mesh, generator_mesh, roles) -> Placement:
    """The meshes, checked to fit and (async) to be disjoint, before any work (the SFT stage
    used to run first, then this failed); in a role-split job (`jaxrl.loop.roles`) each process
    runs one role on its role's devices."""
    check_mesh_fits({"trainer": mesh} | ({"generator": generator_mesh} if generator_mesh else {}))
    trainer_mesh = make_mesh(mesh)
    gen_mesh = make_mesh(generator_mesh) if generator_mesh is not None else None
    if gen_mesh is not None:
        check_disjoint({"trainer": trainer_mesh, "generator": gen_mesh})
        note = cpu_overlap_note(trainer_mesh, gen_mesh)
        if note is not None and is_main_process():
            print(note, flush=True)
    layout = None
    if roles is not None and jax.process_count() > 1:
        try:
            layout = roles_lib.check_roles(roles, trainer_mesh, gen_mesh)
        except roles_lib.RoleLayoutError as err:
            raise SystemExit(str(err)) from None
    role = layout.role_of(jax.process_index()) if layout is not None else "both"
    return Placement(trainer_mesh, gen_mesh, layout, role)


def build_policy(
    workdir, policy, rl, optimizer, loss, lora, sft, tokenizer, model_config, place
) -> Trainer:
    """The trainer on its mesh; the run's model spec (and, with LoRA, the frozen base's source)
    written into the workdir. The initial params come later (`_initial_state`)."""
    trainer = Trainer(
        model_config,
        place.trainer_mesh,
        TRAINER_RULES,
        optimizer.make(rl.total_steps),
        grad_accum_steps=optimizer.grad_accum_steps,
        loss=loss,
        lora=lora,
        pack_length=rl.pack_length,
        share_prompts=rl.share_prompts,
    )
    run_dir.save_model_spec(workdir, model_config, tokenizer)
    if lora is not None:
        if initial_source(workdir, policy, sft) is None:
            raise SystemExit(
                "LoRA trains adapters on a frozen base: set PolicySpec.init_from or an SFT stage "
                "(rl_main.sft); a random base has nothing to adapt"
            )
        if is_main_process():
            run_dir.save_run_lora(workdir, lora, initial_source(workdir, policy, sft))
    return trainer


class Feed(NamedTuple):
    """The generator's side for the controller: its sampler, weight store (None: sync, the
    trainer's params), the evaluations' sampler (None: `sampler`) and the rollout feed (None:
    the schedule's own, `jaxrl.loop.feeds`)."""

    sampler: object
    weights: object
    eval_sampler: object
    feed: object


def build_feed(
    rl, gen, trainer, tokenizer, place, rl_task, episodes, episode_tool_workers,
    mask_observations,
) -> Feed:  # fmt: skip
    """The generator's sampler and weight store (async: on its own mesh, fed by pushes from the
    trainer), and the rollout feed: a role-split trainer's, multi-turn episodes', or the
    schedule's own."""
    engine = {
        "generator": gen.kind,
        "num_slots": gen.slots or feed_class(rl).engine_slots(rl),
        "steps_per_call": min(gen.steps_per_call, rl.max_new_tokens),
        "extend_min_rows": gen.extend_min_rows,
        "extend_widths": gen.extend_widths,
        "keep_calls": gen.keep_calls,
        "exit_stops": gen.exit_stops,
        "span_buckets": gen.span_buckets,
        "max_total_len": gen.max_len or None,
    }
    role, gen_mesh = place.role, place.gen_mesh
    weights, eval_sampler = None, None
    if gen_mesh is None:
        sampler = colocated_sampler(
            trainer, tokenizer, **engine, precompile=gen.precompile, weights=gen.weights
        )
        if gen.weights != "native":  # evaluations measure the trained, full-precision policy
            eval_sampler = colocated_sampler(trainer, tokenizer, **engine)
    else:
        gen_dtype = gen.resolve_dtype(gen_mesh)
        gen_shardings = generator_param_shardings(trainer, gen_mesh, GENERATOR_RULES)
        if role == "trainer":  # evaluations on the trainer's devices; pushes leave
            sampler = colocated_sampler(trainer, tokenizer, **engine)
        else:
            sampler = mesh_sampler(
                trainer, tokenizer, gen_mesh, GENERATOR_RULES, base_dtype=gen_dtype,
                **engine, precompile=gen.precompile, weights=gen.weights,
            )  # fmt: skip
        if quantized_push(gen, role, trainer):  # 8-bit kernels move, not full precision
            sync = QuantizingSync(
                trainer.param_shardings, gen_shardings, trainer.model_config,
                sampler.engine.programs.weights, generator_dtype=gen_dtype,
            )  # fmt: skip
        else:
            sync = make_weight_sync(
                trainer.param_shardings, gen_shardings, generator_dtype=gen_dtype
            )
        if role == "trainer":
            weights = roles_lib.PushOnly(sync)
        else:
            latest_only = role == "both" and feed_class(rl).latest_only(rl)
            weights = GeneratorWeights(sync, latest_only=latest_only)
            if role == "both":  # evaluations compile lazily, on the trainer's devices
                eval_sampler = colocated_sampler(trainer, tokenizer, **engine)
    if role == "trainer":
        feed = lambda ctl: roles_lib.trainer_feed(ctl, place.layout)  # noqa: E731
    elif episodes is not None:
        feed = episode_feed(
            rl_task.env_source, episodes, episode_tool_workers, mask_observations=mask_observations
        )
    else:
        feed = None
    return Feed(sampler, weights, eval_sampler, feed)


def quantized_push(gen: GeneratorConfig, role: str, trainer) -> bool:
    """Whether an async run's push quantizes on the trainer (`jaxrl.sync.quantized`): 8-bit
    generator weights whose mismatch is not measured (the measurement needs the full-precision
    weights on the generator), one process holding both roles, a full (not LoRA) policy."""
    return (
        gen.weights != "native"
        and gen.mismatch == "off"
        and role == "both"
        and jax.process_count() == 1
        and trainer.lora is None
    )


def build_controller(
    rl, optimizer, trainer, tokenizer, rl_task, io, feed, ref_params, mismatch="auto"
):
    """The controller (`jaxrl.loop.controller`): the generator's and the reward's executors, the
    task's source, the run's IO and the feed. `mismatch`: `GeneratorConfig.mismatch`, measured
    where this process's sampler is an 8-bit engine (a role-split trainer's evaluation sampler
    is not: its generator processes measure)."""
    engine = getattr(feed.sampler, "engine", None)
    if engine is None or engine.programs.weights == "native":
        mismatch = "off"
    elif mismatch == "auto":
        mismatch = "measure"
    return Controller(
        rl,
        trainer,
        GeneratorExecutor(
            feed.sampler,
            sampling_config(rl),
            rl.samples_per_prompt,
            seed=rl.seed,
            mismatch=mismatch,
        ),  # fmt: skip
        RewardExecutor(
            rl_task.reward, tokenizer, shuffle_seed=rl.seed if rl.shuffle_rewards else None
        ),
        rl_task.source,
        tokenizer,
        io,
        reward=rl_task.reward,
        ref_params=ref_params,
        weights=feed.weights,
        eval_sampler=feed.eval_sampler,
        learning_rate=optimizer.schedule_fn(rl.total_steps),
        feed=feed.feed,
    )


def _report(workdir, state, rl, plot) -> dict:
    """Process 0 prints where the metrics, plot and checkpoints are; every process returns the
    run's summary (a generator process of a role-split job has no state: `rl.total_steps`)."""
    final_step = int(state.step) if state is not None else rl.total_steps
    if jax.process_index() != 0:  # process 0 wrote the metrics and reports
        return {"workdir": workdir, "plot": None, "final_step": final_step}
    print(f"metrics:     {os.path.abspath(os.path.join(workdir, 'metrics.jsonl'))}")
    plot_path = None
    if plot:
        from launch.plot import write_plot

        plot_path = write_plot(workdir)
        print(f"plot:        {plot_path}")
    print(f"checkpoints: {os.path.abspath(run_dir.checkpoint_dir(workdir))}")
    return {"workdir": workdir, "plot": plot_path, "final_step": final_step}


def _initial_state(io, trainer, lora, loss, initial):
    """(state, checkpoint run state, KL reference): this run's newest checkpoint, else a fresh
    state around `initial()`. `initial()` (which may run or restore the SFT stage) is called
    at most once: the KL reference (`LossConfig.kl_coef > 0`, not LoRA, whose reference is the
    base with the adapters off) is the same arrays, which `Trainer.init` copies into the
    state; a LoRA run's frozen base is read again on resume (checkpoints hold the adapters)."""
    params = None
    restored = io.restore(trainer.abstract_state())
    if restored is None:
        params = initial()
        state, extra = trainer.init(params), None
    else:
        state, extra = restored
        if lora is not None:
            params = initial()
            trainer.set_base(params)
    ref_params = None
    if loss.kl_coef > 0 and lora is None:
        ref_params = params if params is not None else initial()
    return state, extra, ref_params


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


if __name__ == "__main__":
    keep_torch_out()
    launch(rl_main, initialize_from_argv(), description=__doc__.splitlines()[0])

"""The old modules at the top of `jaxrl/` that moved, each with where its names went
(`jaxrl.infra.moved.Moves`). They have no files: `jaxrl/__init__.py` installs the finder that
makes them on import (`jaxrl.infra.moved.install_aliases`), and each name answers from its new
home with a DeprecationWarning naming it, until the release that removes the old path
(CHANGELOG.md lists the moves)."""

from __future__ import annotations

from jaxrl.infra.moved import Moves

# 0.2.0: the RL loop split into role folders; the old paths go in 0.3.0.
IN_0_2_0 = {"since": "0.2.0", "until": "0.3.0"}
# 0.3.0: the training side, planning and a job's specs / workdir left the top of `jaxrl/` for
# `jaxrl.train`, `jaxrl.plan` and `jaxrl.job`; the old paths go in 0.4.0.
IN_0_3_0 = {"since": "0.3.0", "until": "0.4.0"}

MOVED_MODULES: dict[str, tuple[Moves, ...]] = {
    "jaxrl.controller": (
        Moves(
            {
                "Controller": "jaxrl.loop.controller",
                "RLConfig": "jaxrl.loop.config",
                "ControllerIO": "jaxrl.loop.config",
                "SCHEDULES": "jaxrl.loop.config",
                "sampling_config": "jaxrl.loop.config",
                "check_controller_inputs": "jaxrl.loop.config",
                "BusyTimeline": "jaxrl.loop.report",
            },
            **IN_0_2_0,
        ),
    ),
    "jaxrl.executors": (
        Moves(
            {
                "GeneratorExecutor": "jaxrl.generation.executor",
                "GeneratedBatch": "jaxrl.generation.executor",
                "sampling_key": "jaxrl.generation.executor",
                "RewardExecutor": "jaxrl.loop.reward",
                "RL_PROMPT_BUCKETS": "jaxrl.generation.placement",
                "AdapterSampler": "jaxrl.generation.placement",
                "AdapterEngineSampler": "jaxrl.generation.placement",
                "mesh_sampler": "jaxrl.generation.placement",
                "colocated_sampler": "jaxrl.generation.placement",
                "generator_param_shardings": "jaxrl.generation.placement",
                "GeneratorWeights": "jaxrl.sync.store",
            },
            **IN_0_2_0,
        ),
    ),
    "jaxrl.roles": (
        Moves(
            {
                "ROLES": "jaxrl.loop.roles",
                "RoleLayoutError": "jaxrl.loop.roles",
                "RoleLayout": "jaxrl.loop.roles",
                "check_roles": "jaxrl.loop.roles",
                "RolloutChannel": "jaxrl.loop.rollout_channel",
            },
            removed={
                "RoleController": (
                    "a role-split job is the `Controller` with `jaxrl.loop.roles.trainer_feed(...)`"
                    " on the trainer's processes and `jaxrl.loop.roles.run_generator(...)` on the"
                    " generator's"
                ),
            },
            **IN_0_2_0,
        ),
    ),
    "jaxrl.rollout_queue": (
        Moves(
            {
                "RolloutQueue": "jaxrl.loop.rollout_queue",
                "ScoredBatch": "jaxrl.loop.rollout_queue",
                "QueueStats": "jaxrl.loop.rollout_queue",
                "QueueClosed": "jaxrl.infra.closable",
                "wait_until": "jaxrl.infra.closable",
            },
            **IN_0_2_0,
        ),
    ),
    "jaxrl.run_io": (
        Moves(
            {
                name: "jaxrl.infra.run_io"
                for name in (
                    "NonFiniteLossError",
                    "RunIO",
                    "state_tree",
                    "tree_to_state",
                    "host_rss_mb",
                    "to_host",
                )
            },
            **IN_0_2_0,
        ),
    ),
    "jaxrl.streaming": (
        Moves(
            {
                "leave_out": "jaxrl.loop.rollout_queue",
                "GroupQueue": "jaxrl.loop.rollout_queue",
                "streaming_engine": "jaxrl.loop.feeds.streaming",
                "groups_in_flight": "jaxrl.loop.feeds.streaming",
                "token_staleness_metrics": "jaxrl.loop.feeds.streaming",
            },
            removed={
                "run_streaming": (
                    "streaming is the `Controller` with `RLConfig.schedule = 'streaming'` "
                    "(`jaxrl.loop.feeds.streaming.StreamingFeed`)"
                ),
            },
            **IN_0_2_0,
        ),
    ),
    "jaxrl.weight_sync": (
        Moves(
            {
                **{
                    name: "jaxrl.sync.plan"
                    for name in (
                        "STRATEGIES",
                        "DEFAULT_CHUNK_BYTES",
                        "GeneratorParams",
                        "SyncMetrics",
                        "Tile",
                        "BlockDelivery",
                        "LeafRoute",
                        "SyncPlan",
                        "live_bytes_by_device",
                        "device_order",
                        "factor_mesh",
                        "factor_groupings",
                        "cast_sources",
                        "push_in_chunks",
                    )
                },
                "TRANSPORTS": "jaxrl.sync.in_process",
                "WeightSync": "jaxrl.sync.in_process",
            },
            **IN_0_2_0,
        ),
    ),
    "jaxrl.weight_sync_xproc": (
        Moves(
            {
                name: "jaxrl.sync.cross_process"
                for name in (
                    "TRANSPORTS",
                    "Piece",
                    "Block",
                    "CrossRoute",
                    "CrossPlan",
                    "default_transport",
                    "CrossProcessWeightSync",
                    "make_weight_sync",
                )
            },
            **IN_0_2_0,
        ),
    ),
    "jaxrl.trainer": (
        Moves(
            {
                name: "jaxrl.train.steps"
                for name in ("completion_logprobs", "rl_loss", "sequence_mask", "sft_loss")
            },
            **IN_0_2_0,
        ),
        Moves("jaxrl.train.trainer", **IN_0_3_0),
    ),
    "jaxrl.lora": (
        Moves(
            {
                name: "jaxrl.job.workdir"
                for name in (
                    "load_base",
                    "load_lora_policy",
                    "load_run_lora",
                    "restore_adapters",
                    "save_run_lora",
                )
            },
            **IN_0_2_0,
        ),
        Moves("jaxrl.train.lora", **IN_0_3_0),
    ),
    "jaxrl.train_steps": (Moves("jaxrl.train.steps", **IN_0_3_0),),
    "jaxrl.train_state": (Moves("jaxrl.train.state", **IN_0_3_0),),
    "jaxrl.sft": (Moves("jaxrl.train.sft", **IN_0_3_0),),
    "jaxrl.evaluation": (Moves("jaxrl.train.evaluation", **IN_0_3_0),),
    "jaxrl.planning": (Moves("jaxrl.plan.programs", **IN_0_3_0),),
    "jaxrl.plan_fixes": (Moves("jaxrl.plan.fixes", **IN_0_3_0),),
    "jaxrl.hand_count": (Moves("jaxrl.plan.hand_count", **IN_0_3_0),),
    "jaxrl.specs": (Moves("jaxrl.job.specs", **IN_0_3_0),),
    "jaxrl.workdir": (Moves("jaxrl.job.workdir", **IN_0_3_0),),
}

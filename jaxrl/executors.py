"""The executors moved to `jaxrl.generation`, `jaxrl.loop.reward` and `jaxrl.sync.store` in 0.2.0;
this alias warns on each name and goes in 0.3.0 (CHANGELOG.md)."""

from jaxrl.infra.moved import moved_names

__getattr__, __dir__ = moved_names(
    __name__,
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
)

"""The rollout queue moved to `jaxrl.loop.rollout_queue` in 0.2.0; this alias warns on each name and
goes in 0.3.0 (CHANGELOG.md)."""

from jaxrl.infra.moved import moved_names

__getattr__, __dir__ = moved_names(
    __name__,
    {
        "RolloutQueue": "jaxrl.loop.rollout_queue",
        "ScoredBatch": "jaxrl.loop.rollout_queue",
        "QueueStats": "jaxrl.loop.rollout_queue",
        "QueueClosed": "jaxrl.infra.closable",
        "wait_until": "jaxrl.infra.closable",
    },
)

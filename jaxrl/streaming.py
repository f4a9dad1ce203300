"""Streaming RL moved to `jaxrl.loop.feeds.streaming` in 0.2.0; this alias warns on each name and
goes in 0.3.0 (CHANGELOG.md)."""

from jaxrl.infra.moved import moved_names

__getattr__, __dir__ = moved_names(
    __name__,
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
)

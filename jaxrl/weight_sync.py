"""The weight push moved to `jaxrl.sync.in_process` and `jaxrl.sync.plan` in 0.2.0; this alias warns
on each name and goes in 0.3.0 (CHANGELOG.md)."""

from jaxrl.infra.moved import moved_names

__getattr__, __dir__ = moved_names(
    __name__,
    {
        "STRATEGIES": "jaxrl.sync.plan",
        "DEFAULT_CHUNK_BYTES": "jaxrl.sync.plan",
        "GeneratorParams": "jaxrl.sync.plan",
        "SyncMetrics": "jaxrl.sync.plan",
        "Tile": "jaxrl.sync.plan",
        "BlockDelivery": "jaxrl.sync.plan",
        "LeafRoute": "jaxrl.sync.plan",
        "SyncPlan": "jaxrl.sync.plan",
        "live_bytes_by_device": "jaxrl.sync.plan",
        "device_order": "jaxrl.sync.plan",
        "factor_mesh": "jaxrl.sync.plan",
        "factor_groupings": "jaxrl.sync.plan",
        "cast_sources": "jaxrl.sync.plan",
        "push_in_chunks": "jaxrl.sync.plan",
        "TRANSPORTS": "jaxrl.sync.in_process",
        "WeightSync": "jaxrl.sync.in_process",
    },
)

"""The cross-process weight push moved to `jaxrl.sync.cross_process` in 0.2.0; this alias warns on
each name and goes in 0.3.0 (CHANGELOG.md)."""

from jaxrl.infra.moved import moved_names

__getattr__, __dir__ = moved_names(
    __name__,
    {
        "TRANSPORTS": "jaxrl.sync.cross_process",
        "Piece": "jaxrl.sync.cross_process",
        "Block": "jaxrl.sync.cross_process",
        "CrossRoute": "jaxrl.sync.cross_process",
        "CrossPlan": "jaxrl.sync.cross_process",
        "default_transport": "jaxrl.sync.cross_process",
        "CrossProcessWeightSync": "jaxrl.sync.cross_process",
        "make_weight_sync": "jaxrl.sync.cross_process",
    },
)

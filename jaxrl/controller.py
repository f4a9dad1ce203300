"""The controller moved to `jaxrl.loop` in 0.2.0; this alias warns on each name and goes in 0.3.0
(CHANGELOG.md)."""

from jaxrl.infra.moved import moved_names

__getattr__, __dir__ = moved_names(
    __name__,
    {
        "Controller": "jaxrl.loop.controller",
        "RLConfig": "jaxrl.loop.config",
        "ControllerIO": "jaxrl.loop.config",
        "SCHEDULES": "jaxrl.loop.config",
        "sampling_config": "jaxrl.loop.config",
        "check_controller_inputs": "jaxrl.loop.config",
        "BusyTimeline": "jaxrl.loop.report",
    },
)

"""The role split moved to `jaxrl.loop.roles` and `jaxrl.loop.rollout_channel` in 0.2.0; this alias
warns on each name and goes in 0.3.0 (CHANGELOG.md)."""

from jaxrl.infra.moved import moved_names

__getattr__, __dir__ = moved_names(
    __name__,
    {
        "ROLES": "jaxrl.loop.roles",
        "RoleLayoutError": "jaxrl.loop.roles",
        "RoleLayout": "jaxrl.loop.roles",
        "check_roles": "jaxrl.loop.roles",
        "RolloutChannel": "jaxrl.loop.rollout_channel",
    },
    removed={
        "RoleController": (
            "a role-split job is the `Controller` with `jaxrl.loop.roles.trainer_feed(...)` on the"
            " trainer's processes and `jaxrl.loop.roles.run_generator(...)` on the generator's"
        ),
    },
)

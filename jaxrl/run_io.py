"""Run plumbing moved to `jaxrl.infra.run_io` in 0.2.0; this alias warns on each name and goes in
0.3.0 (CHANGELOG.md)."""

from jaxrl.infra.moved import moved_names

__getattr__, __dir__ = moved_names(
    __name__,
    {
        "NonFiniteLossError": "jaxrl.infra.run_io",
        "RunIO": "jaxrl.infra.run_io",
        "state_tree": "jaxrl.infra.run_io",
        "tree_to_state": "jaxrl.infra.run_io",
        "host_rss_mb": "jaxrl.infra.run_io",
        "to_host": "jaxrl.infra.run_io",
    },
)

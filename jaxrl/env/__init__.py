"""Environments for multi-turn episodes, on token ids (`base`), and the calculator task
(`calculator`); the driver that runs them on the engine is `jaxrl.generation.episodes`."""

from jaxrl.env.base import EPISODE_STATUSES, Environment, Step

__all__ = ["EPISODE_STATUSES", "Environment", "Step"]

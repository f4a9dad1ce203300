"""Rollout feeds: where the trainer loop's batches come from (`base` says what a feed is)."""

from __future__ import annotations

from jaxrl.loop.config import RLConfig
from jaxrl.loop.feeds.colocated import ColocatedFeed
from jaxrl.loop.feeds.lagged import LaggedFeed
from jaxrl.loop.feeds.streaming import StreamingFeed


def feed_class(config: RLConfig) -> type:
    """The feed of a one-process (or every-role-on-every-process) run of `config`: sync mode's
    colocated feed, streaming's, or the lagged one (fixed lag, free running). A role-split job's
    trainer processes use `remote.RemoteFeed` (`jaxrl.loop.roles.trainer_feed`)."""
    if config.mode == "sync":
        return ColocatedFeed
    return StreamingFeed if config.schedule == "streaming" else LaggedFeed

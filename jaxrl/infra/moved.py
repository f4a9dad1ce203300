"""Old import paths kept for one release: a module whose names moved elsewhere answers each one
from its new home, with a DeprecationWarning that names it (CHANGELOG.md lists the moves)."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping


def moved_names(
    old_module: str,
    homes: Mapping[str, str],
    removed: Mapping[str, str] | None = None,
    *,
    since: str = "0.2.0",
    until: str = "0.3.0",
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """A module's `__getattr__` and `__dir__` for `old_module`, whose names now live in other
    modules: `homes` maps each name to its new module; `removed` maps a name that has no new
    home to what replaces it (an AttributeError says so)."""
    removed = dict(removed or {})

    def __getattr__(name: str):
        home = homes.get(name)
        if home is None:
            gone = f" (removed in {since}: {removed[name]})" if name in removed else ""
            raise AttributeError(f"module {old_module!r} has no attribute {name!r}{gone}")
        warnings.warn(
            f"{old_module}.{name} moved to {home}.{name} in {since}; write "
            f"`from {home} import {name}` (the old path goes in {until}; CHANGELOG.md)",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(home), name)

    def __dir__() -> list[str]:
        return sorted(homes)

    return __getattr__, __dir__

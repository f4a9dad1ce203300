"""Old import paths kept for one release: a module whose names moved elsewhere answers each one
from its new home, with a DeprecationWarning that names it (CHANGELOG.md lists the moves). Gin
parameters that were removed (`removed_bindings`) are refused when a config binds them, with the
binding to write instead."""

from __future__ import annotations

import importlib
import re
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


# Parameters of gin configurables that were removed, by (configurable, parameter): (release, the
# binding that replaces it, `{value}` standing for the value the old binding gave).
_REMOVED_BINDINGS: dict[tuple[str, str], tuple[str, str]] = {}

_UNKNOWN_PARAMETER = re.compile(
    r"Configurable '(?:[\w.]+\.)?(\w+)' doesn't have a parameter named '(\w+)'\.\n"
    r"\s+In (?:file \"(.*)\", line (\d+)|bindings string line \d+)\n\s+(.*)"
)


def removed_bindings(configurable: str, replacements: Mapping[str, str], *, since: str) -> None:
    """Records parameters of the gin configurable `configurable` removed in `since`: each maps to
    the binding that replaces it, with `{value}` for the old binding's value (e.g.
    `{"generator_dtype": "GeneratorConfig.dtype = {value}"}`). A config that still binds one is
    refused when it is parsed, naming the line to write (`removed_binding_fix`)."""
    for parameter, replacement in replacements.items():
        _REMOVED_BINDINGS[configurable, parameter] = since, replacement


def _bound_value(line: str) -> str:
    """The value of the gin binding `line` as gin would write it ("..." when it cannot tell)."""
    import gin

    try:
        parser = gin.config_parser.ConfigParser(line, gin.config.ParserDelegate(skip_unknown=True))
        value = next(iter(parser)).value
    except (ValueError, SyntaxError, StopIteration, AttributeError):
        return "..."
    if isinstance(value, str | int | float | bool | tuple | list | type(None)):
        return repr(value)
    return line.partition("=")[2].split("#", 1)[0].strip() or "..."  # a reference or macro


def removed_binding_fix(message: str) -> str | None:
    """For gin's error about an unknown parameter (`message`) that is a removed one: the line
    that says so and what to write instead; None for any other error."""
    match = _UNKNOWN_PARAMETER.search(message)
    if match is None or (match.group(1), match.group(2)) not in _REMOVED_BINDINGS:
        return None
    name, parameter, path, line_number, line = match.groups()
    since, replacement = _REMOVED_BINDINGS[name, parameter]
    fix = replacement.format(value=_bound_value(line))
    where = f"{path}, line {line_number}" if path else "--gin_param"
    return (
        f"{name}.{parameter} was removed in {since}: write `{fix}` instead ({where}: "
        f"`{line.strip()}`; CHANGELOG.md)"
    )

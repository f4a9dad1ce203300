"""Old import paths kept for one release: a module whose names moved elsewhere answers each one
from its new home, with a DeprecationWarning that names it (CHANGELOG.md lists the moves). An old
module that left the top of `jaxrl/` has no file: `install_aliases` puts a finder on
`sys.meta_path` that makes it on import from its table (`jaxrl.infra.moved_modules`). Gin
parameters that were removed (`removed_bindings`) are refused when a config binds them, with the
binding to write instead."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.abc
import importlib.machinery
import re
import sys
import types
import warnings
from collections.abc import Callable, Iterator, Mapping


def moved_names(
    old_module: str,
    homes: Mapping[str, str],
    removed: Mapping[str, str] | None = None,
    *,
    since: str = "0.2.0",
    until: str = "0.3.0",
    stacklevel: int = 2,
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """A module's `__getattr__` and `__dir__` for `old_module`, whose names now live in other
    modules: `homes` maps each name to its new module; `removed` maps a name that has no new
    home to what replaces it (an AttributeError says so). The warning is attributed to the frame
    `stacklevel` up from the `__getattr__` (2: the line that reads the name)."""
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
            stacklevel=stacklevel,
        )
        return getattr(importlib.import_module(home), name)

    def __dir__() -> list[str]:
        return sorted(homes)

    return __getattr__, __dir__


class PublicNames(Mapping[str, str]):
    """The homes of a module moved whole: each public name of `module` (not `_`-prefixed, not a
    module it imports) maps to `module`, which is imported when a name is first asked for."""

    def __init__(self, module: str):
        self.module = module

    @functools.cached_property
    def _public(self) -> tuple[str, ...]:
        """The public names, read once from the imported module."""
        namespace = vars(importlib.import_module(self.module))
        return tuple(
            name
            for name, value in namespace.items()
            if not name.startswith("_") and not isinstance(value, types.ModuleType)
        )

    def __getitem__(self, name: str) -> str:
        if name not in self._public:
            raise KeyError(name)
        return self.module

    def __iter__(self) -> Iterator[str]:
        return iter(self._public)

    def __len__(self) -> int:
        return len(self._public)


@dataclasses.dataclass(frozen=True)
class Moves:
    """Names of an old module that moved in release `since` (the old path goes in `until`):
    `homes` maps each to its new module, or is the new module's name where the whole module
    moved (every public name of it); `removed` maps a name with no new home to what replaced
    it."""

    homes: Mapping[str, str] | str
    since: str
    until: str
    removed: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def names(self) -> Mapping[str, str]:
        return PublicNames(self.homes) if isinstance(self.homes, str) else self.homes


def alias_attributes(
    old_module: str, moves: tuple[Moves, ...]
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """`__getattr__` and `__dir__` of the alias module `old_module`: a name answers from the first
    of `moves` that has it (`moved_names`, warning at the line that reads it)."""
    answers = [
        (
            move.names(),
            moved_names(
                old_module,
                move.names(),
                move.removed,
                since=move.since,
                until=move.until,
                stacklevel=3,
            )[0],
        )
        for move in moves
    ]

    def __getattr__(name: str):
        if name == "__all__":  # `from <old module> import *`
            return __dir__()
        if name.startswith("__"):  # module protocol names (`__path__`, `__file__`, ...)
            raise AttributeError(f"module {old_module!r} has no attribute {name!r}")
        for homes, answer in answers:
            if name in homes:
                return answer(name)
        gone = next((move for move in moves if name in move.removed), None)
        detail = f" (removed in {gone.since}: {gone.removed[name]})" if gone else ""
        raise AttributeError(f"module {old_module!r} has no attribute {name!r}{detail}")

    def __dir__() -> list[str]:
        return sorted({name for homes, _ in answers for name in homes})

    return __getattr__, __dir__


class _AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds and makes the old modules of `table` (old name -> its `Moves`): a module with no
    file whose names answer from their new homes (`alias_attributes`)."""

    def __init__(self, table: Mapping[str, tuple[Moves, ...]]):
        self.table = table

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.table:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, origin="jaxrl.infra.moved_modules")

    def create_module(self, spec):
        return None  # the default module

    def exec_module(self, module: types.ModuleType) -> None:
        moves = self.table[module.__name__]
        module.__getattr__, module.__dir__ = alias_attributes(module.__name__, moves)
        homes = ", ".join(f"`{m.homes}`" if isinstance(m.homes, str) else "others" for m in moves)
        module.__doc__ = (
            f"Old import path: its names moved ({homes}); each answers from its new home with a "
            "DeprecationWarning naming it (CHANGELOG.md)."
        )


def install_aliases(table: Mapping[str, tuple[Moves, ...]]) -> None:
    """Makes each old module of `table` importable (once per process: a finder at the end of
    `sys.meta_path`, so a real module of the same name would win)."""
    if not any(isinstance(finder, _AliasFinder) for finder in sys.meta_path):
        sys.meta_path.append(_AliasFinder(table))


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

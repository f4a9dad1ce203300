"""Gin at the edge: config dataclasses bound in gin, their type checks and validation, --help.

The t5x pattern: library code takes frozen config dataclasses; gin binds those dataclasses and
one launch function per job; the launcher resolves gin once and passes plain objects on. A job:

    @register_config
    @dataclasses.dataclass(frozen=True)
    class TrainConfig:
        learning_rate: float = 1e-3
        def validate(self):
            if not self.learning_rate > 0: raise ValueError(f"learning_rate={...} must be > 0")

    @gin.configurable
    def train(workdir: str, config: TrainConfig = gin.REQUIRED): ...

    if __name__ == "__main__":
        launch(train)   # --gin_file=configs/x.gin --gin_param='TrainConfig.learning_rate=3e-4'
                        # --workdir=/tmp/run [--overwrite]

`launch` (`jaxrl.infra.launcher`) parses the flags and gin files, builds every config the launch
function is bound to (types checked against the dataclass annotations, then each `validate()`),
all before any JAX device is touched; then it writes the run's `config.gin` into the workdir
(refusing a workdir that holds a run with another config unless --overwrite) and calls the
launch function. Config errors end the launch with `SystemExit` and a message that names the
binding or parameter. This module is the gin side: registering, parsing, type-checking and
resolving configs (`register_config`, `parse_gin`, `resolve_bindings`), and --help.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import inspect
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import gin

from jaxrl.infra.moved import moved_names, removed_binding_fix
from jaxrl.infra.paths import run_path, user_path
from jaxrl.infra.user_code import torch_hint

T = TypeVar("T")

# Config dataclasses registered through `register_config`, by "module.ClassName".
_CONFIGS: dict[str, type] = {}


class ConfigError(ValueError):
    """A bad flag, gin binding or config value; the message names it and the fix."""


# Type checking ------------------------------------------------------------------------------


def _type_name(annotation: Any) -> str:
    if annotation is type(None):
        return "None"
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(annotation))
    return getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")


def _check_sequence(value: Any, annotation: Any, where: str) -> Any:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if not isinstance(value, list | tuple):
        raise ConfigError(f"{where}: expected {_type_name(annotation)}, got {value!r}")
    if origin is tuple and args and args[-1] is not Ellipsis:
        if len(args) != len(value):
            raise ConfigError(f"{where}: expected {len(args)} items ({annotation}), got {value!r}")
        items = [
            check_type(v, a, f"{where}[{i}]")
            for i, (v, a) in enumerate(zip(value, args, strict=True))
        ]
    else:
        item_type = args[0] if args else Any
        items = [check_type(v, item_type, f"{where}[{i}]") for i, v in enumerate(value)]
    return tuple(items) if origin is tuple else list(items)


def check_type(value: Any, annotation: Any, where: str) -> Any:
    """Checks `value` against a type annotation; returns it, normalised (int -> float for float
    fields, list -> tuple for tuple fields, since gin writes both kinds of sequences).

    Supports None, bool, int, float, str, Literal, unions / Optional, tuple[...], list[...],
    dict[...], Callable and classes (config dataclasses: isinstance). Anything else passes.
    """
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is Any or annotation is inspect.Parameter.empty:
        return value
    if annotation is None or annotation is type(None):
        if value is not None:
            raise ConfigError(f"{where}: expected None, got {value!r}")
        return value
    if origin in (typing.Union, types.UnionType):
        for option in args:
            try:
                return check_type(value, option, where)
            except ConfigError:
                continue
        raise ConfigError(
            f"{where}: expected {' | '.join(_type_name(a) for a in args)}, got "
            f"{type(value).__name__} {value!r}"
        )
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"{where}: expected one of {list(args)}, got {value!r}")
        return value
    if origin in (tuple, list):
        return _check_sequence(value, annotation, where)
    if origin is dict or annotation is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a dict, got {value!r}")
        return dict(value)
    if origin is not None:  # other generics (Callable[...], Sequence[...]): check the origin
        annotation = origin
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if annotation is int and isinstance(value, bool):
        raise ConfigError(f"{where}: expected int, got bool {value!r}")
    if annotation in (Callable, typing.Callable) or str(annotation) == "collections.abc.Callable":
        if not callable(value):
            raise ConfigError(f"{where}: expected a callable, got {value!r}")
        return value
    if isinstance(annotation, type) and not isinstance(value, annotation):
        raise ConfigError(
            f"{where}: expected {_type_name(annotation)}, got {type(value).__name__} {value!r}"
        )
    return value


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(cls)}


def _run_validate(config: Any) -> None:
    validate = getattr(config, "validate", None)
    if validate is None:
        return
    try:
        validate()
    except (ValueError, TypeError) as err:
        raise ConfigError(f"{type(config).__name__}: {err}") from err


def build_config(cls: type[T], kwargs: Mapping[str, Any]) -> T:
    """Constructs `cls(**kwargs)` with every value type-checked, then runs `validate()`."""
    types_by_field = _field_types(cls)
    checked = {
        name: check_type(value, types_by_field.get(name, Any), f"{cls.__name__}.{name}")
        for name, value in kwargs.items()
    }
    try:
        config = cls(**checked)
    except TypeError as err:  # a field without default left unbound
        raise ConfigError(
            f"{cls.__name__}: {err}; bind it, e.g. in a gin file `{cls.__name__}.<field> = ...`"
        ) from err
    _run_validate(config)
    return config


def check_config(config: Any) -> Any:
    """Type-checks a config built in Python (recursing into nested configs), runs validate()."""
    for name, annotation in _field_types(type(config)).items():
        value = getattr(config, name)
        check_type(value, annotation, f"{type(config).__name__}.{name}")
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            check_config(value)
    _run_validate(config)
    return config


_BUILDERS: dict[type, Any] = {}  # config class -> its gin configurable


def register_config(cls: type[T]) -> type[T]:
    """Class decorator: makes a frozen config dataclass bindable in gin under its class name.

    Gin then builds it through `build_config`, so every gin-made instance is type-checked and
    validated. The class itself is returned unchanged (Python callers construct it as usual and
    may call `check_config`).
    """
    if not dataclasses.is_dataclass(cls) or not cls.__dataclass_params__.frozen:
        raise TypeError(f"{cls.__name__} must be a frozen dataclass to be a config.")

    def build(**kwargs):
        return build_config(cls, kwargs)

    build.__signature__ = inspect.signature(cls)  # gin checks binding names against it
    build.__name__ = cls.__name__
    build.__qualname__ = cls.__qualname__
    build.__module__ = cls.__module__
    build.__doc__ = cls.__doc__
    _BUILDERS[cls] = gin.external_configurable(build, name=cls.__name__, module=cls.__module__)
    _CONFIGS[f"{cls.__module__}.{cls.__name__}"] = cls
    return cls


def from_gin(cls: type[T], **overrides) -> T:
    """An instance of the registered config `cls` as gin would build it: the fields bound in the
    parsed gin config, `overrides` on top of them, the rest at their defaults (checked)."""
    return _BUILDERS[cls](**overrides)


# Parsing and resolving ----------------------------------------------------------------------

_UNKNOWN_PARAM = re.compile(r"Configurable '([\w.]+)' doesn't have a parameter named '(\w+)'")
_UNKNOWN_CONFIGURABLE = re.compile(
    r"No configurable matching (?:reference )?'@?([\w./]+?)(?:\(\))?'"
)


def _suggestion(message: str) -> str:
    """A "did you mean" for typos in config class or field names."""
    short_names = {key.rsplit(".", 1)[-1]: cls for key, cls in _CONFIGS.items()}
    if match := _UNKNOWN_PARAM.search(message):
        cls = _CONFIGS.get(match.group(1)) or short_names.get(match.group(1))
        candidates = [f.name for f in dataclasses.fields(cls)] if cls else []
        close = difflib.get_close_matches(match.group(2), candidates, n=3)
    elif match := _UNKNOWN_CONFIGURABLE.search(message):
        wanted = match.group(1).split("/")[-1].rsplit(".", 1)[-1]
        close = difflib.get_close_matches(wanted, sorted(short_names), n=3)
    else:
        return ""
    return f"\n  Did you mean: {', '.join(close)}?" if close else ""


def parse_gin(
    gin_files: Sequence[str], gin_params: Sequence[str], search_paths: Sequence[str] = ()
) -> None:
    """Clears gin, then parses the files and the extra bindings (later ones win). Paths are
    taken as users type them (`~` expanded), and the path fields of registered configs
    (`PATH_FIELDS`, e.g. `TaskSpec.train_path`) are bound absolute (`_absolute_path_bindings`)."""
    gin.clear_config()
    gin_files = [user_path(f) for f in gin_files]
    search_paths = [user_path(p) for p in search_paths]
    for prefix in search_paths:
        gin.add_config_file_search_path(prefix)
    for path in gin_files:
        if not Path(path).exists() and not search_paths:
            raise ConfigError(f"--gin_file {path}: no such file.")
    # `include 'configs/...'` resolves from the directory that holds the files' `configs/`
    # (the repository root), whatever the working directory.
    roots = [p.parent for f in gin_files for p in Path(f).resolve().parents if p.name == "configs"]
    files = [str(Path(f).resolve()) if Path(f).exists() else f for f in gin_files]
    try:
        with contextlib.chdir(roots[0]) if roots else contextlib.nullcontext():
            gin.parse_config_files_and_bindings(files, None, finalize_config=False)
            # Scopes the files reference stay known when a --gin_param replaces the reference
            # (`rl_main.generator_mesh = None` leaves the file's generator/ bindings unused).
            _FILE_SCOPES.clear()
            for bindings in gin.config._CONFIG.values():
                _scopes_referenced(bindings, _FILE_SCOPES)
            gin.parse_config_files_and_bindings([], list(gin_params))
    except ImportError as err:  # `import my_module` in a gin file
        raise ConfigError(
            f"gin: {err}; a module a gin file imports must be importable: put its directory on "
            f"PYTHONPATH{torch_hint(err)}"
        ) from err
    except (ValueError, SyntaxError, OSError) as err:
        raise ConfigError(
            removed_binding_fix(str(err))
            or _unquoted_string_fix(err)
            or f"gin: {err}{_suggestion(str(err))}"
        ) from err
    _absolute_path_bindings()


_PATH_LINE = re.compile(r"^((?:\w+/)*)(\w+)\.(\w+) = '([^'\\]*)'$")


def with_absolute_paths(config_text: str) -> str:
    """`config_text` (`gin.config_str()`) with its long lines joined and the relative values of
    path fields made absolute (`run_path`): a run whose config.gin was written before path
    fields were stored absolute compares equal to its relaunch from the same directory."""
    short_names = {key.rsplit(".", 1)[-1]: cls for key, cls in _CONFIGS.items()}
    lines = []
    for line in config_text.replace(" \\\n    ", " ").splitlines():
        match = _PATH_LINE.match(line)
        if match:
            scope, name, field, value = match.groups()
            if field in getattr(short_names.get(name), "PATH_FIELDS", ()) and value:
                line = f"{scope}{name}.{field} = {run_path(value)!r}"
        lines.append(line)
    return "\n".join(lines)


def _absolute_path_bindings() -> None:
    """Rebinds every path field of a registered config (a class's `PATH_FIELDS`) to its
    absolute, `~`-expanded form (`jaxrl.infra.paths.run_path`), in every scope. The launcher
    writes the bindings as the run's `config.gin`, which the run's later jobs (eval, generate,
    a relaunch) read from whatever directory they start in."""
    for (_, selector), bindings in gin.config._CONFIG.items():  # no public way to rebind
        cls = _CONFIGS.get(selector)
        for field in getattr(cls, "PATH_FIELDS", ()):
            value = bindings.get(field)
            if isinstance(value, str) and value:
                bindings[field] = run_path(value)


def _parses(binding: str) -> bool:
    try:
        list(gin.config_parser.ConfigParser(binding, gin.config.ParserDelegate(skip_unknown=True)))
    except (ValueError, SyntaxError):
        return False
    return True


def _unquoted_string_fix(err: BaseException) -> str | None:
    """The message for a binding whose value is a bare word or path (`TaskSpec.name = arithmetic`):
    gin reads values as Python literals, so its own error is Python's about a name
    (`malformed node or string`, or `invalid syntax` for a keyword such as `async`)."""
    if not isinstance(err, SyntaxError) or not err.text:
        return None
    binding = err.text.strip()
    key, sep, value = binding.partition("=")
    value = value.split("#", 1)[0].strip()  # unquoted, so a # starts a comment
    if not sep or not value or value[0] in "'\"@%([{":
        return None
    fixed = f"{key.strip()} = {value!r}"
    if not _parses(fixed):
        return None
    why = "strings need quotes in gin (its values are Python literals)"
    if err.filename:  # a gin file's line
        return f"{err.filename}, line {err.lineno}: `{binding}`: {why}; write `{fixed}`"
    return f"--gin_param '{binding}': {why}; write --gin_param=\"{fixed}\""


# Scopes referenced by the gin files of the last `parse_gin` (before its --gin_param bindings).
_FILE_SCOPES: set[str] = set()


def _scopes_referenced(value: Any, found: set[str]) -> None:
    """Adds the scope components of every `@scope/Name` reference inside `value`."""
    if isinstance(value, gin.config.ConfigurableReference):
        scope = value.config_key[0]
        found.update(c for c in scope.split("/") if c)
    elif isinstance(value, list | tuple | set):
        for item in value:
            _scopes_referenced(item, found)
    elif isinstance(value, Mapping):
        for item in value.values():
            _scopes_referenced(item, found)


def _check_scopes() -> None:
    """A binding under a scope no reference uses (`sfts/OptimizerConfig.learning_rate`, a typo of
    `sft/`) would be written to config.gin and never applied: refuse it, naming it.

    A scope is in use when a reference `@scope/Name()` (or a nested `@a/scope/Name()`) names it,
    in the config or in its gin files before the --gin_param bindings (which may replace a
    reference: its scope then stays known); gin applies `scope/Name.field` only to calls made
    inside that scope. Macros (`gin.macro`)
    are stored by gin as scoped bindings too, and are left alone.
    """
    config = gin.config._CONFIG  # gin has no public listing of the scoped bindings
    used: set[str] = set(_FILE_SCOPES)
    for bindings in config.values():
        _scopes_referenced(bindings, used)
    for (scope, selector), bindings in config.items():
        if not scope or selector.startswith("gin."):
            continue
        unused = [c for c in scope.split("/") if c not in used]
        if not unused:
            continue
        name = selector.rsplit(".", 1)[-1]
        close = difflib.get_close_matches(unused[0], sorted(used), n=3)
        hint = f" Did you mean: {', '.join(close)}?" if close else ""
        field = next(iter(bindings), "<field>")
        raise ConfigError(
            f"gin binding `{scope}/{name}.{field}`: no reference uses the scope {unused[0]!r} "
            f"(scopes in use: {sorted(used) or 'none'}), so the binding would be ignored.{hint}"
        )


def _check_registered_bindings() -> None:
    """Type-checks the values bound to every registered config, used by the launch or not."""
    for selector, cls in _CONFIGS.items():
        types_by_field = _field_types(cls)
        for field, value in gin.get_bindings(selector).items():
            check_type(value, types_by_field.get(field, Any), f"{cls.__name__}.{field}")


def _launch_name(fn: Callable) -> str:
    return getattr(fn, "__name__", repr(fn))


def resolve_bindings(launch_fn: Callable, skip: Sequence[str] = ("workdir",)) -> dict[str, Any]:
    """The arguments gin binds for `launch_fn`, built, type-checked and validated.

    Every `@SomeConfig()` reference is built here (through `build_config`), so a bad value fails
    now, before the launch function runs or any device is used.
    """
    name = _launch_name(launch_fn)
    try:
        _check_scopes()
        _check_registered_bindings()
        kwargs = gin.get_bindings(launch_fn)
    except ConfigError:
        raise
    except (ValueError, TypeError) as err:
        raise ConfigError(f"gin: {err}") from err
    signature = inspect.signature(launch_fn)
    hints = typing.get_type_hints(launch_fn)
    for param in signature.parameters.values():
        if param.name in skip or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if param.name in kwargs:
            where = f"{name}.{param.name}"
            kwargs[param.name] = check_type(kwargs[param.name], hints.get(param.name, Any), where)
        elif param.default is gin.REQUIRED or param.default is param.empty:
            raise ConfigError(
                f"{name}.{param.name} is required but not bound; add e.g. "
                f"`{name}.{param.name} = @...()` to a gin file or --gin_param."
            )
    return kwargs


# --help and hints ----------------------------------------------------------------------------


def _config_classes(annotation: Any) -> list[type]:
    """The registered config dataclasses an annotation names (through unions / Optional)."""
    if annotation in _CONFIGS.values():
        return [annotation]
    return [c for arg in typing.get_args(annotation) for c in _config_classes(arg)]


def _show(value: Any) -> str:
    if value is gin.REQUIRED or value is inspect.Parameter.empty:
        return "(required)"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changed = ", ".join(  # the fields that differ from the class defaults
            f"{f.name}={getattr(value, f.name)!r}"
            for f in dataclasses.fields(value)
            if f.default is dataclasses.MISSING or getattr(value, f.name) != f.default
        )
        return f"= {type(value).__name__}({changed})"
    return f"= {value!r}"


def _summary(cls: type) -> str:
    """The first sentence of a class's docstring, on one line."""
    paragraph = " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split())
    return paragraph.split(". ")[0].rstrip(".") + "." if paragraph else ""


def config_help(launch_fn: Callable, skip: Sequence[str] = ("workdir",)) -> str:
    """What --help shows after the flags: the launch function's gin-bound arguments, then every
    config class they take (nested ones too) with each field's type and default."""
    name = _launch_name(launch_fn)
    hints = typing.get_type_hints(launch_fn)
    lines = [
        "gin-configurable (bind in a --gin_file, or --gin_param='Class.field = value'):",
        "",
    ]
    classes: list[type] = []
    for param in inspect.signature(launch_fn).parameters.values():
        if param.name in skip:
            continue
        annotation = hints.get(param.name, Any)
        lines.append(f"  {name}.{param.name}: {_type_name(annotation)} {_show(param.default)}")
        classes += [c for c in _config_classes(annotation) if c not in classes]
    for cls in classes:  # grows while iterating: nested configs (SFTConfig.optimizer) append
        lines += ["", f"{cls.__name__}: {_summary(cls)}"]
        for field, annotation in _field_types(cls).items():
            f = next(f for f in dataclasses.fields(cls) if f.name == field)
            default = f.default
            if f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            shown = "(required)" if default is dataclasses.MISSING else _show(default)
            lines.append(f"  {field}: {_type_name(annotation)} {shown}")
            classes += [c for c in _config_classes(annotation) if c not in classes]
    examples = example_configs(name)
    if examples:
        lines += ["", "example configs: " + ", ".join(examples)]
    return "\n".join(lines)


def example_configs(launch_name: str) -> list[str]:
    """The gin files under ./configs (or the repository's) that bind `launch_name`."""
    for root in (Path.cwd(), Path(__file__).resolve().parents[2]):
        if (root / "configs").is_dir():
            found = [
                str(p.relative_to(root))
                for p in sorted((root / "configs").glob("**/*.gin"))
                if f"{launch_name}." in p.read_text()
            ]
            if found:
                return found
    return []


def no_gin_file_hint(launch_fn: Callable) -> str:
    """What a launch without --gin_file that misses a required binding adds to its error."""
    examples = example_configs(_launch_name(launch_fn))
    shown = f" e.g. --gin_file={examples[0]} (all: {', '.join(examples)})" if examples else ""
    return (
        f"\n  No --gin_file was given: start from a config in configs/,{shown}; --help lists "
        "every configurable class with its fields and defaults."
    )


def without_gin_call_notes(error: BaseException) -> str:
    """The message of `error` without the `In call to configurable 'X' (<function X at 0x..>)`
    lines gin adds as it passes through configurables: the message names what is wrong."""
    lines = str(error).splitlines()
    return "\n".join(line for line in lines if not _GIN_CALL_NOTE.match(line))


_GIN_CALL_NOTE = re.compile(r"^\s+In call to configurable '[^']*' \(<.*>\)$")


# Moved out of this module in 0.2.0 (CHANGELOG.md); the old paths warn, and go in 0.3.0.
__getattr__ = moved_names(
    __name__,
    {
        "keep_torch_out": "jaxrl.infra.user_code",
        "import_user_callable": "jaxrl.infra.user_code",
        "LaunchFlags": "jaxrl.infra.launcher",
        "parse_flags": "jaxrl.infra.launcher",
        "prepare_workdir": "jaxrl.infra.launcher",
    },
)[0]

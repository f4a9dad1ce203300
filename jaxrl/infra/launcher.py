"""Launching a job: flags -> gin -> built and validated configs -> the run's workdir ->
the launch function (`launch`), and claiming the workdir (`prepare_workdir`: its `config.gin`).

A launcher's `__main__` is `launch(main)` for a `gin.configurable` `main(workdir, ...)`; the gin
side (registering, parsing, type-checking, --help) is `jaxrl.infra.config`.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import logging
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import gin
import jax

from jaxrl.infra import preemption
from jaxrl.infra.config import (
    ConfigError,
    config_help,
    no_gin_file_hint,
    parse_gin,
    resolve_bindings,
    with_absolute_paths,
    without_gin_call_notes,
)
from jaxrl.infra.distributed import exit_with
from jaxrl.infra.errors import UserError
from jaxrl.infra.paths import user_path

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.gin"
# Set to 1: a user error (`jaxrl.infra.errors.UserError`) ends the launch with its traceback.
TRACEBACK_ENV = "JAXRL_TRACEBACK"
T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class LaunchFlags:
    """The command line of a launch: where the run lives and how it is configured."""

    workdir: str
    gin_files: tuple[str, ...] = ()
    gin_params: tuple[str, ...] = ()
    gin_search_paths: tuple[str, ...] = ()
    overwrite: bool = False


def parse_flags(
    argv: Sequence[str] | None = None, description: str | None = None, epilog: str | None = None
) -> LaunchFlags:
    """Parses --gin_file (repeatable), --gin_param (repeatable), --workdir, --overwrite.
    `epilog` ends --help (`launch` puts the configurable classes there, `config_help`)."""
    parser = argparse.ArgumentParser(
        description=description,
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--workdir", required=True, type=user_path, help="Run directory: checkpoints, metrics."
    )
    parser.add_argument("--gin_file", action="append", default=[], help="Gin file (repeatable).")
    parser.add_argument(
        "--gin_param", action="append", default=[], help="Gin binding, e.g. 'A.b = 1' (repeatable)."
    )
    parser.add_argument(
        "--gin_search_path", action="append", default=[], help="Prefix for gin includes."
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="Replace a run with a different config in --workdir (deletes its files).",
    )
    args = parser.parse_args(argv)
    return LaunchFlags(
        workdir=args.workdir,
        gin_files=tuple(args.gin_file),
        gin_params=tuple(args.gin_param),
        gin_search_paths=tuple(args.gin_search_path),
        overwrite=args.overwrite,
    )


def _config_diff(old: str, new: str) -> str:
    lines = difflib.unified_diff(
        old.splitlines(), new.splitlines(), "existing config.gin", "this launch", lineterm="", n=0
    )
    return "\n".join(list(lines)[:40])


def _has_checkpoints(path: Path) -> bool:
    """Whether a run directory (or a stage inside it, e.g. WORKDIR/sft) saved any checkpoint."""
    return any(any(p.iterdir()) for p in path.glob("**/checkpoints") if p.is_dir())


def _continue_hint(path: Path, old_config: str) -> str:
    """For an RL run: how a new run starts from its weights (`PolicySpec.init_from` takes a
    run's workdir; launch.rl restores its newest checkpoint's params, with a fresh optimizer and
    step count)."""
    if "rl_main.policy" not in old_config or "rl_main.lora = @" in old_config:
        return ""  # not an RL run, or a LoRA run's checkpoints (adapters only)
    return (
        "\nTo continue from this run's newest weights (a fresh optimizer and step 0), give a new "
        f"--workdir and --gin_param=\"PolicySpec.init_from = '{path.absolute()}'\"."
    )


def prepare_workdir(workdir: str | Path, config_text: str, overwrite: bool) -> bool:
    """Claims `workdir` for a run whose config is `config_text`; returns True when resuming.

    Same config as the run already there (also one that stored its path fields as typed, now
    written absolute: `with_absolute_paths`): resume. A different one: ConfigError, unless
    `overwrite`, which deletes the old run's files, or the old run never saved a checkpoint
    (it failed early: its files are replaced without asking). A non-empty directory without a
    config.gin is not a run directory: refused either way. Process 0 of a job calls it.
    """
    path = Path(workdir)
    config_path = path / CONFIG_FILE
    if config_path.exists():
        old = config_path.read_text()
        if old == config_text:
            logger.info("resuming the run in %s (same config)", path)
            return True
        if with_absolute_paths(old) == with_absolute_paths(config_text):
            # A run that stored its paths as typed: the same files, now written absolute.
            logger.info("resuming the run in %s (same config, paths now absolute)", path)
            _write_config(path, config_text)
            return True
        if not overwrite and not _has_checkpoints(path):
            # The earlier launch failed before its first checkpoint (a config fixed since):
            # nothing to resume or to lose, so the new config takes the workdir.
            print(f"[jaxrl] {path} holds no checkpoint yet: starting it with the new config")
        elif not overwrite:
            raise ConfigError(
                f"--workdir {path} holds a run with a different config:\n"
                f"{_config_diff(old, config_text)}\n"
                "Pass --overwrite to replace that run (deletes its checkpoints and metrics) or "
                f"use a new --workdir.{_continue_hint(path, old)}"
            )
        else:
            logger.warning("--overwrite: deleting the previous run in %s", path)
        shutil.rmtree(path)
    elif path.exists() and any(path.iterdir()):
        raise ConfigError(
            f"--workdir {path} is not empty and has no {CONFIG_FILE}, so it is not a run "
            "directory; use a new --workdir (--overwrite never deletes such a directory)."
        )
    path.mkdir(parents=True, exist_ok=True)
    _write_config(path, config_text)
    return False


def _write_config(path: Path, config_text: str) -> None:
    tmp_path = path / f".{CONFIG_FILE}.tmp"
    tmp_path.write_text(config_text)
    tmp_path.replace(path / CONFIG_FILE)  # atomic: a reader never sees half a config


def user_error_line(error: UserError) -> str:
    """`kind: message` in one line: the message without gin's call notes, then where the run
    raised it (its `[jaxrl]` notes); for an error in the user's own code, how to see its full
    traceback."""
    lines = without_gin_call_notes(error).splitlines()
    parts = [" ".join(line.strip() for line in lines if line.strip())]
    for note in getattr(error, "__notes__", ()):
        if note.startswith("[jaxrl] "):
            parts.append(note.removeprefix("[jaxrl] "))
    line = f"{error.kind}: " + "; ".join(parts)
    if getattr(error, "from_user_code", False):
        line += f" ({TRACEBACK_ENV}=1 prints the full traceback)"
    return line


def run_cli(main: Callable[[], int | None]) -> None:
    """`sys.exit(main())` for the launchers that take plain flags (generate, eval, export,
    import_gguf, fetch, plot): what a user got wrong ends in one line, as in `launch`: a
    `UserError` (a raising reward, bad data) as `user_error_line`, a config error, and a file
    or directory a flag names that is not there (`FileNotFoundError`, its message names the
    path). JAXRL_TRACEBACK=1 shows the traceback instead."""
    import sys

    try:
        code = main()
    except (UserError, ConfigError, FileNotFoundError) as err:
        if os.environ.get(TRACEBACK_ENV) == "1":
            raise
        if isinstance(err, UserError):
            raise SystemExit(user_error_line(err)) from None
        if isinstance(err, ConfigError):
            raise SystemExit(f"config error: {without_gin_call_notes(err)}") from None
        raise SystemExit(f"error: {err}") from None
    sys.exit(code)


def launch(
    launch_fn: Callable[..., T], argv: Sequence[str] | None = None, description: str | None = None
) -> T:
    """Flags -> gin -> built + validated configs -> workdir/config.gin -> `launch_fn(...)`.

    `launch_fn` is a `gin.configurable` taking `workdir` and its gin-bound arguments. Config
    errors raise SystemExit with the message (naming the binding) before any device is used.
    """
    flags = parse_flags(argv, description, epilog=config_help(launch_fn))
    try:
        parse_gin(flags.gin_files, flags.gin_params, flags.gin_search_paths)
        try:
            kwargs = resolve_bindings(launch_fn)
        except ConfigError as err:
            if not flags.gin_files and "is required but not bound" in str(err):
                raise ConfigError(f"{err}{no_gin_file_hint(launch_fn)}") from err
            raise
        # Only now touch JAX (process_index initialises the backend): configs are known good.
        if jax.process_index() == 0:
            prepare_workdir(flags.workdir, gin.config_str(), flags.overwrite)
        if jax.process_count() > 1:  # the others wait until process 0 has claimed the workdir
            # (checking it themselves meanwhile, they could see it half-made)
            from jaxrl.infra.distributed import barrier

            barrier(f"workdir:{flags.workdir}")
    except ConfigError as err:
        raise SystemExit(f"config error: {without_gin_call_notes(err)}") from err
    try:
        return launch_fn(workdir=flags.workdir, **kwargs)
    except UserError as err:
        if os.environ.get(TRACEBACK_ENV) == "1":
            raise
        exit_with(user_error_line(err))
    except preemption.StopRequested as stop:
        print(f"[jaxrl] {without_gin_call_notes(stop)}", flush=True)
        raise SystemExit(0) from None
    except KeyboardInterrupt:  # Ctrl-C before the loop took over the signal, or twice
        print(
            "[jaxrl] interrupted (Ctrl-C) without saving; rerun the same command to resume from "
            "the last checkpoint.",
            flush=True,
        )
        raise SystemExit(130) from None

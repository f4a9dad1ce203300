"""Checkpoints of a training run: sharded arrays + JSON-able run state, via Orbax.

A step directory `<dir>/<step>/` holds two items: `state`, a pytree of (sharded) arrays (params,
optimizer state, pending rollouts, ...) written by every process with Orbax's PyTree handler, and
`extra`, a JSON object (step, policy versions, RNG key data, data-iterator position) written by
process 0 with JsonSave.

Atomicity (orbax-checkpoint 0.12.8, local / POSIX paths): a save writes into
`<dir>/<step>.orbax-checkpoint-tmp`, writes `commit_success.txt` into it, then renames it to
`<dir>/<step>`. Orbax lists only names matching `^\\d+$`, so a save killed before the rename is
never listed, and `cleanup_tmp_directories` deletes it when the next writer opens the directory.
On object stores (gs://) Orbax writes in place and the commit file alone marks completion. This
wrapper requires the commit file in every case: a step directory without it (a copy cut short, a
non-atomic filesystem) is ignored, and removed by a writer. If the newest finished step still
fails to restore (a corrupt or missing data file), `restore()` logs a warning and falls back to
the previous step.

Role-split jobs (`restrict_to_processes`): only the trainer processes hold the train state and
touch checkpoints, so Orbax runs over that subset (its `active_processes`, barriers among them
only). Orbax 0.12.8 assumes that in a job of several processes an array held by one process
alone came from `pmap` and refuses to save it, and its finalisation checks that array metadata
came from every process of the job; a one-process trainer role holds exactly such arrays, so
for a subset both checks are relaxed to the subset (`_allow_subset_saves`).
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import itertools
import json
import logging
import re
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxrl.infra import faults

logger = logging.getLogger(__name__)

# Orbax 0.12.8 writes this file into a step directory just before the atomic rename (and, on
# object stores, as the only completion marker). orbax/checkpoint/_src/path/atomicity_types.py.
COMMIT_MARKER = "commit_success.txt"
_TMP_DIR = re.compile(r"^\d+\.orbax-checkpoint-tmp")
_STEP_DIR = re.compile(r"^(0|[1-9]\d*)$")


class CheckpointNotFoundError(FileNotFoundError):
    """No finished checkpoint (for the requested step) in the directory."""


class CheckpointMismatchError(ValueError):
    """The restore target does not match the saved tensors (names the tensor)."""


class CheckpointCorruptError(RuntimeError):
    """Every finished checkpoint failed to restore (the message lists each failure)."""


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """How often and how many checkpoints a run keeps.

    Attributes:
      save_every_steps: `save(step)` writes only when step is a multiple (or `force=True`).
      keep_last_n: finished checkpoints kept; older ones are deleted after each save.
      async_save: write in a background thread; `save` returns once arrays are copied to host,
        so the caller may donate / overwrite the device buffers straight away.
    """

    save_every_steps: int = 1000
    keep_last_n: int = 3
    async_save: bool = True

    def validate(self) -> None:
        if self.save_every_steps < 1:
            raise ValueError(f"save_every_steps={self.save_every_steps} must be >= 1.")
        if self.keep_last_n < 1:
            raise ValueError(f"keep_last_n={self.keep_last_n} must be >= 1.")


@dataclasses.dataclass(frozen=True)
class Restored:
    """What `Checkpointer.restore` returns: the step, the array pytree, the JSON run state."""

    step: int
    state: Any
    extra: dict[str, Any]


def to_json_value(value: Any, where: str = "extra") -> Any:
    """`value` with NumPy / JAX scalars and small arrays turned into plain JSON types.

    Raises TypeError naming the offending key path for anything else (objects, large arrays).
    """
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"{where}: JSON keys must be str, got {k!r} ({type(k).__name__})")
            out[k] = to_json_value(v, f"{where}.{k}")
        return out
    if isinstance(value, list | tuple):
        return [to_json_value(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, np.generic | np.ndarray | jax.Array):
        return np.asarray(value).tolist()
    raise TypeError(
        f"{where} is a {type(value).__name__}, which is not JSON-able; store arrays in the "
        "state pytree, and plain numbers / strings / lists / dicts in extra."
    )


def key_to_json(key: jax.Array) -> dict[str, Any]:
    """A typed PRNG key (`jax.random.key`) as JSON: its implementation name and key data."""
    return {
        "impl": str(jax.random.key_impl(key)),
        "data": np.asarray(jax.random.key_data(key)).tolist(),
    }


def key_from_json(blob: dict[str, Any]) -> jax.Array:
    """Inverse of `key_to_json`."""
    data = np.asarray(blob["data"], dtype=np.uint32)
    return jax.random.wrap_key_data(data, impl=blob["impl"])


def _path_name(path) -> str:
    """A key path as Orbax names the tensor ("params.w.value", "opt.0.mu.w")."""
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
    return ".".join(parts)


def _stored_shape(x: Any) -> tuple[int, ...]:
    """The shape Orbax stores: typed PRNG keys are saved as their uint32 key data."""
    dtype = getattr(x, "dtype", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return tuple(jax.eval_shape(jax.random.key_data, x).shape)
    return tuple(x.shape)


def _shapes_by_name(tree: Any) -> dict[str, tuple[int, ...]]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {_path_name(p): _stored_shape(x) for p, x in leaves if hasattr(x, "shape")}


def check_target_matches(saved_metadata: Any, abstract_target: Any, step: int) -> None:
    """Raises CheckpointMismatchError naming every tensor missing or shaped differently."""
    saved = _shapes_by_name(saved_metadata)
    wanted = _shapes_by_name(abstract_target)
    missing = sorted(set(wanted) - set(saved))
    if missing:
        hint = ""
        if any(".master." in n for n in set(wanted) ^ set(saved)):
            hint = (
                " One side has float32 master weights (opt_state.master) and the other not: the "
                "run's param_dtype differs from the checkpoint's (docs/precision.md)."
            )
        raise CheckpointMismatchError(
            f"checkpoint step {step} has no tensor(s) {missing[:10]}; it holds "
            f"{sorted(saved)[:20]}. The restore target's structure differs from the saved "
            f"state.{hint}"
        )
    wrong = [(n, saved[n], s) for n, s in sorted(wanted.items()) if saved[n] != s]
    if wrong:
        details = "; ".join(f"{n}: saved {a}, target {b}" for n, a, b in wrong[:10])
        raise CheckpointMismatchError(
            f"checkpoint step {step} does not fit the restore target: {details}. Was it saved "
            "with another model config?"
        )


def _abstract(tree: Any) -> Any:
    """ShapeDtypeStructs (with shardings) for a tree of arrays or ShapeDtypeStructs."""

    def one(x):
        if isinstance(x, jax.ShapeDtypeStruct):
            return x
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))

    return jax.tree.map(one, tree)


def uncommitted_step_dirs(directory: Path) -> list[Path]:
    """Step directories without the commit marker: never finished, never restored."""
    if not directory.is_dir():
        return []
    return sorted(
        p
        for p in directory.iterdir()
        if p.is_dir() and _STEP_DIR.match(p.name) and not (p / COMMIT_MARKER).exists()
    )


_ACTIVE: tuple[int, ...] | None = None  # restrict_to_processes


def restrict_to_processes(processes: tuple[int, ...] | None) -> None:
    """Checkpointers made from now on run over these processes only (None: every process).

    A role-split RL job (`jaxrl.loop.roles`) calls it on its trainer processes: they alone hold the
    train state, and the generator processes never take part in a save or restore. The lowest
    process of the subset writes the JSON state and cleans up."""
    global _ACTIVE
    _ACTIVE = None if processes is None else tuple(sorted(set(processes)))


def _subset() -> tuple[int, ...] | None:
    """The active processes when they are a proper subset of a multi-process job, else None."""
    if _ACTIVE is None or jax.process_count() == 1 or len(_ACTIVE) == jax.process_count():
        return None
    if jax.process_index() not in _ACTIVE:
        raise RuntimeError(
            f"process {jax.process_index()} made a Checkpointer but checkpoints are restricted "
            f"to processes {list(_ACTIVE)} (restrict_to_processes)"
        )
    return _ACTIVE


def _primary() -> int:
    subset = _subset()
    return 0 if subset is None else subset[0]


class _SubsetJax:
    """What Orbax's array handler module sees as `jax` once a subset checkpointer exists: the
    real module, except that `process_count()` counts the subset (`_allow_subset_saves`)."""

    def __getattr__(self, name):
        return getattr(jax, name)

    @staticmethod
    def process_count() -> int:
        subset = _subset()
        return jax.process_count() if subset is None else len(subset)


def _allow_subset_saves():
    """Relaxes Orbax's two whole-job checks for a checkpointer over a subset of processes (module
    docstring); returns the array metadata validator to give the PyTree handler."""
    from orbax.checkpoint._src.metadata import array_metadata_store
    from orbax.checkpoint._src.serialization import jax_array_handlers

    # Its only use of jax.process_count() is the "host local array" refusal.
    jax_array_handlers.jax = _SubsetJax()

    class _SubsetValidator(array_metadata_store.Validator):
        def _validate_process_count(self, *, ref_process_index: int) -> None:
            pass  # every array of the trainer role may live on one of the job's processes

    return _SubsetValidator()


def _handlers() -> dict[str, ocp.CheckpointHandler]:
    # Registered up front so that a fresh manager (a reader, a resumed run) can read metadata.
    # The PyTree handler (what StandardCheckpointHandler wraps) also restores a subtree
    # (`partial_restore`), e.g. only the params of a run for export.
    if _subset() is not None:
        validator = _allow_subset_saves()
        state = ocp.PyTreeCheckpointHandler(
            array_metadata_validator=validator,
            multiprocessing_options=_multiprocessing_options(),
        )
    else:
        state = ocp.PyTreeCheckpointHandler()
    return {"state": state, "extra": ocp.JsonCheckpointHandler()}


def _multiprocessing_options() -> ocp.options.MultiprocessingOptions:
    subset = _subset()
    if subset is None:
        return ocp.options.MultiprocessingOptions()
    return ocp.options.MultiprocessingOptions(primary_host=subset[0], active_processes=set(subset))


def _manager_options(config: CheckpointConfig, read_only: bool) -> ocp.CheckpointManagerOptions:
    multiprocessing = _multiprocessing_options()
    if read_only:
        return ocp.CheckpointManagerOptions(
            read_only=True,
            create=False,
            save_interval_steps=0,
            multiprocessing_options=multiprocessing,
        )
    # Orbax's default policy also saves the first step of a run (InitialSavePolicy); a plain
    # interval (plus preemption saves) keeps "which steps are saved" a function of the step alone.
    policies = ocp.checkpoint_managers
    policy = policies.AnySavePolicy(
        [
            policies.FixedIntervalPolicy(config.save_every_steps),
            policies.PreemptionCheckpointingPolicy(),
        ]
    )
    return ocp.CheckpointManagerOptions(
        save_decision_policy=policy,
        max_to_keep=config.keep_last_n,
        enable_async_checkpointing=config.async_save,
        cleanup_tmp_directories=True,
        multiprocessing_options=multiprocessing,
        create=_subset() is None,  # a subset: Orbax refuses to create it; Checkpointer does
    )


def _remove_uncommitted(directory: Path) -> None:
    """Deletes what interrupted saves left: step directories without the commit marker, and
    Orbax's temporary directories (removed here, synchronously, rather than by Orbax's own
    clean-up, which may still be running when the first restore lists the directory)."""
    leftovers = uncommitted_step_dirs(directory)
    if directory.is_dir():
        leftovers += sorted(p for p in directory.iterdir() if _TMP_DIR.match(p.name))
    for path in leftovers:
        logger.warning("removing unfinished checkpoint %s (no %s)", path, COMMIT_MARKER)
        shutil.rmtree(path)


_BARRIERS = itertools.count()  # the same sequence on every process: unique barrier names


def _barrier(what: str) -> None:
    """A barrier of every process through the coordination service, not a device collective:
    in an async RL job the generator's thread runs programs on its devices meanwhile, and a
    collective over every device, issued from another thread, can take those devices in a
    different order on different processes and hang the job."""
    from jaxrl.infra.distributed import barrier

    barrier(f"jaxrl_checkpointer/{what}/{next(_BARRIERS)}", processes=_subset())


def use_coordination_barriers() -> None:
    """Makes Orbax synchronise processes through the coordination service too (its default
    is `sync_global_devices`, a collective over every device; see `_barrier`)."""
    from absl import flags
    from orbax.checkpoint._src.multihost import multihost

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    flags.FLAGS[multihost.EXPERIMENTAL_ORBAX_USE_DISTRIBUTED_BARRIER.name].value = True


def _drop_read_only_notice(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("Given directory is read only")


class Checkpointer:
    """Saves and restores one run's checkpoints in `directory` (one writer; readers read_only).

    Example:
      ckpt = Checkpointer(workdir / "checkpoints", CheckpointConfig(save_every_steps=100))
      ckpt.save(step, {"params": params, "opt_state": opt_state}, extra={"step": step})
      restored = ckpt.restore(abstract_target=attach_shardings(abstract, shardings))
      ckpt.close()  # waits for the last async save (also registered with atexit)
    """

    def __init__(
        self,
        directory: str | Path,
        config: CheckpointConfig = CheckpointConfig(),
        *,
        read_only: bool = False,
    ):
        config.validate()
        self.directory = Path(directory).absolute()
        self.config = config
        self.read_only = read_only
        if not read_only and jax.process_index() == _primary():
            _remove_uncommitted(self.directory)
            if _subset() is not None:
                self.directory.mkdir(parents=True, exist_ok=True)
        if jax.process_count() > 1:
            use_coordination_barriers()
            if not read_only:
                _barrier("init")
        # A reader (eval, generate, export) is read only by design: Orbax's warning that says
        # so ("Given directory is read only") is noise there.
        absl_logger = logging.getLogger("absl")
        absl_logger.addFilter(_drop_read_only_notice)
        try:
            self._manager = ocp.CheckpointManager(
                self.directory,
                options=_manager_options(config, read_only),
                item_handlers=_handlers(),
            )
        finally:
            absl_logger.removeFilter(_drop_read_only_notice)
        self._closed = False
        atexit.register(self.close)

    def all_steps(self) -> list[int]:
        """Finished (committed) steps, ascending."""
        if self.read_only:  # someone else writes: re-list. A writer's own list is exact, and a
            self._manager.reload()  # reload during an async save would drop the in-flight step.
        return sorted(
            s
            for s in self._manager.all_steps()
            if (self.directory / str(s) / COMMIT_MARKER).exists()
        )

    def latest_step(self) -> int | None:
        """The newest finished step, or None for an empty directory."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def should_save(self, step: int) -> bool:
        """Whether `save(step)` would write (interval reached, step newer than the last save)."""
        return not self.read_only and self._manager.should_save(step)

    def save(
        self, step: int, state: Any, extra: dict[str, Any] | None = None, *, force: bool = False
    ) -> bool:
        """Starts saving `state` (pytree of arrays) and `extra` (JSON-able) as `step`.

        Returns whether a save was started (False off the `save_every_steps` interval unless
        `force`). With async_save the write finishes in the background; the next `save`,
        `restore`, `wait_until_finished` or `close` waits for it.
        """
        if self.read_only:
            raise PermissionError(f"Checkpointer on {self.directory} is read_only.")
        blob = to_json_value(dict(extra or {}))
        json.dumps(blob)  # fail here, not in the background thread
        args = ocp.args.Composite(state=ocp.args.PyTreeSave(state), extra=ocp.args.JsonSave(blob))
        if faults.wants_kill_in_save(step) and (force or self.should_save(step)):
            self._die_inside_save(step, args)
        return self._manager.save(step, args=args, force=force)

    def _die_inside_save(self, step: int, args) -> None:
        """Fault injection: the save of `step` never commits; the process dies once its
        temporary directory exists (the state a crash mid-save leaves on disk)."""
        from orbax.checkpoint._src.path import atomicity

        self.wait_until_finished()  # an earlier save in flight must commit, not hang on the patch

        async def never_finalize(self_):
            await asyncio.sleep(3600)

        atomicity.AtomicRenameTemporaryPath.finalize = never_finalize
        self._manager.save(step, args=args, force=True)
        faults.kill_when_exists(self.directory / f"{step}.orbax-checkpoint-tmp")

    def restore(
        self, step: int | None = None, *, abstract_target: Any, partial: bool = False
    ) -> Restored:
        """Restores `step` (default: newest finished, falling back past corrupt ones).

        `abstract_target` is a pytree of `jax.ShapeDtypeStruct`s with `sharding` set (see
        `sharding.attach_shardings`), or of arrays whose shardings to reuse. Arrays come back
        with those shardings, whatever mesh the checkpoint was saved from. With `partial=True`
        the target may be a subtree of what was saved (e.g. only `{"params": ...}` to export a
        model without reading the optimizer state).
        """
        self.wait_until_finished()
        target = _abstract(abstract_target)
        steps = self.all_steps()
        if not steps:
            raise CheckpointNotFoundError(
                f"no finished checkpoint in {self.directory}; start from scratch or point the "
                "run at the workdir that holds its checkpoints."
            )
        if step is not None:
            if step not in steps:
                raise CheckpointNotFoundError(
                    f"no finished checkpoint for step {step} in {self.directory}; finished "
                    f"steps: {steps}."
                )
            return self._restore_step(step, target, partial)
        return self._restore_newest(steps, target, partial)

    def _restore_newest(self, steps: list[int], target: Any, partial: bool) -> Restored:
        failures = []
        for step in reversed(steps):
            try:
                restored = self._restore_step(step, target, partial)
            except CheckpointMismatchError:
                raise
            except Exception as err:  # any read failure: try the previous step
                failures.append(f"step {step}: {type(err).__name__}: {err}")
                logger.warning(
                    "checkpoint step %d in %s failed to restore (%s: %s); falling back to the "
                    "previous step",
                    step,
                    self.directory,
                    type(err).__name__,
                    str(err)[:500],
                )
            else:
                if failures and not self.read_only:
                    self._quarantine([s for s in steps if s > step], restored_step=step)
                return restored
        raise CheckpointCorruptError(
            f"every checkpoint in {self.directory} failed to restore:\n" + "\n".join(failures)
        )

    def _restore_step(self, step: int, target: Any, partial: bool) -> Restored:
        saved = self._manager.item_metadata(step)["state"]
        saved = getattr(saved, "tree", saved)
        check_target_matches(saved, target, step)
        args = ocp.args.Composite(
            state=ocp.args.PyTreeRestore(
                target,
                restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                partial_restore=partial,
            ),
            extra=ocp.args.JsonRestore(),
        )
        restored = self._manager.restore(step, args=args)
        return Restored(step=step, state=restored["state"], extra=dict(restored["extra"] or {}))

    def _quarantine(self, steps: list[int], restored_step: int) -> None:
        """Moves the unreadable `steps` aside (`N.corrupt`), so that the resumed run saves those
        steps afresh instead of Orbax treating them as already saved."""
        if jax.process_index() == _primary():
            for step in steps:
                aside = self.directory / f"{step}.corrupt"
                if aside.exists():
                    shutil.rmtree(aside)
                (self.directory / str(step)).rename(aside)
        if jax.process_count() > 1:
            _barrier("quarantine")
        self._manager.reload()
        print(
            f"[checkpoint] step(s) {steps} in {self.directory} could not be restored; moved to "
            f"{', '.join(f'{s}.corrupt' for s in steps)} and resumed from step {restored_step}",
            flush=True,
        )

    def read_extra(self, step: int | None = None) -> dict[str, Any]:
        """Only the JSON run state of `step` (default newest), without touching any arrays."""
        self.wait_until_finished()
        steps = self.all_steps()
        step = steps[-1] if step is None and steps else step
        if step is None or step not in steps:
            raise CheckpointNotFoundError(
                f"no finished checkpoint for step {step} in {self.directory}."
            )
        restored = self._manager.restore(
            step, args=ocp.args.Composite(extra=ocp.args.JsonRestore())
        )
        return dict(restored["extra"] or {})

    def wait_until_finished(self) -> None:
        """Blocks until the in-flight async save (if any) is committed; re-raises its error."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves and releases Orbax's threads. Idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

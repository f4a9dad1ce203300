"""The plumbing every training loop shares (SFT, RL, `msd_jax`): checkpoints of a training
state, metrics, the progress bar and line, NaN checks, the graceful stop and the fault-injection
hooks, so that the loops themselves read as the algorithm.

A run directory holds `checkpoints/<step>/` (Orbax: `state` = `state_tree(state)`, `extra` =
JSON), `metrics.jsonl` and, unless turned off, `tensorboard/`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxrl.infra import faults, preemption
from jaxrl.infra.checkpoint import CheckpointConfig, Checkpointer
from jaxrl.infra.metrics import MetricsWriter, progress_bar

logger = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"
RL_ADVICE = "Lower the learning rate or check the data / rewards."


def checkpoint_dir(workdir: str | Path) -> str:
    return os.path.join(workdir, CHECKPOINT_DIR)


class NonFiniteLossError(FloatingPointError):
    """The loss or the gradient norm became NaN / Inf."""


def state_tree(state: Any) -> dict:
    """The checkpointed form of a training state (a `flax.struct` dataclass such as
    `jaxrl.train.trainer.TrainState`): a dict of its fields, so that `params` can be restored alone.
    A field that is itself a dataclass (MSD's weighting state) becomes a dict of its fields."""
    tree = _fields(state)
    return {k: _fields(v) if dataclasses.is_dataclass(v) else v for k, v in tree.items()}


def _fields(value: Any) -> dict:
    return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}


def tree_to_state(tree: dict, like: Any) -> Any:
    """`state_tree`'s inverse: `like` (the restore target) with its fields from `tree`."""
    fields = {}
    for name, value in tree.items():
        old = getattr(like, name)
        fields[name] = dataclasses.replace(old, **value) if dataclasses.is_dataclass(old) else value
    return dataclasses.replace(like, **fields)


class RunIO:
    """Checkpoints under WORKDIR/checkpoints, metrics in WORKDIR/metrics.jsonl (+ TensorBoard
    unless `tensorboard=False`), a progress bar on a terminal (a log line every
    `log_every_steps` otherwise).

    `save_final=False` turns off the checkpoint the loops force at their last step (`save(...,
    force=True)`): a script that times steps, or keeps only scheduled checkpoints, sets it.
    `host_metrics` adds the process's resident memory (`host/rss_mb`) to every metrics line.
    `finite` names the metrics that must stay finite (`log` and `check_finite` raise
    `NonFiniteLossError` naming the step, the last good checkpoint and `advice`).
    """

    def __init__(
        self,
        workdir: str | Path,
        *,
        total_steps: int,
        save_every_steps: int,
        keep_last_n: int,
        desc: str,
        log_every_steps: int = 50,
        save_final: bool = True,
        tensorboard: bool = True,
        host_metrics: bool = True,
        finite: tuple[str, ...] = ("loss", "grad_norm"),
        advice: str = RL_ADVICE,
    ):
        self.workdir, self.total_steps, self.desc = workdir, total_steps, desc
        self.save_final = save_final
        self.log_every_steps = log_every_steps
        self.host_metrics, self.finite, self.advice = host_metrics, finite, advice
        self.ckpt = Checkpointer(
            checkpoint_dir(workdir),
            CheckpointConfig(save_every_steps=save_every_steps, keep_last_n=keep_last_n),
        )
        self.metrics = MetricsWriter(workdir, tensorboard=tensorboard)
        self.bar = None
        self._start = time.perf_counter()
        self._start_step = self._shown_step = 0
        self._saved_step: int | None = None
        preemption.install()

    def restore(self, abstract_state: Any) -> tuple[Any, dict] | None:
        """The newest finished checkpoint of this run as (state, extra), or None.

        `abstract_state` is the restore target (`jax.ShapeDtypeStruct`s with shardings, or
        arrays whose shardings to reuse). Either way the metrics the interrupted run logged after
        that checkpoint (all of them when there is none) are dropped first: those steps run
        again, and each step keeps one line in metrics.jsonl and one TensorBoard point.
        """
        if self.ckpt.latest_step() is None:
            self.metrics.discard_after(-1)
            return None
        restored = self.ckpt.restore(abstract_target=state_tree(abstract_state))
        self.metrics.discard_after(int(restored.step))
        if self.metrics.is_writer and restored.step < self.total_steps:
            print(f"[{self.desc}] resuming {self.workdir} from step {restored.step}", flush=True)
        return tree_to_state(restored.state, abstract_state), restored.extra

    def finished(self) -> bool:
        return self.ckpt.latest_step() == self.total_steps

    def start(self, step: int) -> None:
        self.bar = progress_bar(self.total_steps, initial_step=step, desc=self.desc)
        self._start = time.perf_counter()
        self._start_step = self._shown_step = step

    def histogram(self, step: int, name: str, values: Any) -> None:
        """A metric's distribution at `step` (TensorBoard only; `StepReport`'s optional hook)."""
        self.metrics.write_histogram(step, name, values)

    def log(self, step: int, metrics: dict[str, Any], headline: dict[str, str]) -> dict:
        """Writes `metrics` for `step`, checks them (`check_finite`) and shows `step` (`show`);
        returns the metrics as written (flat, host floats)."""
        if self.host_metrics:
            metrics = {**metrics, "host/rss_mb": host_rss_mb()}
        written = self.metrics.write(step, metrics)
        self.check_finite(step, written)
        self.show(step, headline)
        return written

    def check_finite(self, step: int, values: dict[str, float]) -> None:
        """Raises NonFiniteLossError naming `step` if one of the `finite` metrics in `values` is
        NaN / Inf (the last good checkpoint is named too)."""
        for name in self.finite:
            value = values.get(name)
            if value is not None and not math.isfinite(value):
                try:  # the previous step's save may still be in flight: it is the last good one
                    self.ckpt.wait_until_finished()
                except Exception:  # a failed save is no good checkpoint; report the loss anyway
                    logger.exception("the checkpoint save before step %d failed", step)
                raise NonFiniteLossError(
                    f"[{self.desc}] {name} is {value} at step {step}; the last good checkpoint "
                    f"is step {self.ckpt.latest_step()} in {self.ckpt.directory}. {self.advice}"
                )

    def show(self, step: int, headline: dict[str, str] | None = None) -> None:
        """Moves the progress bar to `step` (with `headline` beside it); off a terminal, prints
        the progress line every `log_every_steps` and at the last step."""
        if self.bar is None:
            return
        self.bar.update(step - self._shown_step)
        self._shown_step = step
        if headline:
            self.bar.set_postfix(headline, refresh=False)
        if (
            self.metrics.is_writer
            and not sys.stderr.isatty()
            and (step % self.log_every_steps == 0 or step == self.total_steps)
        ):
            elapsed = time.perf_counter() - self._start
            text = " ".join(f"{k}={v}" for k, v in (headline or {}).items())
            print(
                f"[{self.desc}] step {step}/{self.total_steps} {text} "
                f"({elapsed:.0f}s{self._pace(step, elapsed)})",
                flush=True,
            )

    def _pace(self, step: int, elapsed: float) -> str:
        """`, 0.25 s/step, ETA 1m40s`: the mean over the steps this launch ran (compilation
        included), empty before the first."""
        done = step - self._start_step
        if done < 1:
            return ""
        per_step = elapsed / done
        eta = round(per_step * (self.total_steps - step))
        return f", {per_step:.3g} s/step, ETA {eta // 60}m{eta % 60:02d}s"

    def save_due(self, step: int, force: bool = False) -> bool:
        """Whether `save` writes `step`: its schedule, `force` (the final step; unless
        `save_final=False`), or a requested stop (SIGTERM)."""
        return (force and self.save_final) or preemption.requested() or self.ckpt.should_save(step)

    def save(self, state: Any, extra: dict, *, force: bool = False) -> None:
        step = int(state.step)
        if self.save_due(step, force):
            self.ckpt.save(step, state_tree(state), extra=extra, force=True)
            self._saved_step = step

    def after_step(self, step: int) -> None:
        """`fault_hooks`, then `stop_if_requested`: a stop the hooks request (`sigterm_at_step`)
        ends the run at this step if it was saved."""
        self.fault_hooks(step)
        self.stop_if_requested(step)

    def fault_hooks(self, step: int) -> None:
        """The `JAXRL_FAULT` hooks of `step` (`jaxrl.infra.faults.after_step`)."""
        faults.after_step(step, wait_for_saves=self.ckpt.wait_until_finished)

    def stop_if_requested(self, step: int) -> None:
        """On a requested stop (SIGTERM, Ctrl-C) with `step` saved: waits for that checkpoint
        and raises `preemption.StopRequested`."""
        if preemption.requested() and self._saved_step == step:
            self.ckpt.wait_until_finished()
            preemption.stop(step, str(self.ckpt.directory))

    def close(self) -> None:
        try:
            if self.bar is not None:
                self.bar.close()
            self.ckpt.wait_until_finished()
            self.ckpt.close()
            self.metrics.close()
        finally:
            preemption.uninstall()


def host_rss_mb() -> float:
    """This process's resident memory in MB (Linux /proc; elsewhere the peak from getrusage)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def to_host(metrics: dict) -> dict[str, float]:
    return {k: float(np.asarray(v)) for k, v in jax.device_get(metrics).items()}

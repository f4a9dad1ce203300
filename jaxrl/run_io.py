"""The plumbing every training loop shares: checkpoints of a `TrainState`, metrics, progress, and
the fault-injection hooks, so the loops themselves read as the algorithm."""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from typing import Any

import jax
import numpy as np

from jaxrl import workdir as run_dir
from jaxrl.infra import faults, preemption
from jaxrl.infra.checkpoint import CheckpointConfig, Checkpointer
from jaxrl.infra.metrics import MetricsWriter, progress_bar
from jaxrl.trainer import TrainState

logger = logging.getLogger(__name__)


class NonFiniteLossError(FloatingPointError):
    """The loss or the gradient norm became NaN / Inf."""


def state_tree(state: TrainState) -> dict:
    """The checkpointed form of a TrainState (a dict, so `params` can be restored alone)."""
    return {"step": state.step, "params": state.params, "opt_state": state.opt_state}


def tree_to_state(tree: dict) -> TrainState:
    return TrainState(step=tree["step"], params=tree["params"], opt_state=tree["opt_state"])


class RunIO:
    """Checkpoints under WORKDIR/checkpoints, metrics in WORKDIR/metrics.jsonl + TensorBoard, a
    progress bar on a terminal (a log line every `log_every_steps` otherwise).

    `save_final=False` turns off the checkpoint the loops force at their last step (`save(...,
    force=True)`): a script that times steps, or keeps only scheduled checkpoints, sets it.
    """

    def __init__(
        self,
        workdir: str,
        *,
        total_steps: int,
        save_every_steps: int,
        keep_last_n: int,
        desc: str,
        log_every_steps: int = 50,
        save_final: bool = True,
    ):
        self.workdir, self.total_steps, self.desc = workdir, total_steps, desc
        self.save_final = save_final
        self.log_every_steps = log_every_steps
        self.ckpt = Checkpointer(
            run_dir.checkpoint_dir(workdir),
            CheckpointConfig(save_every_steps=save_every_steps, keep_last_n=keep_last_n),
        )
        self.metrics = MetricsWriter(workdir)
        self.bar = None
        self._start = time.perf_counter()
        self._start_step = 0
        self._saved_step: int | None = None
        preemption.install()

    def restore(self, abstract_state: TrainState) -> tuple[TrainState, dict] | None:
        """The newest finished checkpoint of this run, or None.

        Either way the metrics the interrupted run logged after that checkpoint (all of them
        when there is none) are dropped first: those steps run again, and each step keeps one
        line in metrics.jsonl and one TensorBoard point (issue 25: a resumed run appended its
        redone steps a second time).
        """
        if self.ckpt.latest_step() is None:
            self.metrics.discard_after(-1)
            return None
        restored = self.ckpt.restore(abstract_target=state_tree(abstract_state))
        self.metrics.discard_after(int(restored.step))
        if self.metrics.is_writer:
            print(f"[{self.desc}] resuming {self.workdir} from step {restored.step}", flush=True)
        return tree_to_state(restored.state), restored.extra

    def finished(self) -> bool:
        return self.ckpt.latest_step() == self.total_steps

    def start(self, step: int) -> None:
        self.bar = progress_bar(self.total_steps, initial_step=step, desc=self.desc)
        self._start = time.perf_counter()
        self._start_step = step

    def histogram(self, step: int, name: str, values: Any) -> None:
        """A metric's distribution at `step` (TensorBoard only; `StepReport`'s optional hook)."""
        self.metrics.write_histogram(step, name, values)

    def log(self, step: int, metrics: dict[str, Any], headline: dict[str, str]) -> dict:
        """Writes `metrics` for `step`; raises NonFiniteLossError naming the step if the loss or
        gradient is NaN / Inf (the last good checkpoint is named too)."""
        written = self.metrics.write(step, {**metrics, "host/rss_mb": host_rss_mb()})
        for name in ("loss", "grad_norm"):
            value = written.get(name)
            if value is not None and not math.isfinite(value):
                try:  # the previous step's save may still be in flight: it is the last good one
                    self.ckpt.wait_until_finished()
                except Exception:  # a failed save is no good checkpoint; report the loss anyway
                    logger.exception("the checkpoint save before step %d failed", step)
                raise NonFiniteLossError(
                    f"[{self.desc}] {name} is {value} at step {step}; the last good checkpoint "
                    f"is step {self.ckpt.latest_step()} in {self.ckpt.directory}. Lower the "
                    "learning rate or check the data / rewards."
                )
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(headline, refresh=False)
            if (
                self.metrics.is_writer
                and not sys.stderr.isatty()
                and (step % self.log_every_steps == 0 or step == self.total_steps)
            ):
                elapsed = time.perf_counter() - self._start
                text = " ".join(f"{k}={v}" for k, v in headline.items())
                print(
                    f"[{self.desc}] step {step}/{self.total_steps} {text} "
                    f"({elapsed:.0f}s{self._pace(step, elapsed)})",
                    flush=True,
                )
        return written

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

    def save(self, state: TrainState, extra: dict, *, force: bool = False) -> None:
        step = int(state.step)
        if self.save_due(step, force):
            self.ckpt.save(step, state_tree(state), extra=extra, force=True)
            self._saved_step = step

    def after_step(self, step: int) -> None:
        """Fault hooks; on a requested stop (SIGTERM), waits for this step's checkpoint and
        raises `preemption.StopRequested`."""
        faults.after_step(step, wait_for_saves=self.ckpt.wait_until_finished)
        if preemption.requested() and self._saved_step == step:
            self.ckpt.wait_until_finished()
            preemption.stop(step, self.ckpt.directory)

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

"""Run metrics: `WORKDIR/metrics.jsonl` + TensorBoard events, and a progress bar.

Every process may call the writer; only process 0 writes (the others hold no files), so the
training loop needs no `if process_index == 0`. One JSON object per line:
`{"step": 120, "wall_time_s": 1718000000.5, "reward/mean": 0.31, "loss/aipo": 1.2}`.
Keys are flat and namespaced with "/" (nested dicts are flattened that way), values are plain
Python numbers (JAX / NumPy scalars are fetched and converted). Non-finite floats are written as
Python's json writes them (NaN, Infinity), which `json.loads` and pandas read back. The file is
appended to, so a resumed run continues it; a run that resumes from step s first calls
`discard_after(s)`, which drops what the interrupted run logged after its checkpoint (from the
JSON lines and the TensorBoard events alike), so each step has one line and one point.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

METRICS_FILE = "metrics.jsonl"
_TAG_CHARS = re.compile(r"[-/\w.]+")  # what tensorboardX keeps of a tag
TENSORBOARD_DIR = "tensorboard"

Scalar = int | float | bool


def flatten_metrics(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"reward": {"mean": x}} -> {"reward/mean": x}; flat keys pass through unchanged."""
    flat: dict[str, Any] = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten_metrics(value, f"{name}/"))
        else:
            flat[name] = value
    return flat


def to_scalar(value: Any, name: str = "metric") -> Scalar:
    """A JAX / NumPy / Python scalar (or size-1 array) as a Python bool, int or float."""
    if isinstance(value, bool | int | float):
        return value
    array = np.asarray(jax.device_get(value))
    if array.size != 1:
        raise ValueError(
            f"metric {name!r} has shape {array.shape}; write scalars (reduce it, or log a "
            "histogram with write_histogram)."
        )
    item = array.reshape(()).item()
    if not isinstance(item, bool | int | float):
        raise TypeError(f"metric {name!r} is a {type(item).__name__}, not a number.")
    return item


class MetricsWriter:
    """Appends scalar metrics to `workdir/metrics.jsonl` and TensorBoard (process 0 only).

    Example:
      with MetricsWriter(workdir) as writer:
          writer.write(step, {"reward/mean": reward_mean, "loss": {"aipo": loss}})
    """

    def __init__(
        self, workdir: str | Path, *, tensorboard: bool = True, flush_every_writes: int = 1
    ):
        self.workdir = Path(workdir)
        self.is_writer = jax.process_index() == 0
        self.flush_every_writes = flush_every_writes
        self.tensorboard = tensorboard
        self._writes_since_flush = 0
        self._jsonl = None
        self._tb = None
        if not self.is_writer:
            return
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.workdir / METRICS_FILE, "a", encoding="utf-8")
        if tensorboard:
            # tensorboardX names the file by the whole second and opens it "wb": without a
            # suffix of its own, a run relaunched within that second would truncate the last
            # launch's events. The process id and a nanosecond clock tell launches apart.
            self._tb = _file_writer()(
                logdir=str(self.workdir / TENSORBOARD_DIR),
                filename_suffix=f".{os.getpid()}.{time.monotonic_ns()}",
            )
            self._tb_flushed = time.monotonic()

    @property
    def jsonl_path(self) -> Path:
        return self.workdir / METRICS_FILE

    def write(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Scalar]:
        """Writes one line for `step`; returns the converted flat metrics (on every process)."""
        flat = {k: to_scalar(v, k) for k, v in flatten_metrics(metrics).items()}
        if "step" in flat or "wall_time_s" in flat:
            raise ValueError("metric names 'step' and 'wall_time_s' are reserved.")
        for name in flat if self.tensorboard else ():  # checked on every process alike
            if _TAG_CHARS.fullmatch(name) is None:  # TensorBoard would rename it
                raise ValueError(
                    f"metric name {name!r}: use letters, digits and '_-/.' only (TensorBoard "
                    "would show another name than metrics.jsonl)"
                )
        if not self.is_writer:
            return flat
        record = {"step": int(step), "wall_time_s": round(time.time(), 3), **flat}
        self._jsonl.write(json.dumps(record) + "\n")
        if self._tb is not None:  # one event a step: per-scalar events cost ~3 ms a step
            from tensorboardX.proto.summary_pb2 import Summary

            values = [Summary.Value(tag=k, simple_value=float(v)) for k, v in flat.items()]
            self._tb.add_summary(Summary(value=values), global_step=int(step))
        self._writes_since_flush += 1
        if self._writes_since_flush >= self.flush_every_writes:
            self.flush()
        return flat

    def discard_after(self, step: int) -> int:
        """Drops every record of a step > `step` (the JSON lines and the TensorBoard events), and
        returns how many JSON lines went.

        A run resumed from the checkpoint of step s calls it with s (a fresh start with -1): the
        steps the interrupted run logged after that checkpoint are trained again, and appending
        their new records next to the old ones would give two lines (and two TensorBoard points)
        per step. A file that changes is rewritten whole and renamed over the old one, so a
        reader never sees it half written. Call it before the first `write`.
        """
        if not self.is_writer:
            return 0
        kept, dropped = [], 0
        if self.jsonl_path.exists():
            with open(self.jsonl_path, encoding="utf-8") as f:
                for line in f:
                    if not line.strip():
                        continue
                    try:
                        keep = json.loads(line)["step"] <= step
                    except (json.JSONDecodeError, KeyError, TypeError):
                        keep = False  # half a line from a killed run
                    if keep:
                        kept.append(line.rstrip("\n") + "\n")
                    else:
                        dropped += 1
        if dropped:  # our append handle would keep writing to the replaced file: reopen it
            self._jsonl.close()
            _replace_file(self.jsonl_path, "".join(kept).encode())
            self._jsonl = open(self.jsonl_path, "a", encoding="utf-8")
        if self._tb is not None:
            # The file this writer just opened holds no summary yet, so it is left as it is;
            # the earlier launches' files are rewritten (they are closed).
            for path in sorted((self.workdir / TENSORBOARD_DIR).glob("events.out.tfevents.*")):
                _drop_events_after(path, step)
        return dropped

    def write_histogram(self, step: int, name: str, values: Any) -> None:
        """A histogram (e.g. staleness in policy versions) to TensorBoard only."""
        if self._tb is not None:
            from tensorboardX.summary import histogram

            values = np.asarray(jax.device_get(values))
            self._tb.add_summary(histogram(name, values, "auto"), global_step=int(step))

    def flush(self) -> None:
        self._writes_since_flush = 0
        if self._jsonl is not None:
            self._jsonl.flush()
        # TensorBoard's file at most every 2 s (a flush per step costs ~1 ms; the JSON lines,
        # which a resumed run reads, are flushed every time)
        if self._tb is not None and time.monotonic() - self._tb_flushed >= 2.0:
            self._tb.flush()
            self._tb_flushed = time.monotonic()

    def close(self) -> None:
        """Flushes and closes the files. Idempotent."""
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _file_writer():
    """tensorboardX's FileWriter, imported without importing torch.

    tensorboardX (2.6) does `try: import torch` at import time, only to accept torch tensors;
    where torch is installed that costs seconds and ~GBs of address space in every launch. Scalars
    never need it, so the import runs with torch marked unavailable (unless the user's process
    imported torch already). The import is slow itself (protobuf): only when a writer is made.
    """
    if "tensorboardX" in sys.modules or "torch" in sys.modules:
        from tensorboardX import FileWriter

        return FileWriter
    sys.modules["torch"] = None  # `import torch` raises ImportError, which tensorboardX expects
    try:
        from tensorboardX import FileWriter
    finally:
        del sys.modules["torch"]
    return FileWriter


def _replace_file(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def read_event_records(path: str | Path) -> list[bytes]:
    """The raw records of a TensorBoard event file (TFRecord framing: a little-endian uint64
    length, its masked CRC32C, the data, the data's masked CRC32C); a torn last record (a
    killed writer) is left out."""
    data, records, pos = Path(path).read_bytes(), [], 0
    while pos + 12 <= len(data):
        (length,) = struct.unpack("<Q", data[pos : pos + 8])
        end = pos + 12 + length + 4
        if end > len(data):
            break
        records.append(data[pos:end])
        pos = end
    return records


def event_of(record: bytes):
    """The `Event` protobuf inside one raw record of `read_event_records`."""
    from tensorboardX.proto import event_pb2

    event = event_pb2.Event()
    event.ParseFromString(record[12:-4])
    return event


def _drop_events_after(path: Path, step: int) -> None:
    """Rewrites an event file without its summaries of steps > `step` (the records are copied
    byte for byte, CRCs included; the file-version header has step 0 and stays)."""
    records = read_event_records(path)
    kept = [r for r in records if not event_of(r).HasField("summary") or event_of(r).step <= step]
    if len(kept) != len(records):
        _replace_file(path, b"".join(kept))


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl, last record per step kept (a resumed run rewrites some)."""
    by_step: dict[int, dict[str, Any]] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                record = json.loads(line)
                by_step[record["step"]] = record
    return [by_step[s] for s in sorted(by_step)]


class _NoProgress:
    """Stand-in for a disabled tqdm bar: same calls, no output."""

    def update(self, n: int = 1) -> None:
        del n

    def set_postfix(self, *args, **kwargs) -> None:
        del args, kwargs

    def close(self) -> None:
        pass

    def __enter__(self) -> _NoProgress:
        return self

    def __exit__(self, *exc_info) -> None:
        pass


def progress_bar(
    total_steps: int,
    *,
    initial_step: int = 0,
    desc: str = "train",
    enabled: bool | None = None,
) -> Any:
    """A tqdm bar on process 0; a no-op elsewhere.

    `enabled=None` shows it only when stderr is a terminal (no progress spam in log files);
    True / False force it on or off. Use `bar.update(1)` per step and `bar.set_postfix(...)`
    for a few headline numbers.
    """
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled or jax.process_index() != 0:
        return _NoProgress()
    from tqdm import tqdm

    return tqdm(total=total_steps, initial=initial_step, desc=desc, dynamic_ncols=True)


def non_finite_metrics(metrics: Mapping[str, Scalar]) -> list[str]:
    """Names of the metrics that are NaN or infinite (for fail-fast checks in the loop)."""
    return [k for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v)]

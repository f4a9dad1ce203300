"""safetensors reading and writing with NumPy (bfloat16 through `ml_dtypes`).

The `safetensors` package's NumPy backend cannot represent bfloat16, and its Flax backend puts
every tensor on the default device. Reading the (simple, documented) format directly lets a
loader read one tensor at a time (a positioned read into a fresh buffer, freed when the caller
drops it) and move it straight into its target sharding, so host memory never holds the whole
model. A memory map would look cheaper but keeps every page it touched resident until unmapped.

Format: 8-byte little-endian header length N, N bytes of JSON
`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`, then the
data buffer (offsets relative to its start), row-major, little-endian.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator, Mapping

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),  # read to be named: the loader refuses them
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
_NAMES = {v: k for k, v in _DTYPES.items()}
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_MAX_HEADER_BYTES = 100 * 1024 * 1024


class SafetensorsError(ValueError):
    """A safetensors file or index is malformed or inconsistent."""


def _read_header(path: str) -> tuple[dict, int]:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise SafetensorsError(f"{path}: too short to be a safetensors file")
        (n,) = struct.unpack("<Q", raw)
        if n > _MAX_HEADER_BYTES:
            raise SafetensorsError(f"{path}: header of {n} bytes; not a safetensors file?")
        try:
            header = json.loads(f.read(n))
        except json.JSONDecodeError as e:
            raise SafetensorsError(f"{path}: unreadable safetensors header ({e})") from None
    return header, 8 + n


class SafetensorsReader(Mapping):
    """Read-only mapping `tensor name -> np.ndarray` over a checkpoint directory.

    Each lookup reads that tensor from disk into a new array.

    Accepts a single `model.safetensors`, a sharded checkpoint with
    `model.safetensors.index.json`, or any set of `*.safetensors` files in the directory.
    """

    def __init__(self, directory: str):
        self.directory = directory
        index_path = os.path.join(directory, INDEX_FILE)
        if os.path.exists(index_path):
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
        if not files:
            raise SafetensorsError(f"no .safetensors files in {directory}")
        self._entries: dict[str, tuple[str, int, dict]] = {}
        for name in files:
            path = os.path.join(directory, name)
            if not os.path.exists(path):
                raise SafetensorsError(f"{index_path} names {name}, which does not exist")
            header, data_start = _read_header(path)
            header.pop("__metadata__", None)
            for tensor, info in header.items():
                self._entries[tensor] = (path, data_start, info)

    def __getitem__(self, name: str) -> np.ndarray:
        path, data_start, info = self._entries[name]
        if info["dtype"] not in _DTYPES:
            raise SafetensorsError(f"{name}: unsupported dtype {info['dtype']}")
        begin, end = info["data_offsets"]
        dtype = _DTYPES[info["dtype"]]
        shape = tuple(info["shape"])
        if end - begin != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
            raise SafetensorsError(f"{name}: data size does not match shape {shape}")
        out = np.empty(shape, dtype)
        with open(path, "rb") as f:
            f.seek(data_start + begin)
            if f.readinto(out.reshape(-1).view(np.uint8)) != end - begin:
                raise SafetensorsError(f"{path}: truncated data for tensor {name}")
        return out

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entries[name][2]["shape"])

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


def write_safetensors(
    path: str, tensors: Mapping[str, np.ndarray], metadata: dict[str, str] | None = None
) -> None:
    """Writes `tensors` to `path` (via a temporary file renamed into place)."""
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    arrays = {}
    for name in sorted(tensors):
        arr = np.ascontiguousarray(tensors[name])
        if arr.dtype not in _NAMES:
            raise SafetensorsError(f"{name}: dtype {arr.dtype} cannot be written to safetensors")
        header[name] = {
            "dtype": _NAMES[arr.dtype],
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + arr.nbytes],
        }
        offset += arr.nbytes
        arrays[name] = arr
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data buffer starts 8-byte aligned
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name in sorted(arrays):
            f.write(arrays[name].tobytes())
    os.replace(tmp, path)

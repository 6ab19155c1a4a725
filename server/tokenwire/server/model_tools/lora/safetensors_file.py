"""A bounded reader of the safetensors format: a length, a JSON header, then raw tensor bytes.

The header is checked whole before any tensor is read: its length against a bound and the
file, every entry's dtype, shape and byte range against each other and the data section, and no
two ranges overlapping. A file that fails is refused with one line naming the tensor and what is
wrong; a tensor is read only when asked for, as float32.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

MAX_HEADER_BYTES = 16 << 20
"""Largest header believed (16 MiB): an adapter's header lists a few thousand tensors at most."""

_DTYPES: dict[str, np.dtype[Any]] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),  # the top half of a float32
}


class SafetensorsError(ValueError):
    """The file is not a well-formed safetensors file; the message is one line."""


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    """Offset of the first byte in the file."""
    stop: int


class SafetensorsFile:
    """The checked header of one file; `read` loads a tensor from it."""

    def __init__(self, path: Path, *, max_header_bytes: int = MAX_HEADER_BYTES) -> None:
        self.path = path
        label = path.name
        try:
            size = path.stat().st_size
            with path.open("rb") as file:
                prefix = file.read(8)
                if len(prefix) < 8:
                    raise SafetensorsError(f"{label} is not a safetensors file: it has {size} bytes")
                length = int.from_bytes(prefix, "little")
                if length > max_header_bytes or length > size - 8:
                    raise SafetensorsError(
                        f"{label} is truncated or corrupt: its header claims {length} bytes "
                        f"(the file has {size}, the bound is {max_header_bytes})"
                    )
                raw = file.read(length)
        except OSError as error:
            raise SafetensorsError(f"cannot read {label}: {error.strerror or error}") from None
        try:
            header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
        except (UnicodeDecodeError, ValueError) as error:
            raise SafetensorsError(f"{label} has a header that is not JSON: {_one_line(error)}") from None
        if not isinstance(header, dict):
            raise SafetensorsError(f"{label} has a header that is not a JSON object")
        header.pop("__metadata__", None)
        data_start = 8 + length
        self.tensors = {name: _entry(label, name, value, data_start, size) for name, value in header.items()}
        spans = sorted((entry.start, entry.stop, entry.name) for entry in self.tensors.values())
        for (_, stop, name), (next_start, _, next_name) in itertools.pairwise(spans):
            if next_start < stop:
                raise SafetensorsError(f"{label} is corrupt: tensor {name} overlaps tensor {next_name}")

    def read(self, name: str) -> NDArray[np.float32]:
        """Tensor `name` as float32 in its own shape."""
        entry = self.tensors[name]
        dtype = _DTYPES[entry.dtype]
        count = math.prod(entry.shape)
        with self.path.open("rb") as file:
            file.seek(entry.start)
            raw = file.read(entry.stop - entry.start)
        if len(raw) != entry.stop - entry.start:
            raise SafetensorsError(f"{self.path.name} was truncated while tensor {name} was read")
        values = np.frombuffer(raw, dtype=dtype, count=count)
        if entry.dtype == "BF16":
            values = (values.astype(np.uint32) << 16).view(np.float32)
        return values.astype(np.float32).reshape(entry.shape)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"key {key[:80]!r} appears twice")
        result[key] = value
    return result


def _entry(label: str, name: str, value: object, data_start: int, size: int) -> TensorEntry:
    def corrupt(what: str) -> SafetensorsError:
        return SafetensorsError(f"{label} is corrupt: tensor {name[:120]} {what}")

    if not isinstance(value, dict):
        raise corrupt("has no header entry object")
    dtype, shape, offsets = value.get("dtype"), value.get("shape"), value.get("data_offsets")
    if dtype not in _DTYPES:
        raise SafetensorsError(
            f"{label}: tensor {name[:120]} has dtype {str(dtype)[:20]}, which is not supported "
            f"(supported: {', '.join(_DTYPES)})"
        )
    if not isinstance(shape, list) or not all(_is_count(n) for n in shape) or len(shape) > 8:
        raise corrupt(f"has shape {str(shape)[:80]}, not a list of sizes")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(n) for n in offsets):
        raise corrupt(f"has data_offsets {str(offsets)[:80]}, not [start, end]")
    start, stop = data_start + offsets[0], data_start + offsets[1]
    expected = math.prod(shape) * _DTYPES[str(dtype)].itemsize
    if stop - start != expected:
        raise corrupt(f"has {stop - start} bytes for shape {shape} of {dtype} ({expected} bytes)")
    if stop > size:
        raise SafetensorsError(
            f"{label} is truncated or corrupt: tensor {name[:120]} needs bytes {start}-{stop}, "
            f"but the file has {size} bytes"
        )
    return TensorEntry(name=name, dtype=str(dtype), shape=tuple(shape), start=start, stop=stop)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())[:200]

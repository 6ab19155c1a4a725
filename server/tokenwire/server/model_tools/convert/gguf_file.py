"""Open a GGUF file within bounds: its header is read and checked against the file before anything
is built from it.

A GGUF header is counts and lengths that size everything after them, and a downloaded file may
lie in any of them. The gguf package's reader trusts them: an array claiming 2^62 items is walked
item by item, each item a numpy object of its own; nested arrays recurse; a truncated file or a
lying tensor offset surfaces as a numpy error deep inside it. Here:

- the whole header (metadata and tensor descriptions) must lie within the first
  MAX_HEADER_BYTES of the file, and every count times its item size is checked against the
  header bytes left before anything is read;
- arrays of arrays are refused; numeric arrays are views of the memory map (np.frombuffer), and
  string arrays are decoded only when asked for, by a caller that has checked their count
  against the model first (gguf_source.py);
- every tensor's type, shape, byte range (within the file, overlapping no other) is checked
  before it becomes a memory-mapped view.

A bad file is refused with one message naming the key or tensor and what is wrong with it.
Memory: the memory map is the operating system's page cache, not the process's; what this module
allocates is the decoded scalars, at most MAX_METADATA_KEYS of them, and one view per tensor.
"""

from __future__ import annotations

import itertools
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape
from numpy.typing import NDArray

from tokenwire.server.model_tools.convert.errors import CorruptGgufError, UnsupportedModelError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
MAX_HEADER_BYTES = 32 << 20
"""Most bytes of metadata and tensor descriptions read (32 MiB). Real headers are far smaller:
1.7 MiB for a 49,152-token vocabulary with its merges, about 8 MiB for Gemma's 262,144 tokens."""
MAX_METADATA_KEYS = 65_536
"""Most metadata entries (real files have about 40)."""
MAX_TENSORS = 65_536
"""Most tensors (a 70B model has about 720)."""
MAX_DIMENSIONS = 4
"""GGML's own limit on a tensor's dimensions."""
DEFAULT_ALIGNMENT = 32

# Tensor types the converter reads: those it repacks for MatMulNBits (see quantized.py) and those
# it dequantizes to float with gguf.quants (the 2- and 3-bit K formats and the 4-bit IQ formats).
SUPPORTED_TENSOR_TYPES = (
    GGMLQuantizationType.F32,
    GGMLQuantizationType.F16,
    GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q5_0,
    GGMLQuantizationType.Q5_1,
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q2_K,
    GGMLQuantizationType.Q3_K,
    GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q5_K,
    GGMLQuantizationType.Q6_K,
    GGMLQuantizationType.IQ4_NL,
    GGMLQuantizationType.IQ4_XS,
)
SUPPORTED_TYPE_NAMES = ", ".join(t.name for t in SUPPORTED_TENSOR_TYPES)

# Scalar value types: struct format (little-endian) and numpy type of an array of them.
_SCALARS: dict[GGUFValueType, tuple[str, type[np.generic]]] = {
    GGUFValueType.UINT8: ("<B", np.uint8),
    GGUFValueType.INT8: ("<b", np.int8),
    GGUFValueType.UINT16: ("<H", np.uint16),
    GGUFValueType.INT16: ("<h", np.int16),
    GGUFValueType.UINT32: ("<I", np.uint32),
    GGUFValueType.INT32: ("<i", np.int32),
    GGUFValueType.FLOAT32: ("<f", np.float32),
    GGUFValueType.BOOL: ("<?", np.bool_),
    GGUFValueType.UINT64: ("<Q", np.uint64),
    GGUFValueType.INT64: ("<q", np.int64),
    GGUFValueType.FLOAT64: ("<d", np.float64),
}
_STRING_LENGTH_BYTES = 8


class GgufArray:
    """An array of the header, not yet decoded: its item type and count, checked against the file."""

    def __init__(self, key: str, item_type: GGUFValueType, count: int, start: int, buffer: mmap.mmap) -> None:
        self.key = key
        self.item_type = item_type
        self.count = count
        self._start = start
        self._buffer = buffer

    @property
    def holds_strings(self) -> bool:
        return self.item_type is GGUFValueType.STRING

    def numbers(self) -> NDArray[np.generic]:
        """The items, a read-only view of the file. Raises CorruptGgufError for a string array."""
        if self.holds_strings:
            raise CorruptGgufError(f"GGUF metadata {self.key} is an array of strings, not of numbers")
        dtype = np.dtype(_SCALARS[self.item_type][1]).newbyteorder("<")
        return np.frombuffer(self._buffer, dtype=dtype, count=self.count, offset=self._start)

    def strings(self) -> list[str]:
        """The items, decoded (their lengths were checked when the header was read)."""
        if not self.holds_strings:
            raise CorruptGgufError(
                f"GGUF metadata {self.key} is an array of {self.item_type.name.lower()}, not of strings"
            )
        buffer, position = self._buffer, self._start
        items: list[str] = []
        for index in range(self.count):
            (length,) = struct.unpack_from("<Q", buffer, position)
            position += _STRING_LENGTH_BYTES
            try:
                items.append(buffer[position : position + length].decode("utf-8"))
            except UnicodeDecodeError:
                raise CorruptGgufError(f"GGUF metadata {self.key}[{index}] is not valid UTF-8") from None
            position += length
        return items


GgufValue = int | float | bool | str | GgufArray


@dataclass(frozen=True)
class GgufTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    """GGUF's order: the fastest-varying dimension first."""
    data: NDArray[np.generic]
    """A read-only view of the file: float16 or float32 elements for those types, otherwise the
    raw blocks as bytes, in numpy's order (the reverse of `shape`)."""


@dataclass(frozen=True)
class GgufFile:
    path: Path
    fields: dict[str, GgufValue]
    tensors: list[GgufTensor]


class _Header:
    """A cursor over the header's bytes, refusing any read past its end."""

    def __init__(self, buffer: mmap.mmap, name: str, file_size: int) -> None:
        self.buffer = buffer
        self.position = 0
        self._name = name
        self._file_size = file_size
        self.end = min(file_size, MAX_HEADER_BYTES)

    def need(self, size: int, what: str) -> int:
        """Claim `size` bytes for `what`; their start. Raises CorruptGgufError past the header."""
        start = self.position
        if size > self.end - start:
            if self.end < self._file_size:
                raise CorruptGgufError(
                    f"{self._name}: {what} would run past the first {MAX_HEADER_BYTES >> 20} MiB, the "
                    "most of a GGUF header read here"
                )
            raise CorruptGgufError(
                f"{self._name} is truncated or corrupt: {what} needs {size} bytes at byte {start}, but "
                f"the file has {self._file_size} bytes"
            )
        self.position = start + size
        return start

    def scalar(self, kind: GGUFValueType, what: str) -> int | float | bool:
        fmt, _ = _SCALARS[kind]
        value: int | float | bool = struct.unpack_from(
            fmt, self.buffer, self.need(struct.calcsize(fmt), what)
        )[0]
        return value

    def u32(self, what: str) -> int:
        return int(self.scalar(GGUFValueType.UINT32, what))

    def u64(self, what: str) -> int:
        return int(self.scalar(GGUFValueType.UINT64, what))

    def string(self, what: str) -> str:
        length = self.u64(f"the length of {what}")
        start = self.need(length, what)
        try:
            return self.buffer[start : start + length].decode("utf-8")
        except UnicodeDecodeError:
            raise CorruptGgufError(f"{self._name} is corrupt: {what} is not valid UTF-8") from None

    def skip_strings(self, count: int, what: str) -> None:
        # Each string is at least its 8-byte length: a count the header cannot hold fails at once.
        self.check_room(count * _STRING_LENGTH_BYTES, f"{what} ({count} strings)")
        for index in range(count):
            self.need(self.u64(f"the length of {what}[{index}]"), f"{what}[{index}]")

    def check_room(self, size: int, what: str) -> None:
        """Raise CorruptGgufError unless `size` more bytes lie within the header."""
        start = self.position
        self.need(size, what)
        self.position = start


def open_gguf(path: Path) -> GgufFile:
    """The file's metadata and tensors, once its header and every tensor's byte range were checked."""
    try:
        file_size = path.stat().st_size
        with path.open("rb") as file:
            magic = file.read(len(GGUF_MAGIC))
            if magic != GGUF_MAGIC:
                raise CorruptGgufError(
                    f"{path.name} is not a GGUF file: it starts with {magic!r}, not {GGUF_MAGIC!r}"
                )
            buffer = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as error:
        raise CorruptGgufError(f"cannot read {path}: {error.strerror or error}") from None
    header = _Header(buffer, path.name, file_size)
    header.need(len(GGUF_MAGIC), "the magic")
    version = header.u32("the version")
    if version & 0xFFFF == 0 and version:
        raise UnsupportedModelError(f"{path.name} is a big-endian GGUF file, which is not supported")
    if version not in SUPPORTED_VERSIONS:
        raise UnsupportedModelError(
            f"{path.name} is GGUF version {version}, which is not supported (supported: 2, 3)"
        )
    tensor_count = header.u64("the tensor count")
    key_count = header.u64("the metadata count")
    if key_count > MAX_METADATA_KEYS:
        raise CorruptGgufError(
            f"{path.name}: the header claims {key_count} metadata entries, more than {MAX_METADATA_KEYS}"
        )
    if tensor_count > MAX_TENSORS:
        raise CorruptGgufError(
            f"{path.name}: the header claims {tensor_count} tensors, more than {MAX_TENSORS}"
        )
    fields = _read_fields(header, key_count, path.name)
    descriptions = [_read_tensor_description(header, index) for index in range(tensor_count)]
    alignment = fields.get("general.alignment", DEFAULT_ALIGNMENT)
    if (
        isinstance(alignment, bool)
        or not isinstance(alignment, int)
        or alignment <= 0
        or alignment & (alignment - 1)
    ):
        raise CorruptGgufError(f"GGUF metadata general.alignment is {alignment!r}, not a power of two")
    data_start = -(-header.position // alignment) * alignment
    tensors = _tensors(buffer, descriptions, data_start, file_size, path.name)
    return GgufFile(path, fields, tensors)


def _read_fields(header: _Header, count: int, name: str) -> dict[str, GgufValue]:
    fields: dict[str, GgufValue] = {}
    for index in range(count):
        key = header.string(f"metadata key {index}")
        if key in fields:
            raise CorruptGgufError(f"{name} is corrupt: GGUF metadata {key} appears twice")
        fields[key] = _read_value(header, key)
    return fields


def _value_type(header: _Header, what: str, key: str) -> GGUFValueType:
    raw = header.u32(what)
    try:
        return GGUFValueType(raw)
    except ValueError:
        raise CorruptGgufError(f"GGUF metadata {key} has unknown value type {raw}") from None


def _read_value(header: _Header, key: str) -> GgufValue:
    kind = _value_type(header, f"the type of {key}", key)
    if kind is GGUFValueType.STRING:
        return header.string(key)
    if kind is not GGUFValueType.ARRAY:
        return header.scalar(kind, key)
    item_type = _value_type(header, f"the item type of {key}", key)
    count = header.u64(f"the length of {key}")
    if item_type is GGUFValueType.ARRAY:
        raise UnsupportedModelError(f"GGUF metadata {key} is an array of arrays, which is not supported")
    start = header.position
    if item_type is GGUFValueType.STRING:
        header.skip_strings(count, key)
    else:
        fmt, _ = _SCALARS[item_type]
        header.need(count * struct.calcsize(fmt), f"{key} ({count} items)")
    return GgufArray(key, item_type, count, start, header.buffer)


@dataclass(frozen=True)
class _Description:
    name: str
    dims: tuple[int, ...]
    raw_type: int
    offset: int


def _read_tensor_description(header: _Header, index: int) -> _Description:
    name = header.string(f"the name of tensor {index}")
    n_dims = header.u32(f"the dimensions of tensor {name}")
    if not 1 <= n_dims <= MAX_DIMENSIONS:
        raise CorruptGgufError(f"tensor {name} has {n_dims} dimensions (GGUF allows 1 to {MAX_DIMENSIONS})")
    dims = tuple(header.u64(f"the shape of tensor {name}") for _ in range(n_dims))
    raw_type = header.u32(f"the type of tensor {name}")
    offset = header.u64(f"the offset of tensor {name}")
    return _Description(name, dims, raw_type, offset)


def _tensors(
    buffer: mmap.mmap, descriptions: list[_Description], data_start: int, file_size: int, file_name: str
) -> list[GgufTensor]:
    spans: list[tuple[int, int, str]] = []
    names: set[str] = set()
    for description in descriptions:
        if description.name in names:
            raise CorruptGgufError(f"{file_name} is corrupt: tensor {description.name} appears twice")
        names.add(description.name)
        spans.append(_span(description, data_start + description.offset, file_size, file_name))
    ordered = sorted(spans)
    for (start, end, name), (next_start, _, next_name) in itertools.pairwise(ordered):
        if next_start < end:
            raise CorruptGgufError(
                f"{file_name} is corrupt: tensor {name} (bytes {start}-{end}) overlaps "
                f"tensor {next_name} (from byte {next_start})"
            )
    return [
        _tensor(buffer, description, start, end)
        for description, (start, end, _) in zip(descriptions, spans, strict=True)
    ]


def _span(description: _Description, start: int, file_size: int, file_name: str) -> tuple[int, int, str]:
    name, raw_type = description.name, description.raw_type
    try:
        tensor_type = GGMLQuantizationType(raw_type)
    except ValueError:
        raise UnsupportedModelError(
            f"tensor {name} has unknown GGML type {raw_type} (supported: {SUPPORTED_TYPE_NAMES})"
        ) from None
    if tensor_type not in SUPPORTED_TENSOR_TYPES:
        raise UnsupportedModelError(
            f"tensor {name} has type {tensor_type.name}, which is not supported "
            f"(supported: {SUPPORTED_TYPE_NAMES})"
        )
    shape = list(description.dims)
    block_elems, block_bytes = GGML_QUANT_SIZES[tensor_type]
    if any(d <= 0 for d in shape) or shape[0] % block_elems:
        raise CorruptGgufError(
            f"{file_name} is corrupt: tensor {name} has shape {shape}, which is not whole "
            f"{block_elems}-weight blocks of {tensor_type.name}"
        )
    size = int(np.prod(shape, dtype=object)) // block_elems * block_bytes
    end = start + size
    if end > file_size:
        raise CorruptGgufError(
            f"{file_name} is truncated or corrupt: tensor {name} ({tensor_type.name}, shape "
            f"{shape}) needs bytes {start}-{end}, but the file has {file_size} bytes"
        )
    return (start, end, name)


def _tensor(buffer: mmap.mmap, description: _Description, start: int, end: int) -> GgufTensor:
    tensor_type = GGMLQuantizationType(description.raw_type)
    numpy_shape = tuple(reversed(description.dims))
    raw = np.frombuffer(buffer, dtype=np.uint8, count=end - start, offset=start)
    data: NDArray[np.generic]
    if tensor_type is GGMLQuantizationType.F32:
        data = raw.view(np.dtype("<f4")).reshape(numpy_shape)
    elif tensor_type is GGMLQuantizationType.F16:
        data = raw.view(np.dtype("<f2")).reshape(numpy_shape)
    else:
        data = raw.reshape(quant_shape_to_byte_shape(numpy_shape, tensor_type))
    return GgufTensor(description.name, tensor_type, description.dims, data)

"""Open a GGUF file and check its header against the file before any tensor is read.

The gguf package's reader trusts the header: a truncated file or a tensor whose offset or shape
lies surfaces as a numpy reshape error deep inside it, or as a short memory map read later. Here
every tensor's type, size and byte range is checked first, so such a file is refused with one
message naming the tensor and what is wrong with it.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, ReaderField

from tokenwire.server.model_tools.convert.errors import CorruptGgufError, UnsupportedModelError

GGUF_MAGIC = b"GGUF"

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


class _CheckedReader(GGUFReader):
    """GGUFReader that validates each tensor's header entry before building its array view."""

    def __init__(self, path: Path, file_size: int) -> None:
        self._file_size = file_size
        self._path_name = path.name
        super().__init__(path, "r")

    def _build_tensors(self, start_offs: int, fields: list[ReaderField]) -> None:
        # gguf's reader calls this once with every tensor-info entry and the start of the data
        # section; the entries are checked here, before they become memory-mapped views.
        spans: list[tuple[int, int, str]] = []
        for field in fields:
            _name_len, name_data, _n_dims, dims, raw_type, offset = field.parts
            name = bytes(name_data).decode("utf-8", errors="replace")
            spans.append(self._span(name, dims, int(raw_type[0]), start_offs + int(offset[0])))
        spans.sort()
        for (start, end, name), (next_start, _, next_name) in itertools.pairwise(spans):
            if next_start < end:
                raise CorruptGgufError(
                    f"{self._path_name} is corrupt: tensor {name} (bytes {start}-{end}) overlaps "
                    f"tensor {next_name} (from byte {next_start})"
                )
        super()._build_tensors(start_offs, fields)

    def _span(self, name: str, dims: np.ndarray, raw_type: int, start: int) -> tuple[int, int, str]:
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
        shape = [int(d) for d in dims]
        block_elems, block_bytes = GGML_QUANT_SIZES[tensor_type]
        if not shape or any(d <= 0 for d in shape) or shape[0] % block_elems:
            raise CorruptGgufError(
                f"{self._path_name} is corrupt: tensor {name} has shape {shape}, which is not whole "
                f"{block_elems}-weight blocks of {tensor_type.name}"
            )
        size = int(np.prod(shape, dtype=object)) // block_elems * block_bytes
        end = start + size
        if end > self._file_size:
            raise CorruptGgufError(
                f"{self._path_name} is truncated or corrupt: tensor {name} ({tensor_type.name}, shape "
                f"{shape}) needs bytes {start}-{end}, but the file has {self._file_size} bytes"
            )
        return (start, end, name)


def open_gguf(path: Path) -> GGUFReader:
    """The file's reader, once its magic, header and every tensor's byte range have been checked."""
    try:
        file_size = path.stat().st_size
        with path.open("rb") as file:
            magic = file.read(len(GGUF_MAGIC))
    except OSError as error:
        raise CorruptGgufError(f"cannot read {path}: {error.strerror or error}") from None
    if magic != GGUF_MAGIC:
        raise CorruptGgufError(
            f"{path.name} is not a GGUF file: it starts with {magic!r}, not {GGUF_MAGIC!r}"
        )
    try:
        return _CheckedReader(path, file_size)
    except (CorruptGgufError, UnsupportedModelError):
        raise
    except (ValueError, IndexError, KeyError, OverflowError, TypeError, UnicodeDecodeError) as error:
        # What gguf's reader raises when a length or count in the header runs past the file.
        raise CorruptGgufError(
            f"{path.name} is truncated or corrupt: its header cannot be read ({file_size} bytes; {error})"
        ) from None

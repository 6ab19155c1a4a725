"""Where a shared-buffer runner's KV cache lives, and how its rows are copied in, out and across.

The cache is one preallocated buffer [slots, kv_heads, max_len, head_dim] per KV tensor, bound to
the model by pointer (IO binding) either way. Two stores hold it (`--kv-cache-location`):

- `DeviceKvStore` (device): OrtValues from ONNX Runtime's allocator for the model's device, the
  CPU provider's memory under --device cpu, a GPU's under --device cuda. Every row move is run by
  ONNX Runtime on that device (kv_copy.py), so the CPU runs exactly the code a GPU runs.
- `HostKvStore` (host): NumPy arrays in host memory, moved by NumPy; only a CPU session can use
  them without copying the whole cache to the device and back every step.

Rows read out of a slot are always a host array [tensors, kv_heads, positions, head_dim]: the
host tier of prefix-cache blocks, swapped-out generations and kept prompts.

Used from the engine thread only.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import onnxruntime as ort

from tokenwire.server.models.kv_copy import KvCopyGraphs, KvGeometry
from tokenwire.server.models.kv_settings import KvCacheLocation
from tokenwire.server.models.runner import ModelRunnerError


class KvStore(Protocol):
    """A shared KV cache's memory and the copies of its rows."""

    @property
    def location(self) -> KvCacheLocation: ...

    @property
    def device(self) -> str:
        """The IO-binding device name of the buffers' memory ("cpu", "cuda")."""
        ...

    @property
    def device_id(self) -> int: ...

    @property
    def geometry(self) -> KvGeometry: ...

    @property
    def pointers(self) -> tuple[int, ...]:
        """Each tensor's buffer address, for binding."""
        ...

    @property
    def allocated_bytes(self) -> int:
        """Bytes allocated for the buffers."""
        ...

    def describe(self) -> str:
        """Where the buffers are, for the start-up log."""
        ...

    def read(self, slot: int, start: int, stop: int) -> np.ndarray:
        """Positions [start, stop) of a slot, copied into a new host array."""
        ...

    def write(self, slot: int, blocks: Sequence[np.ndarray]) -> int:
        """Host blocks, concatenated along positions, into a slot's first positions; their count."""
        ...

    def move(self, source: int, target: int, count: int) -> None:
        """A slot's first `count` positions into the same positions of another slot."""
        ...


def open_kv_store(
    geometry: KvGeometry,
    location: KvCacheLocation,
    session: ort.InferenceSession,
    *,
    device: str,
    device_id: int,
) -> KvStore:
    """Allocate the cache where `location` says, for a model running in `session` on `device`."""
    if location == "host":
        if device != "cpu":
            raise ValueError(
                f"--kv-cache-location host: the model runs on {device}, which would copy the whole "
                "KV cache to the device and back every step; use --kv-cache-location device"
            )
        return HostKvStore(geometry)
    return DeviceKvStore(geometry, session, device=device, device_id=device_id)


def rows_length(blocks: Sequence[np.ndarray]) -> int:
    return sum(int(block.shape[2]) for block in blocks)


class DeviceKvStore:
    """The cache in ONNX Runtime memory on the model's device; rows moved by ONNX Runtime there."""

    location: KvCacheLocation = "device"

    def __init__(
        self, geometry: KvGeometry, session: ort.InferenceSession, *, device: str, device_id: int
    ) -> None:
        self.geometry = geometry
        self.device = device
        self.device_id = device_id
        self._buffers = [
            ort.OrtValue.ortvalue_from_shape_and_type(list(geometry.shape), geometry.dtype, device, device_id)
            for _ in range(geometry.tensors)
        ]
        self.pointers = tuple(int(buffer.data_ptr()) for buffer in self._buffers)
        self.allocated_bytes = sum(int(buffer.tensor_size_in_bytes()) for buffer in self._buffers)
        self._copies = KvCopyGraphs(geometry, self._buffers, session)

    def describe(self) -> str:
        return f"ONNX Runtime memory on {self.device}"

    def read(self, slot: int, start: int, stop: int) -> np.ndarray:
        return self._copies.read(slot, start, stop)

    def write(self, slot: int, blocks: Sequence[np.ndarray]) -> int:
        # Several blocks are joined in host memory first (a host-side copy of host arrays), so
        # the device takes them in one transfer.
        rows = blocks[0] if len(blocks) == 1 else np.concatenate(blocks, axis=2)
        self._copies.write(slot, rows)
        return int(rows.shape[2])

    def move(self, source: int, target: int, count: int) -> None:
        self._copies.move(source, target, count)


class HostKvStore:
    """The cache in NumPy arrays in host memory; rows moved by NumPy. CPU sessions only."""

    location: KvCacheLocation = "host"
    device = "cpu"
    device_id = 0

    def __init__(self, geometry: KvGeometry) -> None:
        self.geometry = geometry
        self._arrays = [_lazy_zeros(geometry.shape, geometry.dtype) for _ in range(geometry.tensors)]
        self.pointers = tuple(int(array.ctypes.data) for array in self._arrays)
        self.allocated_bytes = sum(array.nbytes for array in self._arrays)

    def describe(self) -> str:
        return "host memory (NumPy)"

    def read(self, slot: int, start: int, stop: int) -> np.ndarray:
        return np.stack([array[slot, :, start:stop] for array in self._arrays])

    def write(self, slot: int, blocks: Sequence[np.ndarray]) -> int:
        length = rows_length(blocks)
        geometry = self.geometry
        for block in blocks:
            if block.ndim != 4 or block.shape[0] != geometry.tensors:
                raise ModelRunnerError(f"KV rows of shape {block.shape} do not fit this cache")
        for tensor, array in enumerate(self._arrays):
            # Straight from the blocks into the slot: one pass over the memory.
            np.concatenate([block[tensor] for block in blocks], axis=1, out=array[slot, :, :length])
        return length

    def move(self, source: int, target: int, count: int) -> None:
        for array in self._arrays:
            array[target, :, :count] = array[source, :, :count]


def _lazy_zeros(shape: tuple[int, ...], dtype: np.dtype[np.floating]) -> np.ndarray:
    """A zeroed array whose memory is only taken as it is written.

    Anonymous mappings start as the kernel's shared zero page, so a cache sized for many slots
    costs resident memory only for the positions sequences actually fill. (np.zeros gives the
    same only from the main thread's malloc arena; models load in a worker thread.)
    """
    count = int(np.prod(shape))
    size = count * dtype.itemsize
    return np.frombuffer(mmap.mmap(-1, max(size, 1)), dtype=dtype, count=count).reshape(shape)

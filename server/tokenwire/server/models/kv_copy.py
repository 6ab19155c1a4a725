"""Row moves inside a KV cache held in ONNX Runtime memory, done by ONNX Runtime on its device.

The cache is one buffer [slots, kv_heads, max_len, head_dim] per KV tensor, and a slot's first
positions are not contiguous (each head's run of positions is). ONNX Runtime 1.32's tensor-copy
API (`onnxruntime.copy_tensors`) cannot do these moves: it copies whole OrtValues of equal shape,
and only between devices whose data transfer a plugin execution provider registered with the
environment. The built-in CPU provider registers none (CPU to CPU fails with "Data transfer
implementation between source and destination device was not found"), and Python has no way to
make an OrtValue over part of another's memory except DLPack. So the moves are three tiny graphs,
run by sessions on the model's own execution provider (`companion_session`), each with the cache's
buffers bound once, for the whole life of the cache:

- read: a Slice of one slot's positions [start, stop) from each buffer, each tensor's output bound
  at its offset in one host array [tensors, kv_heads, n, head_dim], the rows' host copy;
- write: host rows [tensors, kv_heads, n, head_dim], each tensor's part bound at its offset,
  scattered (ScatterND) into a slot's first n positions;
- move: a slot's first n positions sliced from each buffer and scattered into another slot.

The writes bind each buffer as both the ScatterND's data input and its output. ScatterND copies
its data into its output only when the two are different memory (so do the CPU and the CUDA
kernels), so a write costs the rows written, never the buffer: the same sharing of one memory as
input and output that GroupQueryAttention's shared past and present rely on.

Used from the engine thread only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort
from onnx import NodeProto, TensorProto, ValueInfoProto, helper

from tokenwire.server.models.runner import ModelRunnerError
from tokenwire.server.models.session import companion_session, run_bound

_OPSET = 18
_ONNX_TYPES = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16}


@dataclass(frozen=True)
class KvGeometry:
    """The shape of a shared KV cache: `tensors` buffers of [slots, kv_heads, positions, head_dim]."""

    tensors: int
    slots: int
    kv_heads: int
    positions: int
    head_dim: int
    dtype: np.dtype[np.floating]

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.slots, self.kv_heads, self.positions, self.head_dim)

    @property
    def bytes_per_position(self) -> int:
        """Bytes one position of one sequence takes across every tensor."""
        return self.tensors * self.kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot in one tensor's buffer."""
        return self.kv_heads * self.positions * self.head_dim * self.dtype.itemsize

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_position * self.slots * self.positions

    def rows(self, count: int) -> np.ndarray:
        """An uninitialised host array for `count` positions of one sequence."""
        return np.empty((self.tensors, self.kv_heads, count, self.head_dim), dtype=self.dtype)


class KvCopyGraphs:
    """The read, write and move graphs over one cache's buffers, on the buffers' device."""

    def __init__(self, geometry: KvGeometry, buffers: Sequence[ort.OrtValue], beside: ort.InferenceSession):
        if len(buffers) != geometry.tensors:
            raise ValueError(f"{len(buffers)} buffers for {geometry.tensors} KV tensors")
        element = _ONNX_TYPES.get(geometry.dtype)
        if element is None:
            raise ValueError(f"no copy graph for KV cache type {geometry.dtype}")
        self._geometry = geometry
        builder = _Graphs(geometry, element)
        self._read = companion_session(builder.read(), beside)
        self._write = companion_session(builder.write(), beside)
        self._move = companion_session(builder.move(), beside)
        self._read_binding = self._read.io_binding()
        self._write_binding = self._write.io_binding()
        self._move_binding = self._move.io_binding()
        for tensor, buffer in enumerate(buffers):
            self._read_binding.bind_ortvalue_input(_buffer(tensor), buffer)
            for binding in (self._write_binding, self._move_binding):
                binding.bind_ortvalue_input(_buffer(tensor), buffer)
                binding.bind_ortvalue_output(_updated(tensor), buffer)
        # Where each position's values go in a ScatterND: (slot, head, position) triples for
        # every head and position of a slot; a copy takes the first n positions.
        heads = np.arange(geometry.kv_heads, dtype=np.int64)[:, np.newaxis]
        positions = np.arange(geometry.positions, dtype=np.int64)[np.newaxis, :]
        self._targets = np.zeros((1, geometry.kv_heads, geometry.positions, 3), dtype=np.int64)
        self._targets[0, :, :, 1] = heads
        self._targets[0, :, :, 2] = positions

    def read(self, slot: int, start: int, stop: int) -> np.ndarray:
        """Positions [start, stop) of `slot`, copied into a new host array."""
        geometry = self._geometry
        count = stop - start
        rows = geometry.rows(count)
        if count == 0:
            return rows
        binding = self._read_binding
        binding.bind_cpu_input("starts", np.array([slot, start], dtype=np.int64))
        binding.bind_cpu_input("ends", np.array([slot + 1, stop], dtype=np.int64))
        tensor_bytes = geometry.kv_heads * count * geometry.head_dim * geometry.dtype.itemsize
        shape = [1, geometry.kv_heads, count, geometry.head_dim]
        base = int(rows.ctypes.data)
        for tensor in range(geometry.tensors):
            binding.bind_output(_rows(tensor), "cpu", 0, geometry.dtype, shape, base + tensor * tensor_bytes)
        run_bound(self._read, binding)
        return rows

    def write(self, slot: int, rows: np.ndarray) -> None:
        """Host `rows` [tensors, kv_heads, n, head_dim] into positions [0, n) of `slot`."""
        geometry = self._geometry
        expected = (geometry.tensors, geometry.kv_heads, geometry.head_dim)
        if rows.ndim != 4 or (rows.shape[0], rows.shape[1], rows.shape[3]) != expected:
            raise ModelRunnerError(f"KV rows of shape {rows.shape} do not fit this cache")
        count = int(rows.shape[2])
        if count == 0:
            return
        rows = np.ascontiguousarray(rows, dtype=geometry.dtype)
        binding = self._write_binding
        tensor_bytes = geometry.kv_heads * count * geometry.head_dim * geometry.dtype.itemsize
        shape = [1, geometry.kv_heads, count, geometry.head_dim]
        base = int(rows.ctypes.data)
        for tensor in range(geometry.tensors):
            binding.bind_input(_rows(tensor), "cpu", 0, geometry.dtype, shape, base + tensor * tensor_bytes)
        binding.bind_cpu_input("indices", self._indices(slot, count))
        run_bound(self._write, binding)  # `rows` is referenced until here: the binding holds pointers

    def move(self, source: int, target: int, count: int) -> None:
        """Positions [0, count) of slot `source` into the same positions of slot `target`."""
        if count == 0:
            return
        binding = self._move_binding
        binding.bind_cpu_input("starts", np.array([source, 0], dtype=np.int64))
        binding.bind_cpu_input("ends", np.array([source + 1, count], dtype=np.int64))
        binding.bind_cpu_input("indices", self._indices(target, count))
        run_bound(self._move, binding)

    def _indices(self, slot: int, count: int) -> np.ndarray:
        indices = np.ascontiguousarray(self._targets[:, :, :count])
        indices[..., 0] = slot
        return indices


def _buffer(tensor: int) -> str:
    return f"kv{tensor}"


def _updated(tensor: int) -> str:
    return f"kv{tensor}_updated"


def _rows(tensor: int) -> str:
    return f"rows{tensor}"


class _Graphs:
    """The three graphs, serialized, for one geometry."""

    def __init__(self, geometry: KvGeometry, element: int) -> None:
        self._geometry = geometry
        self._element = element
        self._tensors = range(geometry.tensors)

    def read(self) -> bytes:
        nodes = [
            helper.make_node("Slice", [_buffer(t), "starts", "ends", "axes"], [_rows(t)])
            for t in self._tensors
        ]
        outputs = [self._rows_value(_rows(t)) for t in self._tensors]
        return self._model("kv_read", nodes, [*self._buffers(), *self._bounds()], outputs, [self._axes()])

    def write(self) -> bytes:
        nodes = [
            helper.make_node("ScatterND", [_buffer(t), "indices", _rows(t)], [_updated(t)])
            for t in self._tensors
        ]
        rows = [self._rows_value(_rows(t)) for t in self._tensors]
        inputs = [*self._buffers(), *rows, self._indices()]
        return self._model("kv_write", nodes, inputs, self._updated_buffers(), [])

    def move(self) -> bytes:
        nodes = [
            node
            for t in self._tensors
            for node in (
                helper.make_node("Slice", [_buffer(t), "starts", "ends", "axes"], [f"piece{t}"]),
                helper.make_node("ScatterND", [_buffer(t), "indices", f"piece{t}"], [_updated(t)]),
            )
        ]
        inputs = [*self._buffers(), *self._bounds(), self._indices()]
        return self._model("kv_move", nodes, inputs, self._updated_buffers(), [self._axes()])

    # -- pieces ----------------------------------------------------------------------------------

    def _buffers(self) -> list[ValueInfoProto]:
        shape = list(self._geometry.shape)
        return [helper.make_tensor_value_info(_buffer(t), self._element, shape) for t in self._tensors]

    def _updated_buffers(self) -> list[ValueInfoProto]:
        shape = list(self._geometry.shape)
        return [helper.make_tensor_value_info(_updated(t), self._element, shape) for t in self._tensors]

    def _rows_value(self, name: str) -> ValueInfoProto:
        geometry = self._geometry
        return helper.make_tensor_value_info(
            name, self._element, [1, geometry.kv_heads, "positions", geometry.head_dim]
        )

    def _bounds(self) -> list[ValueInfoProto]:
        # Slice's starts and ends: [slot, first position] and [slot + 1, end position].
        return [helper.make_tensor_value_info(name, TensorProto.INT64, [2]) for name in ("starts", "ends")]

    def _indices(self) -> ValueInfoProto:
        return helper.make_tensor_value_info(
            "indices", TensorProto.INT64, [1, self._geometry.kv_heads, "positions", 3]
        )

    @staticmethod
    def _axes() -> TensorProto:
        return helper.make_tensor("axes", TensorProto.INT64, [2], [0, 2])

    @staticmethod
    def _model(
        name: str,
        nodes: Sequence[NodeProto],
        inputs: Sequence[ValueInfoProto],
        outputs: Sequence[ValueInfoProto],
        init: Sequence[TensorProto],
    ) -> bytes:
        graph = helper.make_graph(nodes, name, inputs, outputs, initializer=init)
        model = helper.make_model(
            graph, opset_imports=[helper.make_opsetid("", _OPSET)], producer_name="tokenwire"
        )
        model.ir_version = 8  # what opset 18 needs, and old enough for any ONNX Runtime that has it
        serialized: bytes = model.SerializeToString()
        return serialized

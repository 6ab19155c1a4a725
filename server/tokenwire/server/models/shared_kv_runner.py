"""Runner for the ONNX Runtime GenAI layout: GroupQueryAttention over a shared KV buffer.

Each KV tensor is one preallocated buffer [slots, kv_heads, max_len, head_dim], bound as both
`past_key_values.N` and `present.N` so the operator writes new positions in place. Every
sequence owns a slot and keeps its cache at positions [0, length) of it (right padding inside
the slot); its attention-mask row sums to its cached length, which is how the operator finds
where to write and what to read. Decoded that way every row is bit-identical to the same
sequence decoded alone.

A prompt cannot share a model call with decode rows, so prefill runs as its own batch-1 call
bound straight onto the sequence's slot. Decode runs over the slot prefix [0, n): slots are
handed out lowest first and the highest sequence moves down into a freed slot, so idle rows do
not cost compute.

The buffers and every copy of their rows belong to a KV store (kv_store.py): ONNX Runtime memory
on the model's device, moved by ONNX Runtime there, or NumPy memory on the host. A slot's first
positions can be copied out to the host (`read_kv`), from the host into a new sequence's slot
(`start_from_kv`), which is how a cached prompt prefix replaces a prefill, and from one slot
into another (`start_from_sequence`). The copies are exact: positions computed in prompt chunks
of two or more tokens are bit-identical whichever chunks they came in (a one-token chunk takes
another kernel path and differs in the last bits).

Several tokens can be appended to a decoding sequence for verifying drafts (`decode_runs`):
one-token rows share the batched decode call, and each longer run is a batch-1 call on its
slot, since GroupQueryAttention takes several new positions with a past only at batch size 1.
A run's positions take the several-row kernels, so they equal one-token decode to rounding,
not bitwise. `rollback` only shortens the slot's length, moving no row on any device: positions
past it are never read, and the next step writes over them.

A graph with LoRA sites also reads the adapter stacks (bound once per binding: loads rewrite
them in place) and `lora_index`, each row's adapter slot: every sequence keeps the slot its
last prefill or decode gave it, and rows of free slots ride along with none.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import onnxruntime as ort

from tokenwire.server.models.adapters import LORA_INDEX, NO_ADAPTER, AdapterStacks, RowAdapters
from tokenwire.server.models.hidden_states import HiddenStatePass
from tokenwire.server.models.kv_copy import KvGeometry
from tokenwire.server.models.kv_store import KvStore, rows_length
from tokenwire.server.models.runner import ModelInfo, ModelRunnerError
from tokenwire.server.models.session import FLOAT_TENSOR_TYPES, run_bound

_MASK_WIDTH_STEP = 64


@dataclass(frozen=True)
class SharedKvLayout:
    """The KV geometry and tensor names of a GenAI-layout decoder."""

    layers: int
    kv_heads: int
    head_dim: int
    kv_dtype: np.dtype[np.floating]
    past_names: tuple[str, ...]
    present_names: tuple[str, ...]
    logits_dtype: np.dtype[np.floating]

    @classmethod
    def from_session(cls, session: ort.InferenceSession, genai_config: dict[str, object]) -> SharedKvLayout:
        decoder = _section(_section(genai_config, "model"), "decoder")
        inputs_cfg = _section(decoder, "inputs")
        outputs_cfg = _section(decoder, "outputs")
        layers = int(str(decoder["num_hidden_layers"]))
        past_key = str(inputs_cfg.get("past_key_names", "past_key_values.%d.key"))
        past_value = str(inputs_cfg.get("past_value_names", "past_key_values.%d.value"))
        present_key = str(outputs_cfg.get("present_key_names", "present.%d.key"))
        present_value = str(outputs_cfg.get("present_value_names", "present.%d.value"))
        past = tuple(name % i for i in range(layers) for name in (past_key, past_value))
        present = tuple(name % i for i in range(layers) for name in (present_key, present_value))
        inputs = {i.name: i for i in session.get_inputs()}
        outputs = {o.name: o for o in session.get_outputs()}
        missing = [n for n in (*past, "input_ids", "attention_mask") if n not in inputs]
        missing += [n for n in (*present, "logits") if n not in outputs]
        if missing:
            raise ValueError(f"GenAI model is missing graph inputs/outputs: {', '.join(missing)}")
        first = inputs[past[0]]
        kv_dtype = FLOAT_TENSOR_TYPES.get(first.type)
        logits_dtype = FLOAT_TENSOR_TYPES.get(outputs["logits"].type)
        if kv_dtype is None or logits_dtype is None:
            raise ValueError(f"unsupported tensor types: KV {first.type}, logits {outputs['logits'].type}")
        kv_heads = int(str(decoder.get("num_key_value_heads", first.shape[1])))
        head_dim = int(str(decoder.get("head_size", first.shape[3])))
        return cls(layers, kv_heads, head_dim, kv_dtype, past, present, logits_dtype)

    def geometry(self, slots: int, max_len: int) -> KvGeometry:
        """The preallocated KV cache for `slots` sequences of up to `max_len` tokens."""
        return KvGeometry(len(self.past_names), slots, self.kv_heads, max_len, self.head_dim, self.kv_dtype)


def _section(config: dict[str, object], key: str) -> dict[str, object]:
    value = config.get(key, {})
    if not isinstance(value, dict):
        raise ValueError(f"genai_config.json: {key!r} must be an object")
    return value


class SharedKvRunner:
    """ModelRunner for GenAI-layout graphs with a slot per sequence in a shared KV buffer."""

    def __init__(
        self,
        session: ort.InferenceSession,
        info: ModelInfo,
        layout: SharedKvLayout,
        store: KvStore,
        *,
        hidden_output: str | None = None,
        adapters: AdapterStacks | None = None,
    ) -> None:
        """`store` holds the cache: its geometry gives the slots and each slot's positions.
        `hidden_output`: the graph output holding the head's input (models/hidden_states.py), for
        embeddings; None where the graph has none."""
        self._session = session
        self._row_adapters = RowAdapters(adapters, info.name)
        self._layout = layout
        self._hidden = HiddenStatePass.over(session, hidden_output, layout.past_names, layout, adapters)
        self._info = replace(info, embedding_size=self._hidden.size() if self._hidden else 0)
        self._kv = store
        self._slots = slots = store.geometry.slots
        self._max_len = max_len = store.geometry.positions
        self._slot_of: dict[int, int] = {}
        self._free: list[int] = list(range(slots))
        heapq.heapify(self._free)
        self._lengths = np.zeros(slots, dtype=np.int64)
        self._lora_index = np.zeros(slots, dtype=np.int64)
        vocab = info.vocab_size
        self._logits = np.zeros((slots, vocab), dtype=layout.logits_dtype)
        self._input_ids = np.zeros(slots, dtype=np.int64)
        self._mask = np.zeros(slots * (max_len + 1), dtype=np.int64)
        self._positions = np.arange(max_len + 1, dtype=np.int64)
        # One binding reused for every decode step; KV and logits are rebound only when the
        # number of rows changes (binding 60 KV tensors costs about as much as sampling).
        self._binding = session.io_binding()
        self._bound_rows = 0
        if adapters is not None:  # the decode binding's stacks, once: loads rewrite them in place
            adapters.bind(self._binding)

    @property
    def info(self) -> ModelInfo:
        return self._info

    @property
    def adapters(self) -> AdapterStacks | None:
        return self._row_adapters.stacks

    def capacity(self) -> int:
        return self._slots

    def hidden_states(self, inputs: Sequence[Sequence[int]]) -> list[np.ndarray]:
        # A stateless pass over its own empty cache: no slot is taken, none is touched.
        if self._hidden is None:
            raise ModelRunnerError(f"{self._info.name} serves no embeddings")
        return self._hidden.run(inputs)

    def prefill(
        self, seq_id: int, token_ids: Sequence[int], *, start: int, adapter: int = NO_ADAPTER
    ) -> np.ndarray:
        if start == 0:
            self._new_slot(seq_id)
        slot = self._slot_of.get(seq_id)
        if slot is None or int(self._lengths[slot]) != start:
            raise ModelRunnerError(f"sequence {seq_id} continues a prefill out of order")
        total = start + len(token_ids)
        if total > self._max_len:
            raise ModelRunnerError(f"sequence needs {total} positions; the KV cache holds {self._max_len}")
        self._row_adapters.assign([seq_id], [adapter])
        logits: np.ndarray = self._run_alone(slot, token_ids, last_only=True)[0]
        return logits

    @property
    def can_decode_runs(self) -> bool:
        return True

    def decode_runs(
        self,
        seq_ids: Sequence[int],
        runs: Sequence[Sequence[int]],
    ) -> list[np.ndarray]:
        if len(seq_ids) != len(runs):
            raise ModelRunnerError(f"{len(seq_ids)} sequences but {len(runs)} runs of tokens")
        for seq_id, run in zip(seq_ids, runs, strict=True):
            slot = self._slot_of.get(seq_id)
            if slot is None:
                raise ModelRunnerError(f"sequence {seq_id} is not decoding")
            if not run:
                raise ModelRunnerError(f"sequence {seq_id} was given no tokens to append")
            if int(self._lengths[slot]) + len(run) > self._max_len:
                raise ModelRunnerError(f"sequence {seq_id} would run past the end of its KV-cache slot")
        out: list[np.ndarray | None] = [None] * len(seq_ids)
        # One-token rows share one batched decode call, where each row is bit-identical to
        # decoding it alone. GroupQueryAttention takes several new positions only at batch size
        # 1, so every longer run is its own call, bound straight onto its slot.
        singles = [i for i, run in enumerate(runs) if len(run) == 1]
        if singles:
            logits = self.decode([seq_ids[i] for i in singles], [runs[i][0] for i in singles])
            for row, i in enumerate(singles):
                out[i] = logits[row : row + 1].copy()
        for i, run in enumerate(runs):
            if len(run) > 1:
                out[i] = self._run_alone(self._slot_of[seq_ids[i]], run)
        return [logits for logits in out if logits is not None]

    def rollback(self, seq_id: int, count: int) -> None:
        slot = self._slot_of.get(seq_id)
        if slot is None or not 0 <= count <= int(self._lengths[slot]):
            raise ModelRunnerError(f"sequence {seq_id} cannot drop {count} positions")
        # Positions past a slot's length are never read (the mask row sums to the length), and
        # the next step writes over them.
        self._lengths[slot] -= count

    def decode(
        self, seq_ids: Sequence[int], token_ids: Sequence[int], *, adapters: Sequence[int] | None = None
    ) -> np.ndarray:
        self._row_adapters.assign(seq_ids, adapters)
        self._compact()
        slots = np.fromiter((self._slot_of[s] for s in seq_ids), dtype=np.int64, count=len(seq_ids))
        rows = int(self._occupied_end())
        if np.any(self._lengths[slots] >= self._max_len):
            raise ModelRunnerError("a sequence reached the end of its KV-cache slot")
        # Rows of slots that are free or mid-prefill ride along with a dummy token; their mask
        # covers their own cached length plus one, so the write lands past anything they keep.
        ids = self._input_ids[:rows]
        ids[:] = 0
        ids[slots] = np.asarray(token_ids, dtype=np.int64)
        sums = self._lengths[:rows] + 1
        # Any mask width from the longest row to the cache length gives the same logits; rounding
        # it up keeps the input's shape the same for many steps, which ONNX Runtime runs a little
        # faster than a shape that changes every step.
        width = min(-(-int(sums.max()) // _MASK_WIDTH_STEP) * _MASK_WIDTH_STEP, self._max_len)
        mask = self._mask[: rows * width].reshape(rows, width)
        np.less(self._positions[:width], sums[:, np.newaxis], out=mask, casting="unsafe")
        binding = self._binding
        if rows != self._bound_rows:
            binding.bind_input("input_ids", "cpu", 0, np.int64, [rows, 1], ids.ctypes.data)
            binding.bind_output(
                "logits",
                "cpu",
                0,
                self._logits.dtype,
                [rows, 1, self._logits.shape[1]],
                self._logits.ctypes.data,
            )
            self._bind_kv(binding, first_slot=0, rows=rows)
            self._bound_rows = rows
        binding.bind_input("attention_mask", "cpu", 0, np.int64, [rows, width], mask.ctypes.data)
        if self._row_adapters.stacks is not None:
            index = self._lora_index[:rows]
            index[:] = NO_ADAPTER
            index[slots] = [self._row_adapters.of(s) for s in seq_ids]
            binding.bind_input(LORA_INDEX, "cpu", 0, np.int64, [rows], index.ctypes.data)
        run_bound(self._session, binding)
        self._lengths[slots] += 1
        if self._logits.dtype == np.float32 and np.array_equal(slots, self._positions[: len(slots)]):
            # Rows already in slot order: hand out the bound buffer itself, no copy (the caller
            # consumes it before the next step overwrites it).
            return self._logits[: len(slots)]
        return np.asarray(self._logits[slots], dtype=np.float32)

    @property
    def kv_store(self) -> KvStore:
        return self._kv

    def kv_bytes_per_token(self) -> int:
        return self._kv.geometry.bytes_per_position

    def read_kv(self, seq_id: int, start: int, stop: int) -> np.ndarray:
        slot = self._slot_of.get(seq_id)
        if slot is None or not 0 <= start <= stop <= int(self._lengths[slot]):
            raise ModelRunnerError(f"sequence {seq_id} has no KV rows [{start}, {stop})")
        return self._kv.read(slot, start, stop)

    def start_from_kv(self, seq_id: int, blocks: Sequence[np.ndarray]) -> int:
        length = rows_length(blocks)
        if not blocks or length > self._max_len:
            raise ModelRunnerError(f"cannot load {length} KV rows into a slot")
        slot = self._new_slot(seq_id)
        try:
            self._kv.write(slot, blocks)
        except Exception:
            self.release(seq_id)
            raise
        self._lengths[slot] = length
        return length

    def start_from_sequence(self, seq_id: int, source_id: int, positions: int) -> int:
        source = self._slot_of.get(source_id)
        if source is None or source_id == seq_id or not 0 < positions <= int(self._lengths[source]):
            raise ModelRunnerError(f"sequence {source_id} has no {positions} KV rows to copy")
        slot = self._new_slot(seq_id)
        try:
            self._kv.move(source, slot, positions)
        except Exception:
            self.release(seq_id)
            raise
        self._lengths[slot] = positions
        return positions

    def release(self, seq_id: int) -> None:
        self._row_adapters.forget(seq_id)
        slot = self._slot_of.pop(seq_id, None)
        if slot is None:
            return
        self._lengths[slot] = 0
        heapq.heappush(self._free, slot)

    # -- internals -------------------------------------------------------------------------------

    def assign_adapters(self, seq_ids: Sequence[int], adapters: Sequence[int]) -> None:
        self._row_adapters.assign(seq_ids, adapters)

    def _new_slot(self, seq_id: int) -> int:
        """A free slot for a sequence starting afresh (any slot it held is freed first)."""
        self.release(seq_id)
        if not self._free:
            raise ModelRunnerError("no free KV-cache slot")
        slot = heapq.heappop(self._free)
        self._slot_of[seq_id] = slot
        return slot

    def _run_alone(self, slot: int, token_ids: Sequence[int], *, last_only: bool = False) -> np.ndarray:
        """Append `token_ids` to the sequence in `slot` in a batch-1 call; the logits at every
        position (or at the last only), float32 [positions, vocab], in a new array."""
        count = len(token_ids)
        total = int(self._lengths[slot]) + count
        binding = self._session.io_binding()
        binding.bind_cpu_input("input_ids", np.asarray(token_ids, dtype=np.int64).reshape(1, count))
        binding.bind_cpu_input("attention_mask", np.ones((1, total), dtype=np.int64))
        binding.bind_output("logits", "cpu")
        self._bind_kv(binding, first_slot=slot, rows=1)
        owner = next((s for s, at in self._slot_of.items() if at == slot), -1)
        self._row_adapters.bind(binding, [owner])
        run_bound(self._session, binding)
        self._lengths[slot] = total
        logits = binding.get_outputs()[0].numpy()
        return np.array(logits[0, -1:] if last_only else logits[0], dtype=np.float32)

    def _occupied_end(self) -> int:
        return max(self._slot_of.values(), default=-1) + 1

    def _compact(self) -> None:
        """Move the highest occupied slot into the lowest free one while that shrinks the prefix."""
        while self._free and self._free[0] < self._occupied_end() - 1:
            seq_id, source = max(self._slot_of.items(), key=lambda item: item[1])
            target = self._free[0]
            self._kv.move(source, target, int(self._lengths[source]))
            heapq.heappop(self._free)
            heapq.heappush(self._free, source)
            self._slot_of[seq_id] = target
            self._lengths[target] = self._lengths[source]
            self._lengths[source] = 0

    def _bind_kv(self, binding: ort.IOBinding, *, first_slot: int, rows: int) -> None:
        kv = self._kv
        shape = [rows, *kv.geometry.shape[1:]]
        offset = first_slot * kv.geometry.slot_bytes
        dtype = kv.geometry.dtype
        for past, present, pointer in zip(
            self._layout.past_names, self._layout.present_names, kv.pointers, strict=True
        ):
            binding.bind_input(past, kv.device, kv.device_id, dtype, shape, pointer + offset)
            binding.bind_output(present, kv.device, kv.device_id, dtype, shape, pointer + offset)

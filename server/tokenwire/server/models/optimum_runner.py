"""Runner for the Hugging Face Optimum layout: a KV cache that the graph grows every step.

Every step the graph takes the whole past cache ([batch, heads, past, head_dim] per layer) and
returns it one position longer. Sequences of different lengths share a batch through left
padding: each row's attention mask zeroes its padding and `position_ids` count only its real
tokens, which keeps each row's logits equal (to float rounding) to decoding it alone.

Between steps the cache stays where the model produced it (on the GPU under CUDA) because the
outputs of one step are bound as the inputs of the next. Only a change of membership, a
sequence joining after its prefill or leaving, brings the cache to the host to be re-padded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from tokenwire.server.models.runner import ModelInfo, ModelRunnerError
from tokenwire.server.models.session import FLOAT_TENSOR_TYPES, run_bound


@dataclass(frozen=True)
class OptimumLayout:
    """Names and shapes read from an Optimum graph's inputs."""

    layers: int
    kv_heads: int
    head_dim: int
    kv_dtype: np.dtype[np.floating]
    has_position_ids: bool

    @classmethod
    def from_session(cls, session: ort.InferenceSession) -> OptimumLayout:
        inputs = {i.name: i for i in session.get_inputs()}
        layers = sum(1 for name in inputs if name.startswith("past_key_values.") and name.endswith(".key"))
        if layers == 0 or "input_ids" not in inputs or "attention_mask" not in inputs:
            raise ValueError(
                "not an Optimum decoder with KV cache: missing input_ids/attention_mask/past_key_values"
            )
        first = inputs["past_key_values.0.key"]
        _, kv_heads, _, head_dim = first.shape
        if not isinstance(kv_heads, int) or not isinstance(head_dim, int):
            raise ValueError("past_key_values must have static head and head_dim dimensions")
        kv_dtype = FLOAT_TENSOR_TYPES.get(first.type)
        if kv_dtype is None:
            raise ValueError(f"unsupported KV cache type {first.type}")
        return cls(layers, kv_heads, head_dim, kv_dtype, "position_ids" in inputs)

    def kv_names(self, prefix: str) -> list[str]:
        return [f"{prefix}.{i}.{kind}" for i in range(self.layers) for kind in ("key", "value")]


@dataclass
class _Prefilling:
    """A sequence whose prompt is being processed alone, before it joins the batch."""

    kv: list[ort.OrtValue]
    length: int


class OptimumRunner:
    """ModelRunner over an Optimum-layout session with a left-padded, growing batch cache."""

    def __init__(self, session: ort.InferenceSession, info: ModelInfo, device: str) -> None:
        self._session = session
        self._info = info
        self._device = device
        self._layout = OptimumLayout.from_session(session)
        self._past_names = self._layout.kv_names("past_key_values")
        self._present_names = self._layout.kv_names("present")
        self._prefilling: dict[int, _Prefilling] = {}
        # The decoding batch: row order, cache per layer ([rows, heads, width, head_dim]),
        # mask [rows, width] (0 = left padding) and each row's next position.
        self._rows: list[int] = []
        self._kv: list[ort.OrtValue] = []
        self._mask = np.zeros((0, 0), dtype=np.int64)
        self._positions = np.zeros(0, dtype=np.int64)

    @property
    def info(self) -> ModelInfo:
        return self._info

    def capacity(self) -> int:
        return self._info.max_batch_size

    # -- prefill ---------------------------------------------------------------------------------

    def prefill(self, seq_id: int, token_ids: Sequence[int], *, start: int) -> np.ndarray:
        state = self._prefilling.get(seq_id)
        if start == 0 or state is None:
            if start != 0:
                raise ModelRunnerError(f"sequence {seq_id} continues a prefill that never started")
            state = _Prefilling(kv=self._empty_kv(), length=0)
            self._prefilling[seq_id] = state
        elif state.length != start:
            raise ModelRunnerError(f"sequence {seq_id} continues a prefill out of order")
        n_new = len(token_ids)
        total = state.length + n_new
        feeds = {
            "input_ids": np.asarray(token_ids, dtype=np.int64).reshape(1, n_new),
            "attention_mask": np.ones((1, total), dtype=np.int64),
        }
        if self._layout.has_position_ids:
            feeds["position_ids"] = np.arange(state.length, total, dtype=np.int64).reshape(1, n_new)
        logits, kv = self._run(feeds, state.kv)
        state.kv = kv
        state.length = total
        return np.array(logits[0, -1], dtype=np.float32)

    # -- decode ----------------------------------------------------------------------------------

    def decode(self, seq_ids: Sequence[int], token_ids: Sequence[int]) -> np.ndarray:
        wanted = list(seq_ids)
        if set(wanted) != set(self._rows):
            self._regroup(wanted)
        row_of = {seq: row for row, seq in enumerate(self._rows)}
        order = np.fromiter((row_of[s] for s in wanted), dtype=np.int64, count=len(wanted))
        tokens = np.empty(len(self._rows), dtype=np.int64)
        tokens[order] = np.asarray(token_ids, dtype=np.int64)
        mask = np.concatenate([self._mask, np.ones((len(self._rows), 1), dtype=np.int64)], axis=1)
        feeds = {"input_ids": tokens.reshape(-1, 1), "attention_mask": mask}
        if self._layout.has_position_ids:
            feeds["position_ids"] = self._positions.reshape(-1, 1)
        logits, kv = self._run(feeds, self._kv)
        self._kv = kv
        self._mask = mask
        self._positions = self._positions + 1
        return np.ascontiguousarray(logits[order, -1], dtype=np.float32)

    # -- prefix reuse ----------------------------------------------------------------------------

    def kv_bytes_per_token(self) -> int:
        layout = self._layout
        return len(self._past_names) * layout.kv_heads * layout.head_dim * layout.kv_dtype.itemsize

    def read_kv(self, seq_id: int, start: int, stop: int) -> np.ndarray:
        # A prompt's rows are read while it is still prefilling, before it joins the padded batch.
        state = self._prefilling.get(seq_id)
        if state is None or not 0 <= start <= stop <= state.length:
            raise ModelRunnerError(f"sequence {seq_id} has no prompt KV rows [{start}, {stop})")
        return np.stack([value.numpy()[0, :, start:stop] for value in state.kv])

    def start_from_kv(self, seq_id: int, blocks: Sequence[np.ndarray]) -> int:
        self.release(seq_id)
        rows = np.concatenate(blocks, axis=2) if len(blocks) > 1 else blocks[0]
        kv = [
            ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(rows[tensor][np.newaxis]), self._device)
            for tensor in range(len(self._past_names))
        ]
        self._prefilling[seq_id] = _Prefilling(kv=kv, length=int(rows.shape[2]))
        return int(rows.shape[2])

    def release(self, seq_id: int) -> None:
        self._prefilling.pop(seq_id, None)
        if seq_id in self._rows:
            self._regroup([s for s in self._rows if s != seq_id])

    # -- internals -------------------------------------------------------------------------------

    def _empty_kv(self) -> list[ort.OrtValue]:
        layout = self._layout
        empty = np.zeros((1, layout.kv_heads, 0, layout.head_dim), dtype=layout.kv_dtype)
        return [ort.OrtValue.ortvalue_from_numpy(empty, self._device) for _ in self._past_names]

    def _run(
        self, feeds: dict[str, np.ndarray], past: list[ort.OrtValue]
    ) -> tuple[np.ndarray, list[ort.OrtValue]]:
        binding = self._session.io_binding()
        for name, value in feeds.items():
            binding.bind_cpu_input(name, value)
        for name, value in zip(self._past_names, past, strict=True):
            binding.bind_ortvalue_input(name, value)
        # Logits come back to the host for sampling; the cache stays on the model's device.
        binding.bind_output("logits", "cpu")
        for name in self._present_names:
            binding.bind_output(name, self._device)
        run_bound(self._session, binding)
        outputs = binding.get_outputs()
        return outputs[0].numpy(), list(outputs[1:])

    def _regroup(self, wanted: list[int]) -> None:
        """Rebuild the batch for a new membership: drop leavers, left-pad and append joiners."""
        unknown = [s for s in wanted if s not in self._rows and s not in self._prefilling]
        if unknown:
            raise ModelRunnerError(f"sequences {unknown} were never prefilled")
        keep = [row for row, seq in enumerate(self._rows) if seq in wanted]
        joiners = [s for s in wanted if s not in self._rows]
        kept_kv = [ov.numpy()[keep] for ov in self._kv] if self._rows else []
        kept_mask = self._mask[keep]
        kept_positions = self._positions[keep]
        width = max([kept_mask.shape[1]] + [self._prefilling[s].length for s in joiners])
        layout = self._layout
        rows = len(keep) + len(joiners)
        kv = [
            np.zeros((rows, layout.kv_heads, width, layout.head_dim), dtype=layout.kv_dtype)
            for _ in self._past_names
        ]
        mask = np.zeros((rows, width), dtype=np.int64)
        positions = np.zeros(rows, dtype=np.int64)
        old_width = kept_mask.shape[1]
        for layer, array in enumerate(kept_kv):
            kv[layer][: len(keep), :, width - old_width :] = array
        mask[: len(keep), width - old_width :] = kept_mask
        positions[: len(keep)] = kept_positions
        for offset, seq in enumerate(joiners):
            joined = self._prefilling.pop(seq)
            row = len(keep) + offset
            for layer, value in enumerate(joined.kv):
                kv[layer][row, :, width - joined.length :] = value.numpy()[0]
            mask[row, width - joined.length :] = 1
            positions[row] = joined.length
        # Columns that are padding in every row carry nothing: drop them.
        if rows:
            trim = int(np.argmax(mask.any(axis=0))) if mask.any() else width
            mask = mask[:, trim:]
            kv = [array[:, :, trim:] for array in kv]
        self._rows = [self._rows[row] for row in keep] + joiners
        self._kv = [ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(a), self._device) for a in kv]
        self._mask = mask
        self._positions = positions

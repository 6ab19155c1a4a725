"""Runs a GenAI-layout model the way the server does: one preallocated KV buffer per tensor.

Every sequence owns a slot [kv_heads, max_len, head_dim] of each buffer, bound as both past and
present, and keeps its cache at positions [0, length). Prefill runs as a batch-1 call bound to a
view of the slot; decode runs the slot prefix [0, n) with one new token per row, and each mask
row sums to that row's length after the step. With adapter stacks (a LoRA graph), each call
also binds them and every row's adapter slot.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
from numpy.typing import NDArray

from tokenwire.server.models.adapters import LORA_INDEX, NO_ADAPTER, AdapterStacks


class SharedBufferDriver:
    def __init__(
        self,
        model_dir: Path,
        *,
        slots: int,
        max_len: int,
        threads: int = 1,
        adapters: AdapterStacks | None = None,
    ) -> None:
        decoder = json.loads((model_dir / "genai_config.json").read_text())["model"]["decoder"]
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        self.session = ort.InferenceSession(
            str(model_dir / decoder["filename"]), options, providers=["CPUExecutionProvider"]
        )
        self.layers = int(decoder["num_hidden_layers"])
        kv_type = self.session.get_inputs()[2].type
        dtype = np.float16 if kv_type == "tensor(float16)" else np.float32
        shape = (slots, int(decoder["num_key_value_heads"]), max_len, int(decoder["head_size"]))
        self.buffers = {
            f"{kind}.{layer}": np.zeros(shape, dtype=dtype)
            for layer in range(self.layers)
            for kind in ("key", "value")
        }
        self.max_len = max_len
        self.lengths = [0] * slots
        self.adapters = adapters

    def _bind_cache(self, binding: ort.IOBinding, rows: slice) -> None:
        for layer in range(self.layers):
            for kind in ("key", "value"):
                view = ort.OrtValue.ortvalue_from_numpy(self.buffers[f"{kind}.{layer}"][rows])
                binding.bind_ortvalue_input(f"past_key_values.{layer}.{kind}", view)
                binding.bind_ortvalue_output(f"present.{layer}.{kind}", view)

    def _run(
        self, input_ids: NDArray[np.int64], mask: NDArray[np.int64], rows: slice, slots: list[int]
    ) -> NDArray[np.float32]:
        binding = self.session.io_binding()
        binding.bind_output("logits")  # first, so get_outputs()[0] is the logits
        binding.bind_cpu_input("input_ids", input_ids)
        binding.bind_cpu_input("attention_mask", mask)
        self._bind_cache(binding, rows)
        if self.adapters is not None:
            self.adapters.bind(binding)
            binding.bind_cpu_input(LORA_INDEX, np.asarray(slots, dtype=np.int64))
        self.session.run_with_iobinding(binding)
        logits: NDArray[np.float32] = binding.get_outputs()[0].numpy()
        return logits

    def prefill(self, slot: int, token_ids: list[int], *, adapter: int = NO_ADAPTER) -> NDArray[np.float32]:
        """Append `token_ids` to the slot's sequence (a whole prompt or a chunk); logits [n, vocab]."""
        total = self.lengths[slot] + len(token_ids)
        ids = np.asarray([token_ids], dtype=np.int64)
        mask = np.ones((1, total), dtype=np.int64)
        logits = self._run(ids, mask, slice(slot, slot + 1), [adapter])
        self.lengths[slot] = total
        return logits[0]

    def decode(
        self, tokens: list[int], *, mask_width: int | None = None, adapters: list[int] | None = None
    ) -> NDArray[np.float32]:
        """One token for each of slots 0..len(tokens)-1 (row i with adapter slot adapters[i]);
        logits [rows, vocab]."""
        rows = len(tokens)
        after = [self.lengths[r] + 1 for r in range(rows)]
        width = mask_width if mask_width is not None else max(after)
        mask = np.zeros((rows, width), dtype=np.int64)
        for row, length in enumerate(after):
            mask[row, :length] = 1
        ids = np.asarray(tokens, dtype=np.int64)[:, None]
        logits = self._run(ids, mask, slice(0, rows), adapters or [NO_ADAPTER] * rows)
        for row, length in enumerate(after):
            self.lengths[row] = length
        return logits[:, 0]

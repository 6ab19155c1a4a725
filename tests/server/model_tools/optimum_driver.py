"""Runs an Optimum-layout model as the server does: a left-padded batch whose cache grows a step.

Prompts are prefilled together, left-padded to the longest (position ids count each row's own
tokens); each decode step appends one token per row and feeds the returned cache back. With
adapter stacks (a LoRA graph), every call binds them and each row's adapter slot.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
from numpy.typing import NDArray

from tokenwire.server.models.adapters import LORA_INDEX, AdapterStacks


class OptimumDriver:
    def __init__(self, model_dir: Path, *, adapters: AdapterStacks | None = None, threads: int = 1) -> None:
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        self.session = ort.InferenceSession(
            str(model_dir / "model.onnx"), options, providers=["CPUExecutionProvider"]
        )
        inputs = {i.name: i for i in self.session.get_inputs()}
        self.kv_names = [name for name in inputs if name.startswith("past_key_values.")]
        _, self.heads, _, self.head_dim = inputs[self.kv_names[0]].shape
        self.has_position_ids = "position_ids" in inputs
        self.adapters = adapters
        self.slots: list[int] = []
        self.kv: list[ort.OrtValue] = []
        self.mask = np.zeros((0, 0), dtype=np.int64)

    def _run(
        self, ids: NDArray[np.int64], mask: NDArray[np.int64], past: list[ort.OrtValue]
    ) -> NDArray[np.float32]:
        binding = self.session.io_binding()
        binding.bind_output("logits")
        binding.bind_cpu_input("input_ids", ids)
        binding.bind_cpu_input("attention_mask", mask)
        if self.has_position_ids:
            positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)[:, -ids.shape[1] :]
            binding.bind_cpu_input("position_ids", np.ascontiguousarray(positions))
        for name, value in zip(self.kv_names, past, strict=True):
            binding.bind_ortvalue_input(name, value)
            binding.bind_output(name.replace("past_key_values", "present"))
        if self.adapters is not None:
            self.adapters.bind(binding)
            binding.bind_cpu_input(LORA_INDEX, np.asarray(self.slots, dtype=np.int64))
        self.session.run_with_iobinding(binding)
        outputs = binding.get_outputs()
        self.kv = list(outputs[1:])
        self.mask = mask
        logits: NDArray[np.float32] = outputs[0].numpy()[:, -1]
        return logits

    def prefill(self, prompts: list[list[int]], slots: list[int]) -> NDArray[np.float32]:
        """All prompts as one batch (row i with adapter slot slots[i]); last logits [rows, vocab]."""
        width = max(len(p) for p in prompts)
        ids = np.zeros((len(prompts), width), dtype=np.int64)
        mask = np.zeros((len(prompts), width), dtype=np.int64)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = prompt
            mask[row, width - len(prompt) :] = 1
        self.slots = list(slots)
        empty = np.zeros((len(prompts), self.heads, 0, self.head_dim), dtype=np.float32)
        return self._run(ids, mask, [ort.OrtValue.ortvalue_from_numpy(empty) for _ in self.kv_names])

    def decode(self, tokens: list[int]) -> NDArray[np.float32]:
        mask = np.concatenate([self.mask, np.ones((len(tokens), 1), dtype=np.int64)], axis=1)
        return self._run(np.asarray(tokens, dtype=np.int64)[:, None], mask, self.kv)

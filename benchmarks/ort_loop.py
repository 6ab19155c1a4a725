"""The model's own limit in this interpreter: a minimal ONNX Runtime loop with no server around it.

One preallocated KV buffer per tensor, bound as both past and present (share-buffer IO binding,
GroupQueryAttention layout); a slot per sequence; prefill as its own batch-1 run written into the
slot; batched greedy decode over slots [0, B) with one reused binding per batch size. This is the
loop tokenwire's engine wraps, without scheduling, streaming or gRPC: the floor for its cost.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort


class RawLoop:
    def __init__(self, model_dir: Path, *, threads: int, slots: int, max_len: int) -> None:
        config = json.loads((model_dir / "genai_config.json").read_text())["model"]
        decoder = config["decoder"]
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        self.session = ort.InferenceSession(
            str(model_dir / decoder.get("filename", "model.onnx")),
            options,
            providers=["CPUExecutionProvider"],
        )
        layers = int(decoder["num_hidden_layers"])
        self.past = [f"past_key_values.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]
        self.present = [f"present.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]
        shape = (slots, int(decoder["num_key_value_heads"]), max_len, int(decoder["head_size"]))
        self.kv = [np.zeros(shape, dtype=np.float32) for _ in self.past]
        self.slot_bytes = int(np.prod(shape[1:])) * 4
        self.max_len = max_len
        self.vocab = int(config["vocab_size"])
        self.lengths = np.zeros(slots, dtype=np.int64)
        self.ids = np.zeros((slots, 1), dtype=np.int64)
        self.mask = np.zeros(slots * (max_len + 1), dtype=np.int64)
        self.positions = np.arange(max_len + 1, dtype=np.int64)
        self.logits = np.zeros((slots, 1, self.vocab), dtype=np.float32)
        self.bindings: dict[int, ort.IOBinding] = {}
        self.run_seconds = 0.0
        """Wall time spent inside run_with_iobinding, summed."""

    def _bind_kv(self, binding: ort.IOBinding, first_slot: int, rows: int) -> None:
        shape = [rows, *self.kv[0].shape[1:]]
        offset = first_slot * self.slot_bytes
        for past, present, array in zip(self.past, self.present, self.kv, strict=True):
            pointer = array.ctypes.data + offset
            binding.bind_input(past, "cpu", 0, np.float32, shape, pointer)
            binding.bind_output(present, "cpu", 0, np.float32, shape, pointer)

    def _run(self, binding: ort.IOBinding) -> None:
        began = time.perf_counter()
        self.session.run_with_iobinding(binding)
        self.run_seconds += time.perf_counter() - began

    def prefill(self, slot: int, ids: list[int]) -> int:
        """Run a prompt into a slot; return the greedy next token."""
        count = len(ids)
        binding = self.session.io_binding()
        binding.bind_cpu_input("input_ids", np.asarray(ids, dtype=np.int64).reshape(1, count))
        binding.bind_cpu_input("attention_mask", np.ones((1, count), dtype=np.int64))
        binding.bind_output("logits", "cpu")
        self._bind_kv(binding, slot, 1)
        self._run(binding)
        self.lengths[slot] = count
        return int(binding.get_outputs()[0].numpy()[0, -1].argmax())

    def decode(self, tokens: np.ndarray) -> np.ndarray:
        """One greedy step for slots [0, len(tokens)); returns the next tokens."""
        rows = len(tokens)
        self.ids[:rows, 0] = tokens
        sums = self.lengths[:rows] + 1
        width = int(sums.max())
        mask = self.mask[: rows * width].reshape(rows, width)
        np.less(self.positions[:width], sums[:, np.newaxis], out=mask, casting="unsafe")
        binding = self.bindings.get(rows)
        if binding is None:
            binding = self.session.io_binding()
            binding.bind_input("input_ids", "cpu", 0, np.int64, [rows, 1], self.ids.ctypes.data)
            binding.bind_output(
                "logits", "cpu", 0, np.float32, [rows, 1, self.vocab], self.logits.ctypes.data
            )
            self._bind_kv(binding, 0, rows)
            self.bindings[rows] = binding
        binding.bind_input("attention_mask", "cpu", 0, np.int64, [rows, width], mask.ctypes.data)
        self._run(binding)
        self.lengths[:rows] += 1
        next_tokens: np.ndarray = self.logits[:rows, 0].argmax(axis=-1)
        return next_tokens


def generate(loop: RawLoop, prompts: list[list[int]], new_tokens: int) -> dict[str, float]:
    """Prefill every prompt (batch 1 each), then decode them together; times in seconds.

    Returns the prefill time of the first prompt, the total, and the decode-only time.
    """
    began = time.perf_counter()
    cpu_began = time.process_time()
    first = [loop.prefill(slot, ids) for slot, ids in enumerate(prompts)]
    prefilled = time.perf_counter()
    tokens = np.asarray(first, dtype=np.int64)
    for _ in range(new_tokens - 1):
        tokens = loop.decode(tokens)
    ended = time.perf_counter()
    return {
        "total": ended - began,
        "prefill_all": prefilled - began,
        "decode": ended - prefilled,
        "cpu": time.process_time() - cpu_began,
        "tokens": float(len(prompts) * new_tokens),
    }


def prefill_seconds(loop: RawLoop, ids: list[int]) -> float:
    """Time of one batch-1 prefill of `ids` (what a server's TTFT at idle can at best be)."""
    began = time.perf_counter()
    loop.prefill(0, ids)
    return time.perf_counter() - began

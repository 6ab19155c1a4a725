"""The model's own limit on a GPU: a minimal ONNX Runtime CUDA loop, no server around it.

KV cache preallocated on the device, one slot per sequence, bound as both past and present
(share-buffer IO binding, the GenAI GroupQueryAttention layout); greedy decode of B sequences
together. Prints tokens/s per batch size as JSON lines.

usage: python raw_cuda_loop.py MODEL_DIR [--batch 1,8,16,64] [--prompt 100] [--new 128]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

TYPES = {"tensor(float16)": np.float16, "tensor(float)": np.float32}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--batch", default="1,8,16,64")
    parser.add_argument("--prompt", type=int, default=100)
    parser.add_argument("--new", type=int, default=128)
    args = parser.parse_args()
    if hasattr(ort, "preload_dlls"):
        ort.preload_dlls()
    config = json.loads((args.model_dir / "genai_config.json").read_text())["model"]
    decoder = config["decoder"]
    session = ort.InferenceSession(
        str(args.model_dir / decoder.get("filename", "model.onnx")),
        providers=["CUDAExecutionProvider", "CPUExecutionProvider"],
    )
    layers = int(decoder["num_hidden_layers"])
    past = [f"past_key_values.{i}.{k}" for i in range(layers) for k in ("key", "value")]
    present = [f"present.{i}.{k}" for i in range(layers) for k in ("key", "value")]
    kv_type = TYPES[next(i.type for i in session.get_inputs() if i.name == past[0])]
    vocab = int(config["vocab_size"])
    max_len = args.prompt + args.new + 8
    for batch in [int(b) for b in args.batch.split(",")]:
        shape = [batch, int(decoder["num_key_value_heads"]), max_len, int(decoder["head_size"])]
        slot_bytes = int(np.prod(shape[1:])) * np.dtype(kv_type).itemsize
        buffers = [ort.OrtValue.ortvalue_from_shape_and_type(shape, kv_type, "cuda", 0) for _ in past]
        pointers = [b.data_ptr() for b in buffers]

        def bind_kv(
            binding: ort.IOBinding,
            first: int,
            rows: int,
            shape: list[int] = shape,
            pointers: list[int] = pointers,
            slot_bytes: int = slot_bytes,
        ) -> None:
            for p, q, ptr in zip(past, present, pointers, strict=True):
                shape_rows = [rows, *shape[1:]]
                binding.bind_input(p, "cuda", 0, kv_type, shape_rows, ptr + first * slot_bytes)
                binding.bind_output(q, "cuda", 0, kv_type, shape_rows, ptr + first * slot_bytes)

        rng = np.random.default_rng(0)
        prompt = rng.integers(100, vocab - 100, size=args.prompt).astype(np.int64)
        first_tokens = []
        prefill_seconds = []
        for slot in range(batch):
            binding = session.io_binding()
            binding.bind_cpu_input("input_ids", prompt[None])
            binding.bind_cpu_input("attention_mask", np.ones((1, args.prompt), np.int64))
            binding.bind_output("logits", "cpu")
            bind_kv(binding, slot, 1)
            started = time.perf_counter()
            session.run_with_iobinding(binding)
            prefill_seconds.append(time.perf_counter() - started)
            first_tokens.append(int(binding.get_outputs()[0].numpy()[0, -1].argmax()))
        ids = np.array(first_tokens, dtype=np.int64).reshape(batch, 1)
        logits = np.zeros((batch, 1, vocab), dtype=np.float32)
        binding = session.io_binding()
        binding.bind_input("input_ids", "cpu", 0, np.int64, [batch, 1], ids.ctypes.data)
        binding.bind_output("logits", "cpu", 0, np.float32, [batch, 1, vocab], logits.ctypes.data)
        bind_kv(binding, 0, batch)
        length = args.prompt
        started = time.perf_counter()
        for _ in range(args.new):
            mask = np.ones((batch, length + 1), dtype=np.int64)
            binding.bind_cpu_input("attention_mask", mask)
            session.run_with_iobinding(binding)
            ids[:, 0] = logits[:, 0].argmax(-1)
            length += 1
        seconds = time.perf_counter() - started
        print(
            json.dumps(
                {
                    "batch": batch,
                    "decode_tokens_per_second": batch * args.new / seconds,
                    "step_ms": seconds / args.new * 1000,
                    "prefill_ms_median": float(np.median(prefill_seconds[1:] or prefill_seconds)) * 1000,
                    "provider": session.get_providers()[0],
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()

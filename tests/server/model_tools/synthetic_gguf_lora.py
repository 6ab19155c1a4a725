"""GGUF LoRA adapters for the synthetic GGUF models, laid out as llama.cpp's convert_lora_to_gguf.py
writes them, and the numpy reference model with their updates merged in.

A file carries `general.type` adapter, `adapter.type` lora, the base's architecture and
`adapter.lora.alpha`, and per projection `blk.N.<tensor>.weight.lora_a` ([r, in]) and
`.lora_b` ([out, r]) named as the base's tensors: Phi-3's fused attn_qkv and gate-up ffn_up, and
every B in the file's own row order (for llama, the permuted Q/K order the base file has too).
The reference adds `alpha / r * B @ A` to each weight in that same order, so the reader's
un-permutation and splitting are checked, not assumed.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from tests.server.model_tools.llama_reference import ReferenceModel
from tests.server.model_tools.synthetic_gguf import HEAD_DIM, HEADS, HIDDEN, INTERMEDIATE, KV_HEADS

_SHAPES = {  # tensor -> (out, in), and the reference layer's fields it updates, in output order
    "attn_q": (HEADS * HEAD_DIM, HIDDEN, ("q",)),
    "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN, ("k",)),
    "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN, ("v",)),
    "attn_qkv": ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN, ("q", "k", "v")),
    "attn_output": (HIDDEN, HEADS * HEAD_DIM, ("o",)),
    "ffn_gate": (INTERMEDIATE, HIDDEN, ("gate",)),
    "ffn_up": (INTERMEDIATE, HIDDEN, ("up",)),
    "ffn_gate_up": (2 * INTERMEDIATE, HIDDEN, ("gate", "up")),
    "ffn_down": (HIDDEN, INTERMEDIATE, ("down",)),
}
ALL_TENSORS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
PHI3_TENSORS = ("attn_qkv", "attn_output", "ffn_gate_up", "ffn_down")


def write_gguf_lora(
    path: Path,
    base: ReferenceModel,
    *,
    arch: str,
    rank: int,
    alpha: float,
    seed: int,
    tensors: tuple[str, ...] = ALL_TENSORS,
    a_type: Q = Q.F32,
) -> ReferenceModel:
    """Write the adapter and return `base` with its updates merged (weights in the file's order)."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_type("adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", alpha)
    layers = list(base.layers)
    for index, layer in enumerate(layers):
        updated = {}
        for tensor in tensors:
            out, cols, fields = _SHAPES[tensor]
            a = (rng.standard_normal((rank, cols)) / np.sqrt(cols)).astype(np.float32)
            b = (0.5 * rng.standard_normal((out, rank)) / np.sqrt(rank)).astype(np.float32)
            # Phi-3's file names its fused gate-up tensor ffn_up.
            name = f"blk.{index}.{'ffn_up' if tensor == 'ffn_gate_up' else tensor}.weight"
            if a_type == Q.F32:
                writer.add_tensor(name + ".lora_a", a)
            else:
                stored = quantize(a, a_type)
                writer.add_tensor(name + ".lora_a", stored, raw_dtype=a_type)
                a = dequantize(stored, a_type).reshape(rank, cols)
            writer.add_tensor(name + ".lora_b", b)
            delta = alpha / rank * (b.astype(np.float64) @ a.astype(np.float64))
            start = 0
            for field in fields:
                rows = getattr(layer, field).shape[0]
                updated[field] = getattr(layer, field) + delta[start : start + rows]
                start += rows
        layers[index] = replace(layer, **updated)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return replace(base, layers=layers)

"""A plain numpy (float64) Llama forward pass, written from the architecture's definition.

It shares no code with the ONNX graph builder, so agreement between the two checks the builder:
RMSNorm, rotary embeddings (both Hugging Face's rotate-half form and llama.cpp's interleaved form,
which GGUF files' Q/K rows are permuted for), grouped-query causal attention, SwiGLU and the head.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import gguf
import numpy as np
from gguf.quants import dequantize
from numpy.typing import NDArray

from tokenwire.server.model_tools.convert.llama_model import LlamaWeights, dequantized

Array = NDArray[np.float64]


@dataclass(frozen=True)
class ReferenceLayer:
    attn_norm: Array
    q: Array  # [out, in]
    k: Array
    v: Array
    o: Array
    ffn_norm: Array
    gate: Array
    up: Array
    down: Array


@dataclass(frozen=True)
class ReferenceModel:
    embed: Array  # [vocab, hidden]
    layers: list[ReferenceLayer]
    final_norm: Array
    head: Array  # [vocab, hidden]
    num_heads: int
    num_kv_heads: int
    rope_theta: float
    rms_norm_eps: float
    rope_style: Literal["half", "interleaved"]


def reference_from_weights(
    weights: LlamaWeights, *, heads: int, kv_heads: int, theta: float, eps: float
) -> ReferenceModel:
    """The numpy reference over the same numbers the graph builder was given (HF row order)."""

    def f64(array: np.ndarray) -> np.ndarray:
        return np.asarray(array, dtype=np.float64)

    layers = [
        ReferenceLayer(
            attn_norm=f64(layer.attn_norm),
            q=f64(dequantized(layer.q_proj)),
            k=f64(dequantized(layer.k_proj)),
            v=f64(dequantized(layer.v_proj)),
            o=f64(dequantized(layer.o_proj)),
            ffn_norm=f64(layer.ffn_norm),
            gate=f64(dequantized(layer.gate_proj)),
            up=f64(dequantized(layer.up_proj)),
            down=f64(dequantized(layer.down_proj)),
        )
        for layer in weights.layers
    ]
    embed = f64(dequantized(weights.embed_tokens))
    head = embed if weights.lm_head is None else f64(dequantized(weights.lm_head))
    return ReferenceModel(
        embed=embed,
        layers=layers,
        final_norm=f64(weights.final_norm),
        head=head,
        num_heads=heads,
        num_kv_heads=kv_heads,
        rope_theta=theta,
        rms_norm_eps=eps,
        rope_style="half",
    )


def reference_from_gguf(path: Path) -> ReferenceModel:
    """The model in a Llama GGUF file, read with the gguf package alone (weights in the file's row order)."""
    reader = gguf.GGUFReader(path)
    tensors = {}
    for tensor in reader.tensors:
        values = dequantize(np.asarray(tensor.data), tensor.tensor_type).astype(np.float32)
        tensors[tensor.name] = values.reshape([int(n) for n in reversed(tensor.shape)])

    def field(key: str) -> Any:
        return reader.fields[key].contents()

    layers = [
        ReferenceLayer(
            attn_norm=tensors[f"blk.{i}.attn_norm.weight"],
            q=tensors[f"blk.{i}.attn_q.weight"],
            k=tensors[f"blk.{i}.attn_k.weight"],
            v=tensors[f"blk.{i}.attn_v.weight"],
            o=tensors[f"blk.{i}.attn_output.weight"],
            ffn_norm=tensors[f"blk.{i}.ffn_norm.weight"],
            gate=tensors[f"blk.{i}.ffn_gate.weight"],
            up=tensors[f"blk.{i}.ffn_up.weight"],
            down=tensors[f"blk.{i}.ffn_down.weight"],
        )
        for i in range(int(field("llama.block_count")))
    ]
    return ReferenceModel(
        embed=tensors["token_embd.weight"],
        layers=layers,
        final_norm=tensors["output_norm.weight"],
        head=tensors.get("output.weight", tensors["token_embd.weight"]),
        num_heads=int(field("llama.attention.head_count")),
        num_kv_heads=int(field("llama.attention.head_count_kv")),
        rope_theta=float(field("llama.rope.freq_base")),
        rms_norm_eps=float(field("llama.attention.layer_norm_rms_epsilon")),
        rope_style="interleaved",
    )


def rms_norm(x: Array, gamma: Array, eps: float) -> Array:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * gamma


def _angles(positions: Array, head_dim: int, theta: float) -> Array:
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    return positions[:, None] * inv_freq[None, :]  # [seq, head_dim / 2]


def rope(x: Array, positions: Array, theta: float, style: Literal["half", "interleaved"]) -> Array:
    """Rotate x [seq, heads, head_dim] by each position's angles."""
    angles = _angles(positions, x.shape[-1], theta)
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
    if style == "half":
        # Pairs (i, i + head_dim/2), as in Hugging Face's rotate_half.
        first, second = np.split(x, 2, axis=-1)
        return np.concatenate([first * cos - second * sin, first * sin + second * cos], axis=-1)
    # Pairs (2i, 2i + 1), as in llama.cpp's default rope.
    even, odd = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = even * sin + odd * cos
    return out


def forward(model: ReferenceModel, token_ids: list[int]) -> Array:
    """Logits [seq, vocab] of a whole sequence, each position attending to itself and earlier ones."""
    seq = len(token_ids)
    hidden = model.embed.shape[1]
    head_dim = model.layers[0].q.shape[0] // model.num_heads
    group = model.num_heads // model.num_kv_heads
    positions = np.arange(seq, dtype=np.float64)
    causal = np.triu(np.full((seq, seq), -np.inf), k=1)
    x = model.embed[np.asarray(token_ids)].astype(np.float64)
    for layer in model.layers:
        h = rms_norm(x, layer.attn_norm, model.rms_norm_eps)
        q = (h @ layer.q.T).reshape(seq, model.num_heads, head_dim)
        k = (h @ layer.k.T).reshape(seq, model.num_kv_heads, head_dim)
        v = (h @ layer.v.T).reshape(seq, model.num_kv_heads, head_dim)
        q = rope(q, positions, model.rope_theta, model.rope_style)
        k = rope(k, positions, model.rope_theta, model.rope_style)
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(head_dim) + causal
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        scores /= scores.sum(axis=-1, keepdims=True)
        attention = np.einsum("hqk,khd->qhd", scores, v).reshape(seq, model.num_heads * head_dim)
        x = x + attention @ layer.o.T
        h = rms_norm(x, layer.ffn_norm, model.rms_norm_eps)
        gate, up = h @ layer.gate.T, h @ layer.up.T
        x = x + (gate / (1.0 + np.exp(-gate)) * up) @ layer.down.T
    assert x.shape[1] == hidden
    return rms_norm(x, model.final_norm, model.rms_norm_eps) @ model.head.T


def log_softmax(logits: NDArray[np.floating]) -> Array:
    x = logits.astype(np.float64)
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def perplexity(logits: NDArray[np.floating], token_ids: list[int]) -> float:
    """exp(mean negative log-likelihood) of tokens 1.. given their prefixes."""
    log_probs = log_softmax(logits[:-1])
    targets = np.asarray(token_ids[1:])
    return float(np.exp(-log_probs[np.arange(len(targets)), targets].mean()))


def mean_kl(reference: NDArray[np.floating], other: NDArray[np.floating]) -> float:
    """Mean over positions of KL(reference || other) between the two next-token distributions."""
    p, q = log_softmax(reference), log_softmax(other)
    return float((np.exp(p) * (p - q)).sum(axis=-1).mean())

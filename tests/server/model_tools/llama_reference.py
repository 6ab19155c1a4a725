"""A plain numpy (float64) Llama forward pass, written from the architecture's definition.

It grows per family as Hugging Face's modeling code defines them: Qwen 2's QKV biases, Qwen 3's
and Gemma 3's per-head QK norms, Gemma's scaled embeddings, post-attention and post-FFN norms,
GELU-tanh, soft-capping and sliding windows, Gemma 3's local rotary base.

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
    q_bias: Array | None = None
    k_bias: Array | None = None
    v_bias: Array | None = None
    q_norm: Array | None = None
    k_norm: Array | None = None
    post_attn_norm: Array | None = None
    post_ffn_norm: Array | None = None


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
    embedding_scale: float = 1.0
    activation: Literal["silu", "gelu_tanh"] = "silu"
    attention_scale: float | None = None
    attention_softcap: float = 0.0
    final_logit_softcap: float = 0.0
    sliding_window: int = 0  # keys within this distance, the query's own included
    sliding_layers: tuple[bool, ...] = ()  # empty: every layer slides when there is a window
    local_rope_theta: float | None = None


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


def _gelu_tanh(x: Array) -> Array:
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


def _cap(x: Array, cap: float) -> Array:
    return np.tanh(x / cap) * cap if cap else x


def forward(model: ReferenceModel, token_ids: list[int]) -> Array:
    """Logits [seq, vocab] of a whole sequence, each position attending to itself and earlier ones."""
    seq = len(token_ids)
    hidden = model.embed.shape[1]
    head_dim = model.layers[0].q.shape[0] // model.num_heads
    group = model.num_heads // model.num_kv_heads
    positions = np.arange(seq, dtype=np.float64)
    distance = positions[:, None] - positions[None, :]
    causal = np.where(distance < 0, -np.inf, 0.0)
    windowed = np.where((distance < 0) | (distance >= model.sliding_window), -np.inf, 0.0)
    scale = model.attention_scale if model.attention_scale is not None else 1.0 / np.sqrt(head_dim)
    x = model.embed[np.asarray(token_ids)].astype(np.float64) * model.embedding_scale
    for index, layer in enumerate(model.layers):
        sliding = model.sliding_window > 0 and (not model.sliding_layers or model.sliding_layers[index])
        theta = model.local_rope_theta if sliding and model.local_rope_theta is not None else model.rope_theta
        h = rms_norm(x, layer.attn_norm, model.rms_norm_eps)
        q, k, v = h @ layer.q.T, h @ layer.k.T, h @ layer.v.T
        q = q if layer.q_bias is None else q + layer.q_bias
        k = k if layer.k_bias is None else k + layer.k_bias
        v = v if layer.v_bias is None else v + layer.v_bias
        q = q.reshape(seq, model.num_heads, head_dim)
        k = k.reshape(seq, model.num_kv_heads, head_dim)
        v = v.reshape(seq, model.num_kv_heads, head_dim)
        if layer.q_norm is not None:
            q = rms_norm(q, layer.q_norm, model.rms_norm_eps)
        if layer.k_norm is not None:
            k = rms_norm(k, layer.k_norm, model.rms_norm_eps)
        q = rope(q, positions, theta, model.rope_style)
        k = rope(k, positions, theta, model.rope_style)
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        scores = _cap(np.einsum("qhd,khd->hqk", q, k) * scale, model.attention_softcap)
        scores = scores + (windowed if sliding else causal)
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        scores /= scores.sum(axis=-1, keepdims=True)
        attention = np.einsum("hqk,khd->qhd", scores, v).reshape(seq, model.num_heads * head_dim)
        out = attention @ layer.o.T
        if layer.post_attn_norm is not None:
            out = rms_norm(out, layer.post_attn_norm, model.rms_norm_eps)
        x = x + out
        h = rms_norm(x, layer.ffn_norm, model.rms_norm_eps)
        gate, up = h @ layer.gate.T, h @ layer.up.T
        activated = _gelu_tanh(gate) if model.activation == "gelu_tanh" else gate / (1.0 + np.exp(-gate))
        out = (activated * up) @ layer.down.T
        if layer.post_ffn_norm is not None:
            out = rms_norm(out, layer.post_ffn_norm, model.rms_norm_eps)
        x = x + out
    assert x.shape[1] == hidden
    return _cap(rms_norm(x, model.final_norm, model.rms_norm_eps) @ model.head.T, model.final_logit_softcap)


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

"""The Llama-family model description the graph builder consumes: hyperparameters and weights.

Both the GGUF converter and the tiny test model produce these, so one graph builder serves both.
Linear weights are [out_features, in_features], as in Hugging Face checkpoints, with Q and K
rows in Hugging Face's rotate-half order (GGUF's interleaved order is undone on load).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from tokenwire.server.model_tools.convert.quantized import QuantizedMatrix

F32 = NDArray[np.float32]

# A linear layer's weight: block-quantized, or plain float32 [out_features, in_features].
LinearWeight = QuantizedMatrix | F32


@dataclass(frozen=True)
class LlamaConfig:
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    vocab_size: int
    context_length: int
    rope_theta: float
    rms_norm_eps: float

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.head_size % 2:
            raise ValueError("head_size must be even for rotary embeddings")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_size

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_size


@dataclass(frozen=True)
class LlamaLayerWeights:
    attn_norm: F32  # [hidden]
    q_proj: LinearWeight  # [q_size, hidden]
    k_proj: LinearWeight  # [kv_size, hidden]
    v_proj: LinearWeight  # [kv_size, hidden]
    o_proj: LinearWeight  # [hidden, q_size]
    ffn_norm: F32  # [hidden]
    gate_proj: LinearWeight  # [intermediate, hidden]
    up_proj: LinearWeight  # [intermediate, hidden]
    down_proj: LinearWeight  # [hidden, intermediate]


@dataclass(frozen=True)
class LlamaWeights:
    embed_tokens: LinearWeight  # [vocab, hidden]
    # Any sequence: a GGUF source decodes each layer when it is accessed.
    layers: Sequence[LlamaLayerWeights]
    final_norm: F32  # [hidden]
    lm_head: LinearWeight | None  # [vocab, hidden]; None when tied to embed_tokens
    # Llama 3 style per-frequency divisors of the rotary inverse frequencies, [head_size / 2].
    rope_freq_factors: F32 | None = None


def linear_shape(weight: LinearWeight) -> tuple[int, int]:
    if isinstance(weight, QuantizedMatrix):
        return (weight.rows, weight.cols)
    rows, cols = weight.shape
    return (int(rows), int(cols))


def dequantized(weight: LinearWeight) -> F32:
    if isinstance(weight, QuantizedMatrix):
        return weight.dequantize()
    return weight

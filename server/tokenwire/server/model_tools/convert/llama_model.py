"""The Llama-family model description the graph builder consumes: hyperparameters and weights.

Both the GGUF converter and the tiny test model produce these, so one graph builder serves both.
Linear weights are [out_features, in_features], as in Hugging Face checkpoints, with Q and K
rows in Hugging Face's rotate-half order (GGUF's interleaved order is undone on load).

The relatives of Llama (Mistral, Qwen 2 and 3, Gemma 2 and 3, Phi-3) are Llama plus optional
parts: the config fields after `rms_norm_eps` and the optional layer weights default to Llama.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

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
    # Gemma multiplies the embeddings by sqrt(hidden_size) before the first layer.
    embedding_scale: float = 1.0
    # The gated FFN's activation: SiLU (Llama, Qwen, Phi-3) or tanh-approximated GELU (Gemma).
    activation: Literal["silu", "gelu_tanh"] = "silu"
    # Scale of the query-key products; None is 1/sqrt(head_size).
    attention_scale: float | None = None
    # cap * tanh(x / cap) on attention scores and on the final logits (Gemma 2); 0 is off.
    attention_softcap: float = 0.0
    final_logit_softcap: float = 0.0
    # Tokens a sliding-window layer attends to, itself included; 0 is full attention everywhere.
    sliding_window: int = 0
    # Which layers slide; empty with a window means all of them (Mistral).
    sliding_layers: tuple[bool, ...] = ()
    # Rotary base of the sliding layers when it differs from rope_theta (Gemma 3's local layers).
    local_rope_theta: float | None = None
    # Linear rotary scaling of the full-attention layers: positions are divided by it.
    rope_linear_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.head_size % 2:
            raise ValueError("head_size must be even for rotary embeddings")

    def is_sliding(self, layer: int) -> bool:
        if self.sliding_window <= 0:
            return False
        return not self.sliding_layers or self.sliding_layers[layer]

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
    # Qwen 2's Q, K and V biases, [q_size] and [kv_size].
    q_bias: F32 | None = None
    k_bias: F32 | None = None
    v_bias: F32 | None = None
    # Qwen 3 and Gemma 3 RMS-normalize each head of Q and K before rotary, [head_size].
    q_norm: F32 | None = None
    k_norm: F32 | None = None
    # Gemma 2 and 3 normalize the attention and FFN outputs before the residual add, [hidden].
    post_attn_norm: F32 | None = None
    post_ffn_norm: F32 | None = None


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

"""Read a Llama-family GGUF file into a LlamaConfig, LlamaWeights and its tokenizer vocabulary.

Quantized tensors keep their GGUF codes (see quantized.py); formats without a repacking path are
dequantized to float32. GGUF's conversion from Hugging Face permutes the rows of the Q and K
projections into the interleaved rotary order llama.cpp uses; that permutation is undone here, so
the graph can use rotate-half rotary embeddings like the original checkpoint.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize
from numpy.typing import NDArray

from tokenwire.server.model_tools.convert.errors import UnsupportedModelError
from tokenwire.server.model_tools.convert.gguf_file import open_gguf
from tokenwire.server.model_tools.convert.gguf_tokenizer import GgufVocabulary
from tokenwire.server.model_tools.convert.llama_model import (
    LinearWeight,
    LlamaConfig,
    LlamaLayerWeights,
    LlamaWeights,
)
from tokenwire.server.model_tools.convert.quantized import can_repack, decode_gguf_blocks

F32 = NDArray[np.float32]

# Architectures whose GGUF tensors follow the Llama naming and Q/K row permutation.
SUPPORTED_ARCHITECTURES = ("llama",)


@dataclass(frozen=True)
class GgufModel:
    name: str
    architecture: str
    config: LlamaConfig
    weights: LlamaWeights
    vocabulary: GgufVocabulary
    tensor_types: dict[str, int]  # GGML type name -> number of tensors, for reports


class _Fields:
    """Typed access to a GGUF file's metadata."""

    def __init__(self, reader: GGUFReader) -> None:
        self._reader = reader

    def get(self, key: str, default: Any = None) -> Any:
        field = self._reader.get_field(key)
        if field is None:
            return default
        return field.contents()

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise UnsupportedModelError(f"GGUF metadata lacks {key}")
        return value


def read_gguf(path: Path) -> GgufModel:
    reader = open_gguf(path)
    fields = _Fields(reader)
    arch = str(fields.require("general.architecture"))
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    tensors = {t.name: t for t in reader.tensors}
    config = _read_config(fields, arch, tensors)
    weights = _read_weights(config, tensors)
    counts: dict[str, int] = {}
    for t in reader.tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return GgufModel(
        name=str(fields.get("general.name", path.stem)),
        architecture=arch,
        config=config,
        weights=weights,
        vocabulary=_read_vocabulary(fields),
        tensor_types=counts,
    )


def _read_config(fields: _Fields, arch: str, tensors: dict[str, ReaderTensor]) -> LlamaConfig:
    hidden = int(fields.require(f"{arch}.embedding_length"))
    heads = int(fields.require(f"{arch}.attention.head_count"))
    kv_heads = int(fields.get(f"{arch}.attention.head_count_kv", heads))
    head_size = int(fields.get(f"{arch}.attention.key_length", hidden // heads))
    rotary_dim = int(fields.get(f"{arch}.rope.dimension_count", head_size))
    if rotary_dim != head_size:
        raise UnsupportedModelError(
            f"partial rotary embeddings ({rotary_dim} of {head_size}) are not supported"
        )
    if fields.get(f"{arch}.rope.scaling.type") not in (None, "none"):
        raise UnsupportedModelError("rope scaling other than frequency factors is not supported")
    vocab_size = int(fields.get(f"{arch}.vocab_size", 0)) or int(tensors["token_embd.weight"].shape[1])
    return LlamaConfig(
        num_layers=int(fields.require(f"{arch}.block_count")),
        hidden_size=hidden,
        intermediate_size=int(fields.require(f"{arch}.feed_forward_length")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_size=head_size,
        vocab_size=vocab_size,
        context_length=int(fields.require(f"{arch}.context_length")),
        rope_theta=float(fields.get(f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(fields.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
    )


def _float_array(tensor: ReaderTensor) -> F32:
    values = dequantize(np.asarray(tensor.data), GGMLQuantizationType(tensor.tensor_type))
    return np.asarray(values, dtype=np.float32)


def _vector(tensor: ReaderTensor) -> F32:
    return _float_array(tensor).reshape(-1)


def _linear(tensor: ReaderTensor) -> LinearWeight:
    """A 2-D GGUF tensor as [rows = out features, cols = in features]."""
    cols, rows = (int(n) for n in tensor.shape)  # GGUF lists the fastest-varying dimension first
    tensor_type = GGMLQuantizationType(tensor.tensor_type)
    if can_repack(tensor_type):
        return decode_gguf_blocks(np.asarray(tensor.data), tensor_type, cols)
    return _float_array(tensor).reshape(rows, cols)


def _rotary_rows_to_half_order(weight: LinearWeight, heads: int, head_size: int) -> LinearWeight:
    """Undo convert_hf_to_gguf's permute(): GGUF row 2*i + j of a head is HF row j * head_size/2 + i."""
    index = np.arange(heads * head_size).reshape(heads, head_size // 2, 2).swapaxes(1, 2).reshape(-1)
    if isinstance(weight, np.ndarray):
        return np.ascontiguousarray(weight[index])
    return weight.take_rows(index)


def _tensor(tensors: dict[str, ReaderTensor], name: str) -> ReaderTensor:
    if name not in tensors:
        raise UnsupportedModelError(f"GGUF file lacks tensor {name}")
    return tensors[name]


class _LayersFromGguf(Sequence[LlamaLayerWeights]):
    """The decoder layers, decoded from the memory-mapped file when accessed.

    Holding every layer decoded would take several times the file's size in memory; the graph
    builder visits each layer once (and the next one's norm), so the last two are kept.
    """

    def __init__(self, config: LlamaConfig, tensors: dict[str, ReaderTensor]) -> None:
        self._config = config
        self._tensors = tensors
        self._recent: dict[int, LlamaLayerWeights] = {}
        # Checked up front, so a file the graph cannot express fails before any work is done.
        for i in range(config.num_layers):
            for unexpected in _FOREIGN_LAYER_TENSORS:
                if f"blk.{i}.{unexpected}" in tensors:
                    raise UnsupportedModelError(
                        f"tensor blk.{i}.{unexpected} is not part of the Llama architecture"
                    )
            for name in _LAYER_TENSORS:
                _tensor(tensors, f"blk.{i}.{name}.weight")

    def __len__(self) -> int:
        return self._config.num_layers

    @overload
    def __getitem__(self, index: int) -> LlamaLayerWeights: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[LlamaLayerWeights]: ...

    def __getitem__(self, index: int | slice) -> LlamaLayerWeights | Sequence[LlamaLayerWeights]:
        if isinstance(index, slice):
            return [self[i] for i in range(len(self))[index]]
        if not -len(self) <= index < len(self):
            raise IndexError(index)
        index %= len(self)
        if index not in self._recent:
            if len(self._recent) >= 2:
                del self._recent[min(self._recent)]
            self._recent[index] = self._decode(index)
        return self._recent[index]

    def _decode(self, i: int) -> LlamaLayerWeights:
        cfg = self._config

        def weight(name: str) -> ReaderTensor:
            return _tensor(self._tensors, f"blk.{i}.{name}.weight")

        return LlamaLayerWeights(
            attn_norm=_vector(weight("attn_norm")),
            q_proj=_rotary_rows_to_half_order(_linear(weight("attn_q")), cfg.num_heads, cfg.head_size),
            k_proj=_rotary_rows_to_half_order(_linear(weight("attn_k")), cfg.num_kv_heads, cfg.head_size),
            v_proj=_linear(weight("attn_v")),
            o_proj=_linear(weight("attn_output")),
            ffn_norm=_vector(weight("ffn_norm")),
            gate_proj=_linear(weight("ffn_gate")),
            up_proj=_linear(weight("ffn_up")),
            down_proj=_linear(weight("ffn_down")),
        )


# Tensors of Llama relatives (Qwen 2's Q/K/V biases, Qwen 3's Q/K norms) the graph lacks.
_FOREIGN_LAYER_TENSORS = (
    "attn_q.bias",
    "attn_k.bias",
    "attn_v.bias",
    "attn_q_norm.weight",
    "attn_k_norm.weight",
)

_LAYER_TENSORS = (
    "attn_norm",
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_output",
    "ffn_norm",
    "ffn_gate",
    "ffn_up",
    "ffn_down",
)


def _read_weights(config: LlamaConfig, tensors: dict[str, ReaderTensor]) -> LlamaWeights:
    return LlamaWeights(
        embed_tokens=_linear(_tensor(tensors, "token_embd.weight")),
        layers=_LayersFromGguf(config, tensors),
        final_norm=_vector(_tensor(tensors, "output_norm.weight")),
        lm_head=_linear(tensors["output.weight"]) if "output.weight" in tensors else None,
        rope_freq_factors=_vector(tensors["rope_freqs.weight"]) if "rope_freqs.weight" in tensors else None,
    )


def _read_vocabulary(fields: _Fields) -> GgufVocabulary:
    def optional_id(key: str) -> int | None:
        value = fields.get(key)
        return None if value is None else int(value)

    return GgufVocabulary(
        model=str(fields.require("tokenizer.ggml.model")),
        pre=str(fields.get("tokenizer.ggml.pre", "default")),
        tokens=[str(t) for t in fields.require("tokenizer.ggml.tokens")],
        token_types=[int(t) for t in fields.get("tokenizer.ggml.token_type", [])],
        merges=[str(m) for m in fields.get("tokenizer.ggml.merges", [])],
        bos_token_id=optional_id("tokenizer.ggml.bos_token_id"),
        eos_token_id=optional_id("tokenizer.ggml.eos_token_id"),
        eot_token_id=optional_id("tokenizer.ggml.eot_token_id"),
        pad_token_id=optional_id("tokenizer.ggml.padding_token_id"),
        unknown_token_id=optional_id("tokenizer.ggml.unknown_token_id"),
        add_bos_token=bool(fields.get("tokenizer.ggml.add_bos_token", False)),
        add_eos_token=bool(fields.get("tokenizer.ggml.add_eos_token", False)),
        chat_template=fields.get("tokenizer.chat_template"),
    )

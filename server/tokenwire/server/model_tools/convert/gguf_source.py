"""Read a Llama-family GGUF file into a LlamaConfig, LlamaWeights and its tokenizer vocabulary.

Architectures: llama (and Mistral, which is llama with `attention.sliding_window`), qwen2,
qwen3, gemma2, gemma3 and phi3. Quantized tensors keep their GGUF codes (see quantized.py);
formats without a repacking path are dequantized to float32. For llama only, GGUF's conversion
from Hugging Face permutes the rows of the Q and K projections into the interleaved rotary order
llama.cpp uses; that permutation is undone here, so the graph can use rotate-half rotary
embeddings like the original checkpoint (the other families keep Hugging Face's order, which
llama.cpp runs as its "NEOX" rotary). llama.cpp's Gemma conversion already adds the 1 of
Gemma's (1 + w) norm weights, so every norm here is a plain RMSNorm.
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
from tokenwire.server.model_tools.convert.gguf_tokenizer import GgufVocabulary, strip_after_tokens
from tokenwire.server.model_tools.convert.llama_model import (
    LinearWeight,
    LlamaConfig,
    LlamaLayerWeights,
    LlamaWeights,
)
from tokenwire.server.model_tools.convert.quantized import can_repack, decode_gguf_blocks

F32 = NDArray[np.float32]

# Architectures whose GGUF tensors the graph builder can express.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")
_GEMMA = ("gemma2", "gemma3")
# Layer counts of the 27B Gemmas, which scale queries by hidden / heads instead of head_size
# (their query_pre_attn_scalar, which llama.cpp derives from the size as done here).
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


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
    if "token_embd.weight" not in tensors:
        raise UnsupportedModelError("GGUF file lacks tensor token_embd.weight")
    config = _read_config(fields, arch, tensors)
    weights = _read_weights(config, arch, tensors)
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
    layers = int(fields.require(f"{arch}.block_count"))
    rotary_dim = int(fields.get(f"{arch}.rope.dimension_count", head_size))
    if rotary_dim != head_size:
        raise UnsupportedModelError(
            f"partial rotary embeddings ({rotary_dim} of {head_size}) are not supported"
        )
    scaling = fields.get(f"{arch}.rope.scaling.type")
    linear_scale = 1.0
    if scaling == "linear":
        linear_scale = float(fields.get(f"{arch}.rope.scaling.factor", 1.0))
    elif scaling not in (None, "none"):
        raise UnsupportedModelError(
            f"rope scaling {scaling!r} is not supported (supported: none, linear, frequency factors)"
        )
    if "rope_factors_long.weight" in tensors or "rope_factors_short.weight" in tensors:
        raise UnsupportedModelError("Phi-3 longrope scaling (rope_factors_long/short) is not supported")
    vocab_size = int(fields.get(f"{arch}.vocab_size", 0)) or int(tensors["token_embd.weight"].shape[1])
    window = int(fields.get(f"{arch}.attention.sliding_window", 4096 if arch == "gemma2" else 0))
    if arch == "phi3":
        # llama.cpp runs Phi-3 with full attention (its files' window is not trusted there), and
        # so does this conversion, to give the same tokens.
        window = 0
    pattern = fields.get(f"{arch}.attention.sliding_window_pattern")
    sliding: tuple[bool, ...] = ()
    if isinstance(pattern, list):
        sliding = tuple(bool(p) for p in pattern)
    else:
        # Every n-th layer is global (n - 1 sliding, then one full): llama.cpp's default pattern.
        n = int(pattern) if pattern is not None else {"gemma2": 2, "gemma3": 6}.get(arch, 0)
        if n > 0:
            sliding = tuple(n == 1 or i % n < n - 1 for i in range(layers))
    if sliding and len(sliding) != layers:
        raise UnsupportedModelError(f"sliding_window_pattern has {len(sliding)} entries for {layers} layers")
    attention_scale = None
    if arch in _GEMMA and layers == _GEMMA_27B_LAYERS[arch]:
        attention_scale = 1.0 / float(np.sqrt(hidden / heads))
    local_theta = None
    if arch == "gemma3" and window > 0:
        local_theta = float(fields.get(f"{arch}.rope.freq_base_swa", 10000.0))
    return LlamaConfig(
        num_layers=layers,
        hidden_size=hidden,
        intermediate_size=int(fields.require(f"{arch}.feed_forward_length")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_size=head_size,
        vocab_size=vocab_size,
        context_length=int(fields.require(f"{arch}.context_length")),
        rope_theta=float(fields.get(f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(fields.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        embedding_scale=float(np.sqrt(hidden)) if arch in _GEMMA else 1.0,
        activation="gelu_tanh" if arch in _GEMMA else "silu",
        attention_scale=attention_scale,
        attention_softcap=float(fields.get(f"{arch}.attn_logit_softcapping", 0.0))
        if arch == "gemma2"
        else 0.0,
        final_logit_softcap=float(fields.get(f"{arch}.final_logit_softcapping", 0.0)),
        sliding_window=window,
        sliding_layers=sliding if window > 0 else (),
        local_rope_theta=local_theta,
        rope_linear_scale=linear_scale,
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


def rotary_half_order(heads: int, head_size: int) -> NDArray[np.intp]:
    """The GGUF row of each Hugging Face row of a Q or K projection whose rows convert_hf_to_gguf
    permuted (llama, mistral): GGUF row 2*i + j of a head is HF row j * head_size/2 + i. The same
    permutation applies to a LoRA adapter's B rows for those projections (convert_lora_to_gguf)."""
    return np.arange(heads * head_size).reshape(heads, head_size // 2, 2).swapaxes(1, 2).reshape(-1)


def _rotary_rows_to_half_order(weight: LinearWeight, heads: int, head_size: int) -> LinearWeight:
    """Undo convert_hf_to_gguf's permute() on a projection's rows."""
    index = rotary_half_order(heads, head_size)
    if isinstance(weight, np.ndarray):
        return np.ascontiguousarray(weight[index])
    return weight.take_rows(index)


def _tensor(tensors: dict[str, ReaderTensor], name: str) -> ReaderTensor:
    if name not in tensors:
        raise UnsupportedModelError(f"GGUF file lacks tensor {name}")
    return tensors[name]


def _tensor_names(arch: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(required, optional) tensor names of a layer, without the `blk.N.` prefix."""
    norms = ("attn_norm.weight", "ffn_norm.weight")
    if arch == "phi3":
        projections: tuple[str, ...] = (
            "attn_qkv.weight",
            "attn_output.weight",
            "ffn_up.weight",
            "ffn_down.weight",
        )
    else:
        projections = (
            "attn_q.weight",
            "attn_k.weight",
            "attn_v.weight",
            "attn_output.weight",
            "ffn_gate.weight",
            "ffn_up.weight",
            "ffn_down.weight",
        )
    extra: dict[str, tuple[str, ...]] = {
        "qwen2": ("attn_q.bias", "attn_k.bias", "attn_v.bias"),
        "qwen3": ("attn_q_norm.weight", "attn_k_norm.weight"),
        "gemma2": ("post_attention_norm.weight", "post_ffw_norm.weight"),
        "gemma3": (
            "post_attention_norm.weight",
            "post_ffw_norm.weight",
            "attn_q_norm.weight",
            "attn_k_norm.weight",
        ),
    }
    # Qwen 2 files may lack the biases' zero entries for K or V; everything else is required.
    optional = extra["qwen2"] if arch == "qwen2" else ()
    required = norms + projections + (extra.get(arch, ()) if arch != "qwen2" else ())
    return required, optional


class _LayersFromGguf(Sequence[LlamaLayerWeights]):
    """The decoder layers, decoded from the memory-mapped file when accessed.

    Holding every layer decoded would take several times the file's size in memory; the graph
    builder visits each layer once (and the next one's norm), so the last two are kept.
    """

    def __init__(self, config: LlamaConfig, arch: str, tensors: dict[str, ReaderTensor]) -> None:
        self._config = config
        self._arch = arch
        self._tensors = tensors
        self._recent: dict[int, LlamaLayerWeights] = {}
        required, optional = _tensor_names(arch)
        known = set(required) | set(optional)
        # Checked up front, so a file the graph cannot express fails before any work is done.
        for i in range(config.num_layers):
            for name in required:
                _tensor(tensors, f"blk.{i}.{name}")
        prefixes = tuple(f"blk.{i}." for i in range(config.num_layers))
        for name in tensors:
            if name.startswith("blk."):
                layer, _, rest = name[4:].partition(".")
                if not (layer.isdigit() and f"blk.{layer}." in prefixes and rest in known):
                    raise UnsupportedModelError(
                        f"tensor {name} is not part of the {arch} architecture as supported here"
                    )
        _check_shapes(config, arch, tensors)

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
        cfg, arch = self._config, self._arch

        def tensor(name: str) -> ReaderTensor:
            return _tensor(self._tensors, f"blk.{i}.{name}")

        def optional_vector(name: str) -> F32 | None:
            found = self._tensors.get(f"blk.{i}.{name}")
            return None if found is None else _vector(found)

        if arch == "phi3":
            qkv = _linear(tensor("attn_qkv.weight"))
            q_end, k_end = cfg.q_size, cfg.q_size + cfg.kv_size
            q_proj, k_proj, v_proj = (
                _rows(qkv, 0, q_end),
                _rows(qkv, q_end, k_end),
                _rows(qkv, k_end, k_end + cfg.kv_size),
            )
            gate_up = _linear(tensor("ffn_up.weight"))
            gate_proj = _rows(gate_up, 0, cfg.intermediate_size)
            up_proj = _rows(gate_up, cfg.intermediate_size, 2 * cfg.intermediate_size)
        else:
            q_proj, k_proj, v_proj = (_linear(tensor(f"attn_{p}.weight")) for p in "qkv")
            gate_proj, up_proj = _linear(tensor("ffn_gate.weight")), _linear(tensor("ffn_up.weight"))
        if arch in PERMUTED_ROTARY:
            q_proj = _rotary_rows_to_half_order(q_proj, cfg.num_heads, cfg.head_size)
            k_proj = _rotary_rows_to_half_order(k_proj, cfg.num_kv_heads, cfg.head_size)
        return LlamaLayerWeights(
            attn_norm=_vector(tensor("attn_norm.weight")),
            q_proj=q_proj,
            k_proj=k_proj,
            v_proj=v_proj,
            o_proj=_linear(tensor("attn_output.weight")),
            ffn_norm=_vector(tensor("ffn_norm.weight")),
            gate_proj=gate_proj,
            up_proj=up_proj,
            down_proj=_linear(tensor("ffn_down.weight")),
            q_bias=optional_vector("attn_q.bias"),
            k_bias=optional_vector("attn_k.bias"),
            v_bias=optional_vector("attn_v.bias"),
            q_norm=optional_vector("attn_q_norm.weight"),
            k_norm=optional_vector("attn_k_norm.weight"),
            post_attn_norm=optional_vector("post_attention_norm.weight"),
            post_ffn_norm=optional_vector("post_ffw_norm.weight"),
        )


# Architectures whose GGUF conversion permuted Q and K rows into llama.cpp's interleaved order.
PERMUTED_ROTARY = ("llama", "mistral")


def _rows(weight: LinearWeight, start: int, stop: int) -> LinearWeight:
    if isinstance(weight, np.ndarray):
        return np.ascontiguousarray(weight[start:stop])
    return weight.take_rows(np.arange(start, stop))


def _check_shapes(config: LlamaConfig, arch: str, tensors: dict[str, ReaderTensor]) -> None:
    """Every tensor's shape against the metadata, so a header that lies fails before any work."""
    h, q, kv, ff = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    # GGUF lists the fastest-varying dimension first: [in, out] for a [out, in] matrix.
    expected: dict[str, tuple[int, ...]] = {
        "attn_norm.weight": (h,),
        "ffn_norm.weight": (h,),
        "post_attention_norm.weight": (h,),
        "post_ffw_norm.weight": (h,),
        "attn_q.weight": (h, q),
        "attn_k.weight": (h, kv),
        "attn_v.weight": (h, kv),
        "attn_qkv.weight": (h, q + 2 * kv),
        "attn_output.weight": (q, h),
        "ffn_gate.weight": (h, ff),
        "ffn_up.weight": (h, 2 * ff) if arch == "phi3" else (h, ff),
        "ffn_down.weight": (ff, h),
        "attn_q.bias": (q,),
        "attn_k.bias": (kv,),
        "attn_v.bias": (kv,),
        "attn_q_norm.weight": (config.head_size,),
        "attn_k_norm.weight": (config.head_size,),
    }
    whole: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (h, config.vocab_size),
        "output.weight": (h, config.vocab_size),
        "output_norm.weight": (h,),
    }
    for name, tensor in tensors.items():
        want = expected.get(name.split(".", 2)[-1]) if name.startswith("blk.") else whole.get(name)
        got = tuple(int(n) for n in tensor.shape)
        if want is not None and got != want:
            raise UnsupportedModelError(
                f"tensor {name} has shape {list(got)}, but the file's metadata implies {list(want)}"
            )


def _read_weights(config: LlamaConfig, arch: str, tensors: dict[str, ReaderTensor]) -> LlamaWeights:
    return LlamaWeights(
        embed_tokens=_linear(_tensor(tensors, "token_embd.weight")),
        layers=_LayersFromGguf(config, arch, tensors),
        final_norm=_vector(_tensor(tensors, "output_norm.weight")),
        lm_head=_linear(tensors["output.weight"]) if "output.weight" in tensors else None,
        rope_freq_factors=_vector(tensors["rope_freqs.weight"]) if "rope_freqs.weight" in tensors else None,
    )


def _read_vocabulary(fields: _Fields) -> GgufVocabulary:
    def optional_id(key: str) -> int | None:
        value = fields.get(key)
        return None if value is None else int(value)

    tokens = [str(t) for t in fields.require("tokenizer.ggml.tokens")]
    token_types = [int(t) for t in fields.get("tokenizer.ggml.token_type", [])]
    return GgufVocabulary(
        model=str(fields.require("tokenizer.ggml.model")),
        pre=str(fields.get("tokenizer.ggml.pre", "default")),
        tokens=tokens,
        token_types=token_types,
        merges=[str(m) for m in fields.get("tokenizer.ggml.merges", [])],
        bos_token_id=optional_id("tokenizer.ggml.bos_token_id"),
        eos_token_id=optional_id("tokenizer.ggml.eos_token_id"),
        eot_token_id=optional_id("tokenizer.ggml.eot_token_id"),
        pad_token_id=optional_id("tokenizer.ggml.padding_token_id"),
        unknown_token_id=optional_id("tokenizer.ggml.unknown_token_id"),
        add_bos_token=bool(fields.get("tokenizer.ggml.add_bos_token", False)),
        add_eos_token=bool(fields.get("tokenizer.ggml.add_eos_token", False)),
        chat_template=fields.get("tokenizer.chat_template"),
        scores=[float(x) for x in scores]
        if (scores := fields.get("tokenizer.ggml.scores")) is not None
        else None,
        add_space_prefix=bool(fields.get("tokenizer.ggml.add_space_prefix", True)),
        strip_after=strip_after_tokens(str(fields.get("general.name", "")), tokens, token_types),
    )

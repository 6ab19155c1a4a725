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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal, overload

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from numpy.typing import NDArray

from tokenwire.server.model_tools.convert.errors import CorruptGgufError, UnsupportedModelError
from tokenwire.server.model_tools.convert.gguf_file import GgufTensor, open_gguf
from tokenwire.server.model_tools.convert.gguf_metadata import GgufMetadata
from tokenwire.server.model_tools.convert.gguf_tokenizer import GgufVocabulary, strip_after_tokens
from tokenwire.server.model_tools.convert.llama_model import (
    LinearWeight,
    LlamaConfig,
    LlamaLayerWeights,
    LlamaWeights,
)
from tokenwire.server.model_tools.convert.quantized import can_repack, decode_gguf_blocks

F32 = NDArray[np.float32]

LLAMA_LAYER_TENSORS: tuple[str, ...] = (
    "attn_norm.weight",
    "ffn_norm.weight",
    "attn_q.weight",
    "attn_k.weight",
    "attn_v.weight",
    "attn_output.weight",
    "ffn_gate.weight",
    "ffn_up.weight",
    "ffn_down.weight",
)
"""A Llama layer's tensors, without the `blk.N.` prefix; each family's differ from these."""
FUSED_LAYER_TENSORS: tuple[str, ...] = (
    "attn_norm.weight",
    "ffn_norm.weight",
    "attn_qkv.weight",
    "attn_output.weight",
    "ffn_up.weight",
    "ffn_down.weight",
)
"""The same with Q, K and V in one attn_qkv and the FFN's gate and up in one ffn_up (Phi-3)."""
QKV_BIASES = ("attn_q.bias", "attn_k.bias", "attn_v.bias")
QK_NORMS = ("attn_q_norm.weight", "attn_k_norm.weight")
POST_NORMS = ("post_attention_norm.weight", "post_ffw_norm.weight")


@dataclass(frozen=True)
class Family:
    """What one architecture's GGUF files mean beyond Llama's: every per-family fact, in one place."""

    activation: Literal["silu", "gelu_tanh"] = "silu"
    """The gated FFN's activation."""
    scales_embeddings: bool = False
    """The embeddings are multiplied by sqrt(hidden_size) before the first layer (Gemma)."""
    permuted_rotary: bool = False
    """GGUF's conversion permuted Q and K rows into llama.cpp's interleaved rotary order, which is
    undone here; the other families keep Hugging Face's rotate-half order ("NEOX" in llama.cpp)."""
    fused_projections: bool = False
    """attn_qkv holds Q, K and V, and ffn_up holds the gate then up (Phi-3)."""
    qkv_biases: bool = False
    """Q, K and V carry biases, any of which a file may leave out (Qwen 2)."""
    qk_norms: bool = False
    """Each head of Q and K is RMS-normalized before rotary (Qwen 3, Gemma 3)."""
    post_norms: bool = False
    """The attention and FFN outputs are normalized before the residual add (Gemma)."""
    default_window: int = 0
    """attention.sliding_window when the file gives none (0: full attention)."""
    trusts_window: bool = True
    """False: the file's sliding window is ignored, as llama.cpp ignores Phi-3's."""
    global_every: int = 0
    """Without attention.sliding_window_pattern, every n-th layer attends globally and the
    others slide (llama.cpp's default pattern); 0: every layer slides when there is a window."""
    local_rope_base: bool = False
    """The sliding layers have their own rotary base, rope.freq_base_swa (Gemma 3)."""
    attention_softcap: bool = False
    """attn_logit_softcapping caps the attention scores (Gemma 2)."""
    query_scale_layers: int | None = None
    """The layer count of the one size (the 27B Gemmas) that scales queries by hidden / heads
    instead of head_size (their query_pre_attn_scalar, which llama.cpp derives the same way)."""

    def layer_tensors(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(required, optional) tensor names of a layer, without the `blk.N.` prefix."""
        required = FUSED_LAYER_TENSORS if self.fused_projections else LLAMA_LAYER_TENSORS
        required += (POST_NORMS if self.post_norms else ()) + (QK_NORMS if self.qk_norms else ())
        return required, QKV_BIASES if self.qkv_biases else ()


_GEMMA = Family(activation="gelu_tanh", scales_embeddings=True, post_norms=True)
FAMILIES: dict[str, Family] = {
    "llama": Family(permuted_rotary=True),
    "mistral": Family(permuted_rotary=True),
    "qwen2": Family(qkv_biases=True),
    "qwen3": Family(qk_norms=True),
    "gemma2": replace(
        _GEMMA, default_window=4096, global_every=2, attention_softcap=True, query_scale_layers=46
    ),
    "gemma3": replace(_GEMMA, qk_norms=True, global_every=6, local_rope_base=True, query_scale_layers=62),
    "phi3": Family(fused_projections=True, trusts_window=False),
}
"""The architectures whose GGUF tensors the graph builder can express, by general.architecture."""
SUPPORTED_ARCHITECTURES = tuple(FAMILIES)


@dataclass(frozen=True)
class GgufModel:
    name: str
    architecture: str
    config: LlamaConfig
    weights: LlamaWeights
    vocabulary: GgufVocabulary
    tensor_types: dict[str, int]  # GGML type name -> number of tensors, for reports


MAX_CONTEXT_POSITIONS = 1 << 17
"""Longest context a conversion keeps (131,072, the longest of the supported families' releases).
The graph holds rotary tables for every position (64 MiB at head size 128), so a file declaring
more is converted with this many."""
MAX_VOCABULARY = 1 << 19
"""Most tokens a vocabulary may have (524,288: twice Gemma's 262,144)."""
MAX_MERGES = 1 << 20
"""Most byte-level BPE merges (1,048,576: Llama 3 has 280,147)."""


def read_gguf(path: Path) -> GgufModel:
    """The model in `path`, every metadata value checked against its range and the tensors present
    before anything is allocated from it. Raises ConversionError naming the key or tensor."""
    gguf = open_gguf(path)
    fields = GgufMetadata(gguf.fields)
    arch = _architecture(fields)
    family = FAMILIES[arch]
    tensors = {t.name: t for t in gguf.tensors}
    if "token_embd.weight" not in tensors:
        raise UnsupportedModelError("GGUF file lacks tensor token_embd.weight")
    config = _read_config(fields, arch, family, tensors)
    weights = _read_weights(config, arch, family, tensors)
    counts: dict[str, int] = {}
    for t in gguf.tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return GgufModel(
        name=fields.text("general.name", path.stem),
        architecture=arch,
        config=config,
        weights=weights,
        vocabulary=_read_vocabulary(fields, config.vocab_size),
        tensor_types=counts,
    )


def gguf_architecture(path: Path) -> str:
    """The family of the model in `path` (its general.architecture), read from the header alone,
    so a choice that depends on it is checked before any conversion work. Raises ConversionError
    for a file that is no GGUF or of an architecture the converter does not serve."""
    return _architecture(GgufMetadata(open_gguf(path).fields))


def _architecture(fields: GgufMetadata) -> str:
    arch = fields.text("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    return arch


def _layers_present(tensors: dict[str, GgufTensor]) -> int:
    """One more than the highest layer index among the blk.N tensors (0 when there are none)."""
    indices = [name[4:].partition(".")[0] for name in tensors if name.startswith("blk.")]
    return max((int(i) + 1 for i in indices if i.isdigit() and len(i) < 10), default=0)


def _read_config(
    fields: GgufMetadata, arch: str, family: Family, tensors: dict[str, GgufTensor]
) -> LlamaConfig:
    embedding = tensors["token_embd.weight"].shape
    if len(embedding) != 2:
        raise UnsupportedModelError(
            f"tensor token_embd.weight has shape {list(embedding)}, not [hidden, vocabulary]"
        )
    # Sizes are bounded by the tensors they describe, before anything is sized by them.
    hidden = fields.integer(f"{arch}.embedding_length", minimum=1)
    if hidden != embedding[0]:
        raise CorruptGgufError(
            f"GGUF metadata {arch}.embedding_length is {hidden}, but token_embd.weight has rows of "
            f"{embedding[0]}"
        )
    layers = fields.integer(f"{arch}.block_count", minimum=1)
    present = _layers_present(tensors)
    if layers > present:
        raise CorruptGgufError(
            f"GGUF metadata {arch}.block_count is {layers}, but the file holds tensors for {present} layers"
        )
    heads = fields.integer(f"{arch}.attention.head_count", minimum=1, maximum=hidden)
    kv_heads = fields.integer(f"{arch}.attention.head_count_kv", heads, minimum=1, maximum=heads)
    if heads % kv_heads:
        raise CorruptGgufError(
            f"GGUF metadata {arch}.attention.head_count ({heads}) is not a multiple of "
            f"{arch}.attention.head_count_kv ({kv_heads})"
        )
    head_size = fields.integer(f"{arch}.attention.key_length", hidden // heads, minimum=2, maximum=hidden)
    if head_size % 2:
        raise CorruptGgufError(f"the head size is {head_size}: rotary embeddings need an even one")
    rotary_dim = fields.integer(f"{arch}.rope.dimension_count", head_size)
    if rotary_dim != head_size:
        raise UnsupportedModelError(
            f"partial rotary embeddings ({rotary_dim} of {head_size}) are not supported"
        )
    scaling = fields.optional_text(f"{arch}.rope.scaling.type")
    linear_scale = 1.0
    if scaling == "linear":
        linear_scale = fields.number(f"{arch}.rope.scaling.factor", 1.0, positive=True)
    elif scaling not in (None, "none"):
        raise UnsupportedModelError(
            f"rope scaling {scaling!r} is not supported (supported: none, linear, frequency factors)"
        )
    if "rope_factors_long.weight" in tensors or "rope_factors_short.weight" in tensors:
        raise UnsupportedModelError("Phi-3 longrope scaling (rope_factors_long/short) is not supported")
    # Its agreement with token_embd.weight is checked with every other tensor's shape.
    vocab_size = fields.integer(f"{arch}.vocab_size", 0) or embedding[1]
    window = fields.integer(f"{arch}.attention.sliding_window", family.default_window)
    if not family.trusts_window:
        # llama.cpp runs such a family with full attention, and so does this conversion, to give
        # the same tokens.
        window = 0
    sliding = _sliding_layers(fields, f"{arch}.attention.sliding_window_pattern", family, layers)
    attention_scale = None
    if layers == family.query_scale_layers:
        attention_scale = 1.0 / float(np.sqrt(hidden / heads))
    local_theta = None
    if family.local_rope_base and window > 0:
        local_theta = fields.number(f"{arch}.rope.freq_base_swa", 10000.0, positive=True)
    context = fields.integer(f"{arch}.context_length", minimum=1)
    return LlamaConfig(
        num_layers=layers,
        hidden_size=hidden,
        intermediate_size=fields.integer(f"{arch}.feed_forward_length", minimum=1),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_size=head_size,
        vocab_size=vocab_size,
        context_length=min(context, MAX_CONTEXT_POSITIONS),
        rope_theta=fields.number(f"{arch}.rope.freq_base", 10000.0, positive=True),
        rms_norm_eps=fields.number(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5, positive=True),
        embedding_scale=float(np.sqrt(hidden)) if family.scales_embeddings else 1.0,
        activation=family.activation,
        attention_scale=attention_scale,
        attention_softcap=fields.number(f"{arch}.attn_logit_softcapping", 0.0)
        if family.attention_softcap
        else 0.0,
        final_logit_softcap=fields.number(f"{arch}.final_logit_softcapping", 0.0),
        sliding_window=window,
        sliding_layers=sliding if window > 0 else (),
        local_rope_theta=local_theta,
        rope_linear_scale=linear_scale,
    )


def _float_array(tensor: GgufTensor) -> F32:
    values = dequantize(np.asarray(tensor.data), GGMLQuantizationType(tensor.tensor_type))
    return np.asarray(values, dtype=np.float32)


def _vector(tensor: GgufTensor) -> F32:
    return _float_array(tensor).reshape(-1)


def _linear(tensor: GgufTensor) -> LinearWeight:
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


def _tensor(tensors: dict[str, GgufTensor], name: str) -> GgufTensor:
    if name not in tensors:
        raise UnsupportedModelError(f"GGUF file lacks tensor {name}")
    return tensors[name]


class _LayersFromGguf(Sequence[LlamaLayerWeights]):
    """The decoder layers, decoded from the memory-mapped file when accessed.

    Holding every layer decoded would take several times the file's size in memory; the graph
    builder visits each layer once (and the next one's norm), so the last two are kept.
    """

    def __init__(
        self, config: LlamaConfig, arch: str, family: Family, tensors: dict[str, GgufTensor]
    ) -> None:
        self._config = config
        self._family = family
        self._tensors = tensors
        self._recent: dict[int, LlamaLayerWeights] = {}
        required, optional = family.layer_tensors()
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
        _check_shapes(config, family, tensors)

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
        cfg, family = self._config, self._family

        def tensor(name: str) -> GgufTensor:
            return _tensor(self._tensors, f"blk.{i}.{name}")

        def optional_vector(name: str) -> F32 | None:
            found = self._tensors.get(f"blk.{i}.{name}")
            return None if found is None else _vector(found)

        if family.fused_projections:
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
        if family.permuted_rotary:
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


PERMUTED_ROTARY = tuple(name for name, family in FAMILIES.items() if family.permuted_rotary)
"""Architectures whose GGUF conversion permuted Q and K rows into llama.cpp's interleaved order
(an adapter's B rows for Q and K come permuted the same way)."""


def _rows(weight: LinearWeight, start: int, stop: int) -> LinearWeight:
    if isinstance(weight, np.ndarray):
        return np.ascontiguousarray(weight[start:stop])
    return weight.take_rows(np.arange(start, stop))


def _check_shapes(config: LlamaConfig, family: Family, tensors: dict[str, GgufTensor]) -> None:
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
        "ffn_up.weight": (h, 2 * ff) if family.fused_projections else (h, ff),
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


def _read_weights(
    config: LlamaConfig, arch: str, family: Family, tensors: dict[str, GgufTensor]
) -> LlamaWeights:
    return LlamaWeights(
        embed_tokens=_linear(_tensor(tensors, "token_embd.weight")),
        layers=_LayersFromGguf(config, arch, family, tensors),
        final_norm=_vector(_tensor(tensors, "output_norm.weight")),
        lm_head=_linear(tensors["output.weight"]) if "output.weight" in tensors else None,
        rope_freq_factors=_vector(tensors["rope_freqs.weight"]) if "rope_freqs.weight" in tensors else None,
    )


def _sliding_layers(fields: GgufMetadata, key: str, family: Family, layers: int) -> tuple[bool, ...]:
    """Which layers slide: the file's list (one entry per layer), or every n-th layer global."""
    pattern = fields.numbers(key, exact_items=layers) if fields.is_array(key) else None
    if pattern is not None:
        return tuple(bool(p) for p in pattern.tolist())
    # Every n-th layer is global (n - 1 sliding, then one full): llama.cpp's default pattern.
    n = fields.integer(key, family.global_every)
    return tuple(n == 1 or i % n < n - 1 for i in range(layers)) if n > 0 else ()


def _read_vocabulary(fields: GgufMetadata, vocab_size: int) -> GgufVocabulary:
    """The tokenizer's vocabulary, no larger than the embedding it indexes (and MAX_VOCABULARY):
    counts are checked before any item is decoded."""
    key = "tokenizer.ggml.tokens"
    listed = fields.array(key, required=True)
    assert listed is not None
    if listed.count > vocab_size:
        raise CorruptGgufError(
            f"GGUF metadata {key} has {listed.count} tokens, but the model's embedding has {vocab_size} "
            "rows: the tokenizer is larger than the model"
        )
    if listed.count > MAX_VOCABULARY:
        raise UnsupportedModelError(
            f"GGUF metadata {key} has {listed.count} tokens, more than {MAX_VOCABULARY}"
        )
    tokens = listed.strings()
    count = len(tokens)
    types = fields.numbers("tokenizer.ggml.token_type", exact_items=count)
    token_types = [] if types is None else [int(t) for t in types.tolist()]
    scores = fields.numbers("tokenizer.ggml.scores", exact_items=count)
    if scores is not None and not np.isfinite(scores.astype(np.float64)).all():
        raise CorruptGgufError("GGUF metadata tokenizer.ggml.scores holds NaN or infinity")

    def token_id(name: str) -> int | None:
        # As llama.cpp does, a special token id outside the vocabulary is ignored.
        value = fields.integer(name, -1, minimum=-(1 << 63))
        return value if 0 <= value < count else None

    merges = fields.strings("tokenizer.ggml.merges", max_items=MAX_MERGES)
    name = fields.text("general.name", "")
    return GgufVocabulary(
        model=fields.text("tokenizer.ggml.model"),
        pre=fields.text("tokenizer.ggml.pre", "default"),
        tokens=tokens,
        token_types=token_types,
        merges=[] if merges is None else merges,
        bos_token_id=token_id("tokenizer.ggml.bos_token_id"),
        eos_token_id=token_id("tokenizer.ggml.eos_token_id"),
        eot_token_id=token_id("tokenizer.ggml.eot_token_id"),
        pad_token_id=token_id("tokenizer.ggml.padding_token_id"),
        unknown_token_id=token_id("tokenizer.ggml.unknown_token_id"),
        add_bos_token=fields.flag("tokenizer.ggml.add_bos_token", False),
        add_eos_token=fields.flag("tokenizer.ggml.add_eos_token", False),
        chat_template=fields.optional_text("tokenizer.chat_template"),
        scores=None if scores is None else [float(x) for x in scores.tolist()],
        add_space_prefix=fields.flag("tokenizer.ggml.add_space_prefix", True),
        strip_after=strip_after_tokens(name, tokens, token_types),
    )

"""Small Llama GGUF files written with the gguf package, so conversion is tested without a download.

Weights are random and stored in the GGUF tensor formats the converter handles (32-weight block
formats quantized by gguf.quants, K formats as random blocks with sane scales, float16, and a
2-bit K format that must fall back to float). The reference model is read back with
gguf.quants.dequantize and uses llama.cpp's interleaved rotary embeddings on the file's own
Q/K row order, so the converter's un-permutation is checked, not assumed.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from tokenizers import Tokenizer

from tests.server.model_tools.llama_reference import ReferenceLayer, ReferenceModel
from tokenwire.server.model_tools.convert import GraphOptions, build_llama_graph, convert_gguf, read_gguf
from tokenwire.server.model_tools.convert.llama_graph import save_model
from tokenwire.server.model_tools.convert.lora_graph import LoraOptions
from tokenwire.server.model_tools.tiny_tokenizer import (
    CHATML_TEMPLATE,
    END_OF_TEXT,
    SPECIAL_TOKENS,
    TURN_END,
    TURN_START,
    build_byte_level_tokenizer,
)

HIDDEN = 256  # a multiple of 256, so K formats' super-blocks fit
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS
INTERMEDIATE = 512
VOCAB = 512
CONTEXT = 128
ROPE_THETA = 10000.0
RMS_EPS = 1e-5

# Byte offsets of the float16 scale fields in each K format's super-block; the other bytes of a
# random block are valid codes and sub-block scales.
_K_SCALE_FIELDS = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.Q2_K: (80, 82)}
_K_SCALE_VALUE = {Q.Q4_K: 2e-4, Q.Q5_K: 1e-4, Q.Q6_K: 4e-5, Q.Q2_K: 1e-3}

# Per tensor: (layer 0, layer 1) formats. Layer 0 mixes layouts so Q/K/V and gate/up cannot be
# fused; layer 1 keeps them fusable. Q2_K has no repacking path and is dequantized to float.
MIXED_FORMATS = {
    "attn_q": (Q.Q4_1, Q.Q4_1),
    "attn_k": (Q.Q6_K, Q.Q4_1),
    "attn_v": (Q.Q8_0, Q.Q4_1),
    "attn_output": (Q.Q4_K, Q.F16),
    "ffn_gate": (Q.Q4_0, Q.Q5_K),
    "ffn_up": (Q.Q5_1, Q.Q5_K),
    "ffn_down": (Q.Q5_0, Q.Q2_K),
}


@dataclass(frozen=True)
class SyntheticGguf:
    path: Path
    reference: ReferenceModel
    tokenizer: Tokenizer  # the tokenizer whose vocabulary the file carries
    eos_token_id: int


def _random_k_blocks(rng: np.random.Generator, rows: int, cols: int, kind: Q) -> np.ndarray:
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, size=(rows, cols // block_elems, block_bytes), dtype=np.uint8)
    for offset in _K_SCALE_FIELDS[kind]:
        value = _K_SCALE_VALUE[kind] * (0.5 + rng.random((rows, cols // block_elems)))
        raw[..., offset : offset + 2] = (
            value.astype("<f2").view(np.uint8).reshape(rows, cols // block_elems, 2)
        )
    return raw.reshape(rows, -1)


def _stored(rng: np.random.Generator, rows: int, cols: int, kind: Q) -> np.ndarray:
    """The array to hand GGUFWriter for a [rows, cols] weight in format `kind`."""
    if kind in _K_SCALE_FIELDS:
        return _random_k_blocks(rng, rows, cols, kind)
    weights = (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)
    if kind == Q.F32:
        return weights
    if kind == Q.F16:
        return weights.astype(np.float16)
    return quantize(weights, kind)


def _as_float(stored: np.ndarray, kind: Q, rows: int, cols: int) -> np.ndarray:
    if kind in (Q.F32, Q.F16):
        return stored.astype(np.float64)
    return dequantize(stored, kind).astype(np.float64).reshape(rows, cols)


def tokenizer_vocabulary(tokenizer: Tokenizer) -> tuple[list[str], list[str], list[int]]:
    """Tokens in id order, merges as "left right" strings, and GGUF token types."""
    model = json.loads(tokenizer.to_str())["model"]
    by_id = sorted(tokenizer.get_vocab(with_added_tokens=True).items(), key=lambda item: item[1])
    tokens = [token for token, _ in by_id]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [3 if token in SPECIAL_TOKENS else 1 for token in tokens]
    return tokens, merges, types


# What each family adds to Llama in its GGUF files (llama.cpp's tensor and metadata names).
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")
WINDOW = 8  # shorter than the prompts the family tests run
# write_synthetic_gguf's arguments for each case the family tests cover: every family, sliding
# windows where the family has them, and Gemma 3 with only global layers.
FAMILY_CASES: dict[str, dict[str, object]] = {
    "llama": {},
    "mistral": {"arch": "llama", "sliding_window": WINDOW},
    "qwen2": {"arch": "qwen2"},
    "qwen3": {"arch": "qwen3"},
    "gemma2": {"arch": "gemma2", "sliding_window": WINDOW},
    "gemma3": {"arch": "gemma3", "sliding_window": WINDOW},
    "gemma3-global": {"arch": "gemma3"},
    "phi3": {"arch": "phi3"},
}
# Soft caps small enough to change the numbers of this random model (real Gemma 2: 50 and 30).
GEMMA2_ATTENTION_SOFTCAP = 1.0
GEMMA2_FINAL_SOFTCAP = 8.0
GEMMA3_GLOBAL_THETA = 1_000_000.0


def write_synthetic_gguf(
    path: Path,
    *,
    formats: dict[str, tuple[Q, Q]],
    embedding: Q = Q.Q8_0,
    head: Q | None = None,
    seed: int = 0,
    pre: str = "gpt2",
    tokenizer_model: str = "gpt2",
    arch: str = "llama",
    sliding_window: int = 0,
) -> SyntheticGguf:
    """A 2-layer GGUF of family `arch`; `head` None ties the output layer to the embedding.

    A `sliding_window` makes every layer slide (mistral), the even ones (gemma2), or layer 0
    with layer 1 global (gemma3, through an explicit pattern of 2).
    """
    rng = np.random.default_rng(seed)
    tokenizer = build_byte_level_tokenizer(VOCAB)
    tokens, merges, types = tokenizer_vocabulary(tokenizer)
    eos = tokens.index(TURN_END)
    gemma = arch in ("gemma2", "gemma3")

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"synthetic {arch}")
    writer.add_block_count(2)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    theta = GEMMA3_GLOBAL_THETA if arch == "gemma3" else ROPE_THETA
    writer.add_rope_freq_base(theta)
    if sliding_window:
        writer.add_sliding_window(sliding_window)
    if arch == "gemma3":
        writer.add_uint32(f"{arch}.attention.sliding_window_pattern", 2)
        writer.add_float32(f"{arch}.rope.freq_base_swa", ROPE_THETA)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(GEMMA2_ATTENTION_SOFTCAP)
        writer.add_final_logit_softcapping(GEMMA2_FINAL_SOFTCAP)
    writer.add_layer_norm_rms_eps(RMS_EPS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_vocab_size(VOCAB)
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokens.index(TURN_START))
    writer.add_eos_token_id(eos)
    writer.add_pad_token_id(tokens.index(END_OF_TEXT))
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML_TEMPLATE)

    def matrix(name: str, rows: int, cols: int, kind: Q) -> np.ndarray:
        stored = _stored(rng, rows, cols, kind)
        writer.add_tensor(name, stored, raw_dtype=None if kind in (Q.F32, Q.F16) else kind)
        return _as_float(stored, kind, rows, cols)

    def norm(name: str, size: int = HIDDEN) -> np.ndarray:
        gamma = (1.0 + 0.1 * rng.standard_normal(size)).astype(np.float32)
        writer.add_tensor(name, gamma)
        return gamma.astype(np.float64)

    def vector(name: str, size: int) -> np.ndarray:
        values = (0.1 * rng.standard_normal(size)).astype(np.float32)
        writer.add_tensor(name, values)
        return values.astype(np.float64)

    embed = matrix("token_embd.weight", VOCAB, HIDDEN, embedding)
    shapes = {
        "attn_q": (HEADS * HEAD_DIM, HIDDEN),
        "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
        "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN),
        "attn_output": (HIDDEN, HEADS * HEAD_DIM),
        "ffn_gate": (INTERMEDIATE, HIDDEN),
        "ffn_up": (INTERMEDIATE, HIDDEN),
        "ffn_down": (HIDDEN, INTERMEDIATE),
    }
    layers = []
    for layer in range(2):
        p = f"blk.{layer}."
        attn_norm = norm(p + "attn_norm.weight")
        if arch == "phi3":
            # One fused QKV and one fused gate-up tensor, in the Q and up formats.
            w = {
                key: matrix(p + key + ".weight", *shapes[key], formats[key][layer])
                for key in ("attn_output", "ffn_down")
            }
            qkv = matrix(
                p + "attn_qkv.weight", (HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN, formats["attn_q"][layer]
            )
            q_end, k_end = HEADS * HEAD_DIM, (HEADS + KV_HEADS) * HEAD_DIM
            w["attn_q"], w["attn_k"], w["attn_v"] = qkv[:q_end], qkv[q_end:k_end], qkv[k_end:]
            gate_up = matrix(p + "ffn_up.weight", 2 * INTERMEDIATE, HIDDEN, formats["ffn_up"][layer])
            w["ffn_gate"], w["ffn_up"] = gate_up[:INTERMEDIATE], gate_up[INTERMEDIATE:]
        else:
            w = {key: matrix(p + key + ".weight", *shapes[key], formats[key][layer]) for key in shapes}
        extra: dict[str, np.ndarray] = {}
        if arch == "qwen2":
            extra["q_bias"] = vector(p + "attn_q.bias", HEADS * HEAD_DIM)
            extra["k_bias"] = vector(p + "attn_k.bias", KV_HEADS * HEAD_DIM)
            extra["v_bias"] = vector(p + "attn_v.bias", KV_HEADS * HEAD_DIM)
        if arch in ("qwen3", "gemma3"):
            extra["q_norm"] = norm(p + "attn_q_norm.weight", HEAD_DIM)
            extra["k_norm"] = norm(p + "attn_k_norm.weight", HEAD_DIM)
        if gemma:
            extra["post_attn_norm"] = norm(p + "post_attention_norm.weight")
        ffn_norm = norm(p + "ffn_norm.weight")
        if gemma:
            extra["post_ffn_norm"] = norm(p + "post_ffw_norm.weight")
        layers.append(
            ReferenceLayer(
                **extra,
                attn_norm=attn_norm,
                q=w["attn_q"],
                k=w["attn_k"],
                v=w["attn_v"],
                o=w["attn_output"],
                ffn_norm=ffn_norm,
                gate=w["ffn_gate"],
                up=w["ffn_up"],
                down=w["ffn_down"],
            )
        )
    final_norm = norm("output_norm.weight")
    head_weights = embed if head is None else matrix("output.weight", VOCAB, HIDDEN, head)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reference = ReferenceModel(
        embed=embed,
        layers=layers,
        final_norm=final_norm,
        head=head_weights,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        rope_theta=theta,
        rms_norm_eps=RMS_EPS,
        # Only llama's conversion permutes Q/K rows for llama.cpp's interleaved rotary.
        rope_style="interleaved" if arch in ("llama", "mistral") else "half",
        embedding_scale=float(np.sqrt(HIDDEN)) if gemma else 1.0,
        activation="gelu_tanh" if gemma else "silu",
        attention_softcap=GEMMA2_ATTENTION_SOFTCAP if arch == "gemma2" else 0.0,
        final_logit_softcap=GEMMA2_FINAL_SOFTCAP if arch == "gemma2" else 0.0,
        sliding_window=sliding_window,
        sliding_layers={"gemma2": (True, False), "gemma3": (True, False)}.get(arch, ()),
        local_rope_theta=ROPE_THETA if arch == "gemma3" else None,
    )
    return SyntheticGguf(path=path, reference=reference, tokenizer=tokenizer, eos_token_id=eos)


def exact_model(gguf_path: Path, directory: Path, *, lora: LoraOptions | None = None) -> Path:
    """The file as a float32 graph with exact offsets (only float32 rounding separates it from the
    reference), optionally with LoRA sites, beside the converter's genai_config.json."""
    source = read_gguf(gguf_path)
    options = GraphOptions(accuracy_level=0, offsets="float", lora=lora)
    save_model(
        build_llama_graph(source.config, source.weights, options),
        directory / "model.onnx",
        external_data=False,
    )
    converted = convert_gguf(gguf_path, directory / "converted")
    shutil.copy(converted / "genai_config.json", directory)
    return directory

"""A deterministic tiny Llama in ONNX Runtime GenAI's layout, for tests that need no download.

It goes through the same graph builder as converted GGUF models (GroupQueryAttention over a
shared KV buffer, RMSNorm, SwiGLU), with float32 weights drawn from a seeded generator and the
project's small byte-level BPE tokenizer.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from tokenwire.server.model_tools.convert.genai_config import MODEL_FILENAME, TokenIds, write_genai_config
from tokenwire.server.model_tools.convert.llama_graph import GraphOptions, build_llama_graph, save_model
from tokenwire.server.model_tools.convert.llama_model import LlamaConfig, LlamaLayerWeights, LlamaWeights
from tokenwire.server.model_tools.convert.lora_graph import LoraOptions
from tokenwire.server.model_tools.tiny_tokenizer import (
    CHATML_TEMPLATE,
    END_OF_TEXT,
    TURN_END,
    build_byte_level_tokenizer,
    write_tokenizer_files,
)


def _token_id(tokenizer: Tokenizer, token: str) -> int:
    found = tokenizer.token_to_id(token)
    if found is None:
        raise ValueError(f"tokenizer lacks {token}")
    return int(found)


def tiny_llama_config(
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 512,
    context_length: int = 256,
) -> LlamaConfig:
    if hidden % heads:
        raise ValueError("hidden must be a multiple of heads")
    return LlamaConfig(
        num_layers=layers,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_size=hidden // heads,
        vocab_size=vocab,
        context_length=context_length,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
    )


def tiny_llama_weights(config: LlamaConfig, seed: int = 0) -> LlamaWeights:
    """Weights drawn from a generator seeded with `seed`.

    The head's scale spreads the logits over several units: with near-uniform logits, greedy
    decoding would hinge on rounding noise and tests comparing two paths would flake.
    """
    rng = np.random.default_rng(seed)
    h, i = config.hidden_size, config.intermediate_size

    def normal(shape: tuple[int, ...], std: float) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def norm_weight() -> np.ndarray:
        return (1.0 + normal((h,), 0.1)).astype(np.float32)

    layers = tuple(
        LlamaLayerWeights(
            attn_norm=norm_weight(),
            q_proj=normal((config.q_size, h), 1.0 / np.sqrt(h)),
            k_proj=normal((config.kv_size, h), 1.0 / np.sqrt(h)),
            v_proj=normal((config.kv_size, h), 1.0 / np.sqrt(h)),
            o_proj=normal((h, config.q_size), 1.0 / np.sqrt(config.q_size)),
            ffn_norm=norm_weight(),
            gate_proj=normal((i, h), 1.0 / np.sqrt(h)),
            up_proj=normal((i, h), 1.0 / np.sqrt(h)),
            down_proj=normal((h, i), 1.0 / np.sqrt(i)),
        )
        for _ in range(config.num_layers)
    )
    return LlamaWeights(
        embed_tokens=normal((config.vocab_size, h), 1.0),
        layers=layers,
        final_norm=norm_weight(),
        lm_head=normal((config.vocab_size, h), 3.0 / np.sqrt(h)),
    )


def create_tiny_llama(
    out_dir: Path,
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 512,
    context_length: int = 256,
    seed: int = 0,
    chat_template: bool = True,
    lora: LoraOptions | None = None,
) -> Path:
    """Write model.onnx, genai_config.json and tokenizer files of a tiny random Llama into `out_dir`.

    With `lora`, the graph takes per-row LoRA adapters on those projections (lora_graph.py).
    """
    config = tiny_llama_config(
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        vocab=vocab,
        context_length=context_length,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_byte_level_tokenizer(vocab)
    end_of_text, turn_end = _token_id(tokenizer, END_OF_TEXT), _token_id(tokenizer, TURN_END)
    weights = tiny_llama_weights(config, seed)
    graph = build_llama_graph(config, weights, GraphOptions(lora=lora))
    save_model(graph, out_dir / MODEL_FILENAME, external_data=False)
    write_genai_config(
        out_dir,
        config,
        TokenIds(bos=end_of_text, eos=[end_of_text, turn_end], pad=end_of_text),
        dtype="float32",
    )
    write_tokenizer_files(
        out_dir,
        tokenizer,
        bos_token=None,
        eos_token=END_OF_TEXT,
        chat_template=CHATML_TEMPLATE if chat_template else None,
    )
    return out_dir

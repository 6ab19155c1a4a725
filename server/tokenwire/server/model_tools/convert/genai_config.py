"""genai_config.json, in the layout ONNX Runtime GenAI's model builder writes for decoder models."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenwire.server.model_tools.convert.llama_model import LlamaConfig

MODEL_FILENAME = "model.onnx"
GENAI_CONFIG_FILENAME = "genai_config.json"


@dataclass(frozen=True)
class TokenIds:
    bos: int
    eos: list[int]  # first one is the model's own end-of-sequence token
    pad: int


def genai_config(
    config: LlamaConfig, token_ids: TokenIds, *, dtype: str, model_type: str = "llama"
) -> dict[str, Any]:
    if not token_ids.eos:
        raise ValueError("a model needs at least one end-of-sequence token")
    # GroupQueryAttention runs on CPU in float32 and on CUDA only in float16/bfloat16, so a
    # float16 export is meant for CUDA.
    provider_options: list[dict[str, dict[str, str]]] = [{"cuda": {}}] if dtype == "float16" else []
    return {
        "model": {
            "bos_token_id": token_ids.bos,
            "context_length": config.context_length,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": provider_options},
                "filename": MODEL_FILENAME,
                "head_size": config.head_size,
                "hidden_size": config.hidden_size,
                "inputs": {
                    "input_ids": "input_ids",
                    "attention_mask": "attention_mask",
                    "past_key_names": "past_key_values.%d.key",
                    "past_value_names": "past_key_values.%d.value",
                },
                "outputs": {
                    "logits": "logits",
                    "present_key_names": "present.%d.key",
                    "present_value_names": "present.%d.value",
                },
                "num_attention_heads": config.num_heads,
                "num_hidden_layers": config.num_layers,
                "num_key_value_heads": config.num_kv_heads,
            },
            "eos_token_id": token_ids.eos[0] if len(token_ids.eos) == 1 else list(token_ids.eos),
            "pad_token_id": token_ids.pad,
            "type": model_type,
            "vocab_size": config.vocab_size,
        },
        "search": {
            "diversity_penalty": 0.0,
            "do_sample": False,
            "early_stopping": True,
            "length_penalty": 1.0,
            "max_length": config.context_length,
            "min_length": 0,
            "no_repeat_ngram_size": 0,
            "num_beams": 1,
            "num_return_sequences": 1,
            # Past and present may be bound to one preallocated buffer (GroupQueryAttention).
            "past_present_share_buffer": True,
            "repetition_penalty": 1.0,
            "temperature": 1.0,
            "top_k": 50,
            "top_p": 1.0,
        },
    }


def write_genai_config(out_dir: Path, config: LlamaConfig, token_ids: TokenIds, *, dtype: str) -> Path:
    path = out_dir / GENAI_CONFIG_FILENAME
    path.write_text(json.dumps(genai_config(config, token_ids, dtype=dtype), indent=4))
    return path

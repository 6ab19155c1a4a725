"""Runs in the torch venv, after run.py's Gemma 3 family: what the tiny Gemma 3's distance from
its GGUF file is.

llama.cpp's convert_hf_to_gguf.py writes Gemma 3's sliding window but neither its layer pattern
nor its local rotary base, so llama.cpp (and tokenwire, which reads the file the same way) take
Gemma 3's defaults: every sixth layer global, local base 10000. The tiny model has two layers,
local then global; by the default pattern both are local. This prints the mean KL divergence from
transformers' next-token distributions to llama.cpp's F32 run of the file, along run.py's
sequence, with the model as built and with its global layer made local.

Usage: python gemma3_layer_pattern.py WORK/gemma3
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
import transformers


def mean_kl(reference: np.ndarray, other: np.ndarray) -> float:
    p = torch.log_softmax(torch.from_numpy(reference).double(), dim=-1)
    q = torch.log_softmax(torch.from_numpy(other).double(), dim=-1)
    return float((p.exp() * (p - q)).sum(-1).mean())


def main() -> None:
    model_dir = Path(sys.argv[1])
    result = json.loads((model_dir / "hf_result.json").read_text())
    sequence, prompt_len = result["prompt"] + result["tokens"], len(result["prompt"])
    gguf_logits = np.load(model_dir / "llamacpp_logits_F32.npy")[prompt_len - 1 : -1]
    built = transformers.AutoConfig.from_pretrained(model_dir)
    variants = {
        "as built": list(built.layer_types),
        "every layer local (the file's default pattern)": ["sliding_attention"] * len(built.layer_types),
    }
    for name, layer_types in variants.items():
        config = transformers.AutoConfig.from_pretrained(model_dir)
        config.layer_types = layer_types
        model = transformers.Gemma3ForCausalLM.from_pretrained(model_dir, config=config).eval()
        with torch.no_grad():
            logits = model(torch.tensor([sequence])).logits[0].float().numpy()[prompt_len - 1 : -1]
        row = {"transformers": name, "layer_types": layer_types, "kl_to_gguf": mean_kl(logits, gguf_logits)}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

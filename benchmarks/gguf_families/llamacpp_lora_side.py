"""Runs in llama-cpp-python's venv: llama.cpp's greedy tokens on a base GGUF alone and with a
GGUF LoRA adapter applied (llama.cpp's own adapter loading, scale 1).

Usage: python llamacpp_lora_side.py BASE_GGUF ADAPTER_GGUF PROMPT_JSON STEPS
Prints one JSON object: {"base": {"tokens", "gaps"}, "adapter": {"tokens", "gaps"}}.
"""

from __future__ import annotations

import json
import sys

import llama_cpp
from llamacpp_side import greedy


def main() -> None:
    base, adapter = sys.argv[1], sys.argv[2]
    prompt, steps = json.loads(sys.argv[3]), int(sys.argv[4])
    results = {}
    for name, lora in (("base", None), ("adapter", adapter)):
        llm = llama_cpp.Llama(base, lora_path=lora, n_ctx=128, n_threads=2, logits_all=True, verbose=False)
        tokens, gaps = greedy(llm, prompt, steps)
        results[name] = {"tokens": tokens, "gaps": gaps}
    print(json.dumps(results))


if __name__ == "__main__":
    main()

"""Runs in llama-cpp-python's venv: quantizes a GGUF with llama.cpp's own quantizer and prints
llama.cpp's greedy tokens, its logits along a given sequence and its tokenization of a text.

Usage: python llamacpp_side.py F32_GGUF OUT_DIR TYPES PROMPT_JSON STEPS SEQUENCE_JSON TEXT
"""

from __future__ import annotations

import ctypes
import json
import sys
from pathlib import Path

import llama_cpp
import numpy as np

FTYPES = {
    "F32": llama_cpp.LLAMA_FTYPE_ALL_F32,
    "F16": llama_cpp.LLAMA_FTYPE_MOSTLY_F16,
    "Q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0,
    "Q6_K": llama_cpp.LLAMA_FTYPE_MOSTLY_Q6_K,
    "Q5_K_M": llama_cpp.LLAMA_FTYPE_MOSTLY_Q5_K_M,
    "Q4_K_M": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M,
    "Q3_K_M": llama_cpp.LLAMA_FTYPE_MOSTLY_Q3_K_M,
    "Q2_K": llama_cpp.LLAMA_FTYPE_MOSTLY_Q2_K,
    "IQ4_NL": llama_cpp.LLAMA_FTYPE_MOSTLY_IQ4_NL,
    "IQ4_XS": llama_cpp.LLAMA_FTYPE_MOSTLY_IQ4_XS,
}


def quantize(source: Path, target: Path, kind: str) -> None:
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[kind]
    params.nthread = 2
    status = llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), ctypes.byref(params))
    if status != 0:
        raise SystemExit(f"quantizing to {kind} failed: {status}")


def greedy(llm: llama_cpp.Llama, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """llama.cpp's greedy tokens after `prompt`, and its top-2 logit gap at each step."""
    llm.reset()
    llm.eval(prompt)
    tokens, gaps = [], []
    for _ in range(steps):
        row = np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float64)
        top = np.argsort(row)[-2:]
        tokens.append(int(top[1]))
        gaps.append(float(row[top[1]] - row[top[0]]))
        llm.eval([int(top[1])])
    return tokens, gaps


def run(path: Path, prompt: list[int], steps: int, sequence: list[int], text: str) -> dict[str, object]:
    llm = llama_cpp.Llama(str(path), n_ctx=128, n_threads=2, logits_all=True, verbose=False)
    tokens, gaps = greedy(llm, prompt, steps)
    llm.reset()
    llm.eval(sequence)
    logits = np.asarray(llm.scores[: len(sequence)], dtype=np.float32)
    ids = llm.tokenize(text.encode(), add_bos=False, special=True)
    return {"tokens": tokens, "gaps": gaps, "logits": logits, "text_ids": ids}


def main() -> None:
    source, out_dir, kinds = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3].split(",")
    prompt, steps = json.loads(sys.argv[4]), int(sys.argv[5])
    sequence, text = json.loads(sys.argv[6]), sys.argv[7]
    results = {}
    for kind in kinds:
        path = source if kind == "F32" else out_dir / f"model-{kind}.gguf"
        if kind != "F32":
            quantize(source, path, kind)
        result = run(path, prompt, steps, sequence, text)
        np.save(out_dir / f"llamacpp_logits_{kind}.npy", result.pop("logits"))
        results[kind] = result
    (out_dir / "llamacpp_result.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()

"""tokenwire's GGUF conversion of each family against transformers and llama.cpp, on files made
by llama.cpp's own tools.

Per family: a tiny random-weight model built with transformers (hf_side.py, in a torch venv) is
exported with llama.cpp's convert_hf_to_gguf.py (F32) and quantized with llama.cpp's quantizer
(llamacpp_side.py, in llama-cpp-python's venv). Then, over STEPS greedy steps from one prompt:
- F32: tokenwire's greedy tokens against transformers', alone and as row 0 of a batch of 4;
- each quantized type: tokenwire's greedy tokens against llama.cpp's on the same file (at the
  first split, llama.cpp's top-2 logit gap there), and the mean KL divergence of tokenwire's and
  of llama.cpp's next-token distributions to transformers' float32 ones along the F32 sequence;
- the prompt text's token ids, tokenwire's tokenizer against llama.cpp's.

Usage (from the repository root, tokenwire's venv):
  python benchmarks/gguf_families/run.py --hf-python HFVENV/bin/python \\
      --llamacpp-python LLAMAVENV/bin/python --llamacpp-source LLAMA_CPP_DIR --work DIR
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from tests.server.model_tools.llama_reference import mean_kl
from tests.server.model_tools.shared_buffer_driver import SharedBufferDriver
from tokenwire.server.model_tools.convert import convert_gguf
from tokenwire.server.model_tools.tiny_tokenizer import (
    _CORPUS,
    CHATML_TEMPLATE,
    TURN_END,
    TURN_START,
    build_byte_level_tokenizer,
    write_tokenizer_files,
)

HERE = Path(__file__).parent
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")
TYPES = ("F32", "F16", "Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q3_K_M", "Q2_K", "IQ4_NL", "IQ4_XS")
STEPS = 32
TEXT = "<|im_start|>user\nHello, world! 1234 + 56 = 1290; déjà vu, 東京 😀 — ok?<|im_end|>\n"
GEMMA_TEXT = "<start_of_turn>user\nHello, world! 1234 + 56 = 1290; déjà vu, 東京 😀 — ok?<end_of_turn>\n"
# Phi-3's chat tokens strip the whitespace after them in llama.cpp: the newlines test that too.
PHI3_TEXT = "<|user|>\nHello, world! 1234 + 56 = 1290; déjà vu, 東京 😀 — ok?<|end|>\n<|assistant|>\n"
TEXTS = {"gemma2": GEMMA_TEXT, "gemma3": GEMMA_TEXT, "phi3": PHI3_TEXT}


def greedy(model_dir: Path, prompt: list[int], steps: int, batch: list[list[int]]) -> list[int]:
    """Row 0's greedy tokens, decoding alongside the other prompts of `batch` (each its own slot)."""
    prompts = [prompt, *batch]
    driver = SharedBufferDriver(model_dir, slots=len(prompts), max_len=len(prompt) + steps + 40, threads=2)
    nexts = [int(driver.prefill(slot, p)[-1].argmax()) for slot, p in enumerate(prompts)]
    tokens = [nexts[0]]
    for _ in range(steps - 1):
        rows = driver.decode(nexts)
        nexts = [int(r.argmax()) for r in rows]
        tokens.append(nexts[0])
    return tokens


def forced_logits(model_dir: Path, sequence: list[int]) -> np.ndarray:
    return SharedBufferDriver(model_dir, slots=1, max_len=len(sequence) + 1, threads=2).prefill(0, sequence)


def agreement(ours: list[int], theirs: list[int]) -> int:
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if a != b:
            return i
    return len(ours)


def family_rows(family: str, args: argparse.Namespace) -> list[dict[str, object]]:
    work = args.work / family
    work.mkdir(parents=True, exist_ok=True)
    tokenizer = build_byte_level_tokenizer(512)
    write_tokenizer_files(
        work, tokenizer, bos_token=TURN_START, eos_token=TURN_END, chat_template=CHATML_TEMPLATE
    )
    prompt_text = "The capital of France is Paris. Servers queue"
    prompt = tokenizer.encode(prompt_text).ids
    # Gemma's conversion needs a SentencePiece model, which hf_side.py trains on this corpus.
    (work / "corpus.txt").write_text(_CORPUS)
    (work / "prompt.txt").write_text(prompt_text)
    batch = [
        tokenizer.encode(t).ids for t in ("Hello, world!", "Numbers: 0 1 2 3", "A model reads tokens and")
    ]
    subprocess.run(
        [
            str(args.hf_python),
            str(HERE / "hf_side.py"),
            family,
            str(work),
            str(args.llamacpp_source),
            json.dumps(prompt),
            str(STEPS),
        ],
        check=True,
        capture_output=not args.verbose,
    )
    hf_result = json.loads((work / "hf_result.json").read_text())
    hf_tokens, prompt = hf_result["tokens"], hf_result["prompt"]
    hf_logits = np.load(work / "hf_logits.npy")
    sequence = prompt + hf_tokens
    text = TEXTS.get(family, TEXT)
    subprocess.run(
        [
            str(args.llamacpp_python),
            str(HERE / "llamacpp_side.py"),
            str(work / "model-f32.gguf"),
            str(work),
            ",".join(args.types),
            json.dumps(prompt),
            str(STEPS),
            json.dumps(sequence),
            text,
        ],
        check=True,
        capture_output=not args.verbose,
    )
    theirs = json.loads((work / "llamacpp_result.json").read_text())
    rows = []
    for kind in args.types:
        gguf = work / ("model-f32.gguf" if kind == "F32" else f"model-{kind}.gguf")
        started = time.perf_counter()
        model_dir = convert_gguf(gguf, work / f"tokenwire-{kind}")
        seconds = time.perf_counter() - started
        ours_alone = greedy(model_dir, prompt, STEPS, [])
        ours_busy = greedy(model_dir, prompt, STEPS, batch)
        lc = theirs[kind]
        split = agreement(ours_alone, lc["tokens"])
        ours_ids = (
            Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(text, add_special_tokens=False).ids
        )
        ours_kl = mean_kl(
            hf_logits[len(prompt) - 1 : -1], forced_logits(model_dir, sequence)[len(prompt) - 1 : -1]
        )
        lc_logits = np.load(work / f"llamacpp_logits_{kind}.npy")
        lc_kl = mean_kl(hf_logits[len(prompt) - 1 : -1], lc_logits[len(prompt) - 1 : -1])
        step_started = time.perf_counter()
        greedy(model_dir, prompt, STEPS, [])
        tok_s = STEPS / (time.perf_counter() - step_started)
        rows.append(
            {
                "family": family,
                "type": kind,
                "vs_transformers_alone": agreement(ours_alone, hf_tokens),
                "vs_transformers_busy": agreement(ours_busy, hf_tokens),
                "vs_llamacpp": split,
                "llamacpp_gap_at_split": None if split == STEPS else round(lc["gaps"][split], 4),
                "llamacpp_vs_transformers": agreement(lc["tokens"], hf_tokens),
                "kl_tokenwire": ours_kl,
                "kl_llamacpp": lc_kl,
                "prompt_ids_equal": ours_ids == lc["text_ids"],
                "convert_s": round(seconds, 2),
                "tok_s": round(tok_s, 1),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf-python", type=Path, required=True)
    parser.add_argument("--llamacpp-python", type=Path, required=True)
    parser.add_argument("--llamacpp-source", type=Path, required=True, help="llama.cpp's source tree")
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--types", type=lambda s: s.split(","), default=list(TYPES))
    parser.add_argument("--out", type=Path, default=HERE.parent / "results" / "gguf_families.json")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args()
    rows = []
    for family in args.families.split(","):
        try:
            rows += family_rows(family, args)
        except (subprocess.CalledProcessError, ValueError) as error:
            stderr = getattr(error, "stderr", b"") or b""
            print(
                json.dumps({"family": family, "error": str(error), "stderr": stderr.decode()[-1500:]}),
                flush=True,
            )
            rows.append({"family": family, "error": str(error)})
    args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

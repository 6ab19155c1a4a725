"""The sliding-window metadata llama.cpp's converter leaves out, added to its F32 file, against
transformers: after run.py has made a family's files under WORK.

- mistral: convert_hf_to_gguf.py writes a Mistral model as plain `llama` without its window, so
  `llama.attention.sliding_window` (the model's window) is added;
- gemma3: it writes the window but not the layer pattern, so the tiny model's own pattern (local,
  then global) is added as `gemma3.attention.sliding_window_pattern`.

The copy is converted by tokenwire and compared with transformers as run.py compares the F32
file: greedy tokens alone and as row 0 of a batch of 4, and the mean KL divergence along
transformers' greedy sequence; with --llamacpp-python, llama.cpp's run of the copy too.

Usage (from the repository root, tokenwire's venv):
  python benchmarks/gguf_families/with_window_metadata.py --work DIR [--llamacpp-python PY]
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from benchmarks.gguf_families.run import HERE, STEPS, TEXT, TEXTS, agreement, forced_logits, greedy
from tests.server.model_tools.llama_reference import mean_kl
from tokenwire.server.model_tools.convert import convert_gguf
from tokenwire.server.model_tools.tiny_tokenizer import build_byte_level_tokenizer

WINDOW = 8  # hf_side.py's (that module needs torch)
# family -> (key, value, type, array element type)
ADDED: dict[str, tuple[str, Any, GGUFValueType, GGUFValueType | None]] = {
    "mistral": ("llama.attention.sliding_window", WINDOW, GGUFValueType.UINT32, None),
    "gemma3": (
        "gemma3.attention.sliding_window_pattern",
        [True, False],
        GGUFValueType.ARRAY,
        GGUFValueType.BOOL,
    ),
}


def copy_with(source: Path, target: Path, key: str, value: Any, vtype: GGUFValueType, sub: Any) -> None:
    """The F32 file again with one more metadata key (its tensors are plain arrays)."""
    reader = GGUFReader(source)
    writer = GGUFWriter(target, arch=str(reader.fields["general.architecture"].contents()))
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        element = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], element)
    writer.add_key_value(key, value, vtype, sub)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def family_row(family: str, args: argparse.Namespace) -> dict[str, object]:
    work = args.work / family
    key, value, vtype, sub = ADDED[family]
    copy = work / "model-f32-with-window.gguf"
    copy_with(work / "model-f32.gguf", copy, key, value, vtype, sub)
    hf = json.loads((work / "hf_result.json").read_text())
    prompt, hf_tokens = hf["prompt"], hf["tokens"]
    sequence = prompt + hf_tokens
    hf_logits = np.load(work / "hf_logits.npy")[len(prompt) - 1 : -1]
    tokenizer = build_byte_level_tokenizer(512)
    batch = [
        tokenizer.encode(t).ids for t in ("Hello, world!", "Numbers: 0 1 2 3", "A model reads tokens and")
    ]
    model_dir = convert_gguf(copy, work / "tokenwire-with-window")
    row: dict[str, object] = {
        "family": family,
        "added": {key: value},
        "vs_transformers_alone": agreement(greedy(model_dir, prompt, STEPS, []), hf_tokens),
        "vs_transformers_busy": agreement(greedy(model_dir, prompt, STEPS, batch), hf_tokens),
        "kl_tokenwire": mean_kl(hf_logits, forced_logits(model_dir, sequence)[len(prompt) - 1 : -1]),
        "kl_tokenwire_without": mean_kl(
            hf_logits, forced_logits(work / "tokenwire-F32", sequence)[len(prompt) - 1 : -1]
        ),
    }
    if args.llamacpp_python is not None:
        out = work / "llamacpp-with-window"
        out.mkdir(exist_ok=True)
        subprocess.run(
            [
                str(args.llamacpp_python),
                str(HERE / "llamacpp_side.py"),
                str(copy),
                str(out),
                "F32",
                json.dumps(prompt),
                str(STEPS),
                json.dumps(sequence),
                TEXTS.get(family, TEXT),
            ],
            check=True,
            capture_output=True,
        )
        theirs = json.loads((out / "llamacpp_result.json").read_text())["F32"]
        row["llamacpp_vs_transformers"] = agreement(theirs["tokens"], hf_tokens)
        lc_logits = np.load(out / "llamacpp_logits_F32.npy")[len(prompt) - 1 : -1]
        row["kl_llamacpp"] = mean_kl(hf_logits, lc_logits)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", type=Path, required=True, help="run.py's --work")
    parser.add_argument("--families", default=",".join(ADDED))
    parser.add_argument("--llamacpp-python", type=Path)
    parser.add_argument("--out", type=Path, default=HERE.parent / "results" / "gguf_window_metadata.jsonl")
    args = parser.parse_args()
    rows = [family_row(family, args) for family in args.families.split(",")]
    for row in rows:
        print(json.dumps(row), flush=True)
    args.out.write_text("".join(json.dumps(row) + "\n" for row in rows))


if __name__ == "__main__":
    main()

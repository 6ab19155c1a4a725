"""llama.cpp in process (llama-cpp-python) on the GGUF file, one JSON command per stdin line.

Runs in a separate venv that has llama-cpp-python; only the standard library and llama_cpp are
imported here.

    python llama_worker.py GGUF_FILE THREADS
    {"op": "generate", "ids": [...], "new_tokens": 128}   # greedy, batch 1, EOS not honoured
"""

from __future__ import annotations

import importlib
import json
import sys
import time
from typing import Any

llama_cpp: Any
try:
    # Imported by name: this file is type-checked where llama-cpp-python is not installed.
    llama_cpp = importlib.import_module("llama_cpp")
except ImportError:  # reported to the driver, which skips these figures
    llama_cpp = None


def generate(model: Any, ids: list[int], new_tokens: int) -> dict[str, Any]:
    model.reset()
    began = time.perf_counter()
    stamps: list[float] = []
    # generate() never stops at end-of-sequence by itself: exactly new_tokens tokens are timed.
    for _ in model.generate(ids, top_k=1, temp=0.0, reset=True):
        stamps.append(time.perf_counter() - began)
        if len(stamps) == new_tokens:
            break
    return {"token_times": stamps}


def main() -> int:
    if llama_cpp is None:
        print(json.dumps({"error": "llama_cpp is not importable"}), flush=True)
        return 1
    threads = int(sys.argv[2])
    model = llama_cpp.Llama(
        model_path=sys.argv[1], n_ctx=1024, n_threads=threads, n_threads_batch=threads, verbose=False
    )
    for line in sys.stdin:
        command = json.loads(line)
        try:
            answer = generate(model, command["ids"], command["new_tokens"])
        except Exception as error:
            answer = {"error": repr(error)}
        print(json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

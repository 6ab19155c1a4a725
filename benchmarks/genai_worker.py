"""ONNX Runtime GenAI on the same ONNX file, driven by one JSON command per stdin line.

Runs in a separate venv that has onnxruntime-genai (never a dependency of tokenwire); only the
standard library, numpy and onnxruntime_genai are imported here.

    python genai_worker.py MODEL_DIR
    {"op": "generate", "ids": [...], "new_tokens": 128}         # Generator, batch 1, greedy
    {"op": "mixed", "prompts": [[...], ...], "new_tokens": 64}  # continuous-batching Engine
"""

from __future__ import annotations

import importlib
import json
import sys
import time
from typing import Any

import numpy as np

og: Any
try:
    # Imported by name: this file is type-checked where onnxruntime-genai is not installed.
    og = importlib.import_module("onnxruntime_genai")
except ImportError:  # reported to the driver, which skips these figures
    og = None


def generate(model: Any, ids: list[int], new_tokens: int) -> dict[str, Any]:
    params = og.GeneratorParams(model)
    length = len(ids) + new_tokens
    # min_length keeps end-of-sequence from cutting the run short: exactly new_tokens tokens.
    params.set_search_options(max_length=length, min_length=length, do_sample=False)
    generator = og.Generator(model, params)
    began = time.perf_counter()
    generator.append_tokens(np.asarray([ids], dtype=np.int32))
    stamps: list[float] = []
    while len(stamps) < new_tokens and not generator.is_done():
        generator.generate_next_token()
        stamps.append(time.perf_counter() - began)
    del generator
    return {"token_times": stamps}


class MixedWorkload:
    def __init__(self, model: Any) -> None:
        self.engine = og.Engine(model)
        self.buffer = self.engine.create_event_buffer(1024)

    def run(self, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
        began = time.perf_counter()
        requests = []
        for ids in prompts:
            request = self.engine.create_request()
            options = og.TurnOptions(request)
            options.set_max_generated_tokens(new_tokens)
            options.set_min_generated_tokens(new_tokens)
            options.set_do_sample(False)
            request.begin_turn(np.asarray(ids, dtype=np.int32), options)
            requests.append(request)
        first: dict[int, float] = {}
        last: dict[int, float] = {}
        counts: dict[int, int] = {}
        while self.engine.has_pending_requests():
            for event in self.engine.run(self.buffer):
                if not event.flags & og.EngineEventFlags.TOKEN:
                    continue
                now = time.perf_counter() - began
                index = next(i for i, r in enumerate(requests) if r == event.request)
                first.setdefault(index, now)
                last[index] = now
                counts[index] = counts.get(index, 0) + 1
        total = time.perf_counter() - began
        for request in requests:
            request.close()
        order = range(len(prompts))
        return {
            "total": total,
            "first_token": [first.get(i) for i in order],
            "finished": [last.get(i) for i in order],
            "tokens": [counts.get(i, 0) for i in order],
        }


def main() -> int:
    if og is None:
        print(json.dumps({"error": "onnxruntime_genai is not importable"}), flush=True)
        return 1
    model = og.Model(sys.argv[1])
    mixed: MixedWorkload | None = None
    for line in sys.stdin:
        command = json.loads(line)
        try:
            if command["op"] == "generate":
                answer = generate(model, command["ids"], command["new_tokens"])
            elif command["op"] == "mixed":
                mixed = mixed or MixedWorkload(model)
                answer = mixed.run(command["prompts"], command["new_tokens"])
            else:
                answer = {"error": f"unknown op {command['op']}"}
        except Exception as error:
            answer = {"error": repr(error)}
        print(json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

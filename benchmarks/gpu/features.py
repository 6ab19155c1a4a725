"""The engine's features where the model runs: checked on `--device cuda` (the KV cache in CUDA
memory, its rows moved by ONNX Runtime), and on `--device cpu` by the same code.

Greedy, end-of-sequence ignored, so every output has a fixed length and a reference:
- batch: 8 prompts streamed together; each against the same prompt generated alone;
- prefix cache: one 600-token prompt twice; the second reuses the first's KV rows (copied
  device to device), its tokens against the first's, its TTFT against the first's;
- n: one prompt with n = 4; every completion against the prompt alone (the prompt's rows forked
  to 4 slots, not prefilled 4 times);
- preemption: a 2-slot server, two long BATCH generations, then an INTERACTIVE one: one long
  generation is swapped out (its rows copied aside) and resumed; all three against alone.

Prints one JSON object (also to --json) with, per check, tokens equal to the reference before the
first difference, and the server's own counts (cached prompt tokens, preemptions).

    python benchmarks/gpu/features.py MODEL_DIR [--device cuda] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import benchkit
import grpc

from tokenwire.v1 import inference_service_pb2 as pb
from tokenwire.v1 import inference_service_pb2_grpc as pb_grpc

NEW_TOKENS = 64
LONG_TOKENS = 160


def request(ids: list[int], new_tokens: int, **fields: Any) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=ids),
        sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingCriteria(max_new_tokens=new_tokens, ignore_eos=True),
        **fields,
    )


def agreement(tokens: list[int], reference: list[int]) -> int:
    """Tokens equal to the reference before the first difference."""
    same = 0
    for mine, theirs in zip(tokens, reference, strict=False):
        if mine != theirs:
            break
        same += 1
    return same


def seconds(duration: Any) -> float:
    return float(duration.seconds + duration.nanos / 1e9)


async def alone(stub: pb_grpc.InferenceServiceStub, ids: list[int], new_tokens: int) -> list[int]:
    response = await stub.Generate(request(ids, new_tokens))
    return list(response.token_ids)


async def streamed_until_first_token(
    stub: pb_grpc.InferenceServiceStub, ids: list[int], new_tokens: int, started: asyncio.Event, **fields: Any
) -> list[int]:
    """Streams one generation; sets `started` at its first token."""
    tokens: list[int] = []

    async def requests() -> Any:
        yield pb.StreamGenerateRequest(generate=request(ids, new_tokens, request_id="long", **fields))
        await done.wait()

    done = asyncio.Event()
    call = stub.StreamGenerate(requests())
    async for message in call:
        if message.HasField("chunk"):
            tokens.extend(message.chunk.token_ids)
            started.set()
        if message.HasField("error"):
            raise RuntimeError(f"stream failed: {message.error.message}")
        if message.HasField("completed"):
            break
    done.set()
    return tokens


def preemptions(metrics_port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    return sum(float(m) for m in re.findall(r"^tokenwire_engine_preemptions\w*\{[^}]*\} (\S+)$", text, re.M))


async def batch_prefix_and_n(target: str, model: Path) -> dict[str, Any]:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.InferenceServiceStub(channel)
        prompts = [benchkit.prompt_ids(model, 100, offset=7 * i) for i in range(8)]
        references = [await alone(stub, ids, NEW_TOKENS) for ids in prompts]
        batched = await asyncio.gather(*(alone(stub, ids, NEW_TOKENS) for ids in prompts))
        long_prompt = benchkit.prompt_ids(model, 600, offset=3)
        cold = await stub.Generate(request(long_prompt, NEW_TOKENS))
        warm = await stub.Generate(request(long_prompt, NEW_TOKENS))
        forked = await stub.Generate(request(prompts[0], NEW_TOKENS, n=4))
    return {
        "batch_of_8": {
            "equal_tokens": [agreement(b, r) for b, r in zip(batched, references, strict=True)],
            "of": NEW_TOKENS,
        },
        "prefix_cache": {
            "cold_cached_prompt_tokens": cold.usage.cached_prompt_tokens,
            "warm_cached_prompt_tokens": warm.usage.cached_prompt_tokens,
            "prompt_tokens": warm.usage.prompt_tokens,
            "equal_tokens": agreement(list(warm.token_ids), list(cold.token_ids)),
            "of": NEW_TOKENS,
            "cold_ttft_s": seconds(cold.timing.time_to_first_token),
            "warm_ttft_s": seconds(warm.timing.time_to_first_token),
        },
        "n_4": {
            "equal_tokens": [agreement(list(c.token_ids), references[0]) for c in forked.choices],
            "of": NEW_TOKENS,
        },
    }


async def preemption(target: str, model: Path, metrics_port: int) -> dict[str, Any]:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.InferenceServiceStub(channel)
        long_prompts = [benchkit.prompt_ids(model, 100, offset=11 * i) for i in range(2)]
        urgent_prompt = benchkit.prompt_ids(model, 50, offset=40)
        references = [await alone(stub, ids, LONG_TOKENS) for ids in long_prompts]
        urgent_reference = await alone(stub, urgent_prompt, NEW_TOKENS)
        before = preemptions(metrics_port)
        started = [asyncio.Event(), asyncio.Event()]
        long_runs = [
            asyncio.ensure_future(
                streamed_until_first_token(stub, ids, LONG_TOKENS, event, priority=pb.PRIORITY_BATCH)
            )
            for ids, event in zip(long_prompts, started, strict=True)
        ]
        await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 120)
        urgent = await stub.Generate(request(urgent_prompt, NEW_TOKENS, priority=pb.PRIORITY_INTERACTIVE))
        long_tokens = await asyncio.gather(*long_runs)
        after = preemptions(metrics_port)
    return {
        "preemptions": after - before,
        "long_equal_tokens": [agreement(t, r) for t, r in zip(long_tokens, references, strict=True)],
        "long_of": LONG_TOKENS,
        "urgent_equal_tokens": agreement(list(urgent.token_ids), urgent_reference),
        "urgent_of": NEW_TOKENS,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model", type=Path)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    started = time.monotonic()
    results: dict[str, Any] = {"device": args.device}
    with benchkit.ServerProcess(args.model, max_batch_size=8, device=args.device) as server:
        results["kv_cache"] = server.kv_cache_line()
        results.update(asyncio.run(batch_prefix_and_n(server.target, args.model)))
    with benchkit.ServerProcess(
        args.model,
        max_batch_size=2,
        device=args.device,
        extra=("--metrics-port", "9464", "--batch-reserved-slots", "0"),
    ) as server:
        results["preemption"] = asyncio.run(preemption(server.target, args.model, 9464))
    results["seconds"] = round(time.monotonic() - started, 1)
    text = json.dumps(results, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()

"""n completions from one prefill: a request with n = 4 against one with n = 1, side by side.

One `tokenwire serve` (the default model, batch 8, 2 intra-op threads, prefix cache off, so no
prompt is answered from the cache), a 400-token prompt (its own tag first, so no two are alike),
sampled (temperature 0.8, a seed), 32 new tokens, streamed with GenerateStream. Each repetition
sends one request with n = 1 and one with n = 4, in an order that alternates. For each it records,
as the client sees them, the time to the first chunk (of any completion) and, for n = 4, to the
first chunk of every completion; the server's own time to first token; the whole request's
time; and the prompt tokens the model processed for it, read from the server's
`tokenwire_engine_prefilled_tokens_total` before and after. Medians over the repetitions;
ratios are n = 4 over n = 1 of the same repetitions.

    python benchmarks/n_completions.py [--repetitions 10]
"""

from __future__ import annotations

import argparse
import asyncio
import re
import time
import urllib.request
from typing import Any

import benchkit
from benchkit import median

PROMPT_TOKENS = 400
NEW_TOKENS = 32
COMPLETIONS = 4


def prefilled_tokens(metrics_url: str) -> float:
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    found = re.search(r"^tokenwire_engine_prefilled_tokens_total\{[^}]*\} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


async def one_request(stub: Any, pb: Any, ids: list[int], n: int, seed: int) -> dict[str, Any]:
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=ids),
        sampling=pb.SamplingParams(temperature=0.8, seed=seed),
        stopping=pb.StoppingCriteria(max_new_tokens=NEW_TOKENS, ignore_eos=True),
        n=n,
    )
    sent = time.perf_counter()
    first_by_index: dict[int, float] = {}
    tokens = 0
    server_ttft = 0.0
    async for event in stub.GenerateStream(request, timeout=300):
        kind = event.WhichOneof("event")
        if kind == "chunk":
            first_by_index.setdefault(event.chunk.index, time.perf_counter() - sent)
            tokens += len(event.chunk.token_ids)
        elif kind == "completed":
            server_ttft = event.completed.timing.time_to_first_token.ToTimedelta().total_seconds()
    total = time.perf_counter() - sent
    assert sorted(first_by_index) == list(range(n)), f"chunks of completions {sorted(first_by_index)}"
    assert tokens == n * NEW_TOKENS, tokens
    return {
        "first_chunk": min(first_by_index.values()),
        "every_first_chunk": max(first_by_index.values()),
        "server_ttft": server_ttft,
        "total": total,
        "tokens": tokens,
    }


async def measure(
    target: str, metrics_url: str, prompts: list[list[int]], repetitions: int
) -> dict[str, Any]:
    import grpc

    from tokenwire.v1 import inference_service_pb2 as pb
    from tokenwire.v1 import inference_service_pb2_grpc as pb_grpc

    runs: dict[int, list[dict[str, Any]]] = {1: [], COMPLETIONS: []}
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.InferenceServiceStub(channel)
        await one_request(stub, pb, prompts[-1], 1, 0)  # warm up
        for repetition in range(repetitions):
            order = (1, COMPLETIONS) if repetition % 2 == 0 else (COMPLETIONS, 1)
            for n in order:
                before = prefilled_tokens(metrics_url)
                run = await one_request(stub, pb, prompts[2 * repetition + (n > 1)], n, repetition)
                run["prefilled"] = prefilled_tokens(metrics_url) - before
                runs[n].append(run)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repetitions", type=int, default=10)
    args = parser.parse_args()
    directory = benchkit.model_dir()
    passage = benchkit.prompt_ids(directory, PROMPT_TOKENS + 16)
    # A distinct first token per request: with the prefix cache off this is only belt and braces.
    prompts = [[1000 + i, *passage[: PROMPT_TOKENS - 1]] for i in range(2 * args.repetitions + 1)]
    benchkit.wait_for_quiet()
    # The metrics page is rendered afresh on every scrape (no reuse window), so each request's
    # prefilled tokens are read right after it.
    extra = ("--prefix-cache-mb", "0", "--metrics-port", "0", "--metrics-cache-seconds", "0")
    with benchkit.ServerProcess(directory, max_batch_size=8, extra=extra) as server:
        metrics_port = next(
            int(found.group(1))
            for line in server.log
            if (found := re.search(r"metrics on http://[^:]+:(\d+)/metrics", line))
        )
        runs = asyncio.run(
            measure(server.target, f"http://127.0.0.1:{metrics_port}/metrics", prompts, args.repetitions)
        )
    one, many = runs[1], runs[COMPLETIONS]

    def ratio(key: str, other_key: str | None = None) -> float:
        return median([m[other_key or key] / o[key] for o, m in zip(one, many, strict=True)])

    rows = [
        [
            "time to first chunk (client)",
            median([r["first_chunk"] for r in one]) * 1000,
            median([r["first_chunk"] for r in many]) * 1000,
            ratio("first_chunk"),
        ],
        [
            "time to every completion's first chunk (client)",
            median([r["first_chunk"] for r in one]) * 1000,
            median([r["every_first_chunk"] for r in many]) * 1000,
            ratio("first_chunk", "every_first_chunk"),
        ],
        [
            "time to first token (server)",
            median([r["server_ttft"] for r in one]) * 1000,
            median([r["server_ttft"] for r in many]) * 1000,
            ratio("server_ttft"),
        ],
        [
            "whole request",
            median([r["total"] for r in one]) * 1000,
            median([r["total"] for r in many]) * 1000,
            ratio("total"),
        ],
    ]
    table = benchkit.markdown_table(
        ["measure (ms, medians)", "n = 1", f"n = {COMPLETIONS}", f"n = {COMPLETIONS} / n = 1"],
        [[name, f"{a:.1f}", f"{b:.1f}", f"{c:.2f}x"] for name, a, b, c in rows],
    )
    prefilled = {
        "n = 1": sorted({int(r["prefilled"]) for r in one}),
        f"n = {COMPLETIONS}": sorted({int(r["prefilled"]) for r in many}),
    }
    print(table)
    print(f"\nprompt tokens the model processed per request ({PROMPT_TOKENS}-token prompt): {prefilled}")
    path = benchkit.save_results(
        "n_completions",
        {
            "machine": benchkit.machine_summary(),
            "repetitions": args.repetitions,
            "prompt_tokens": PROMPT_TOKENS,
            "new_tokens": NEW_TOKENS,
            "runs": {str(n): r for n, r in runs.items()},
            "prefilled_tokens": prefilled,
            "table": table,
        },
    )
    print(f"\nresults: {path}")


if __name__ == "__main__":
    main()

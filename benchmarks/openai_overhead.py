"""What the OpenAI-compatible HTTP API costs against gRPC, side by side on one server.

One `tokenwire serve --http-port 0 --prefix-cache-mb 0` (the default model, 2 intra-op threads, no
prefix cache: this measures the APIs, not caching); the same ~100-token
prompt as token ids, greedy, the same number of new tokens (the model's own end of text may stop
both early, identically, since greedy output does not depend on the API). Each repetition runs,
in an order that rotates, a single stream over each API (time to first token as the client sees
it) and 8 concurrent streams over each API (generated tokens per second of wall time). gRPC is
tokenwire's own AsyncClient streaming; HTTP is OpenAI's Python SDK streaming server-sent events
with include_usage, and the same request through a plain httpx2 client (the HTTP client the SDK
itself uses) that reads the event lines and parses each with json.loads (the wire's own cost,
without the SDK's per-chunk validation). Figures are medians over the repetitions.

    python benchmarks/openai_overhead.py [--repetitions 5]
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Awaitable, Callable, Sequence

import benchkit
from benchkit import PROMPT_TOKENS, median

NEW_TOKENS = 64
STREAMS = 8


async def grpc_stream(client: object, ids: Sequence[int]) -> tuple[float, int]:
    """(seconds to the first token, tokens) of one greedy gRPC stream."""
    from tokenwire.client import AsyncClient, Chunk, Completed, GenerateOptions, Sampling, Stopping

    assert isinstance(client, AsyncClient)
    options = GenerateOptions(
        sampling=Sampling(temperature=0.0), stopping=Stopping(max_new_tokens=NEW_TOKENS)
    )
    sent = time.perf_counter()
    first = 0.0
    async for event in client.stream(list(ids), options, deadline=600):
        if isinstance(event, Chunk) and event.token_ids and not first:
            first = time.perf_counter() - sent
        elif isinstance(event, Completed):
            return first, event.generation.completion_tokens
    raise RuntimeError("stream ended without completing")


async def http_stream(client: object, ids: Sequence[int]) -> tuple[float, int]:
    """(seconds to the first text, tokens) of one greedy stream through OpenAI's SDK."""
    import openai

    assert isinstance(client, openai.AsyncOpenAI)
    sent = time.perf_counter()
    first = 0.0
    tokens = 0
    stream = await client.completions.create(
        model="default",
        prompt=list(ids),
        max_tokens=NEW_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text and not first:
            first = time.perf_counter() - sent
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return first, tokens


async def raw_http_stream(client: object, ids: Sequence[int]) -> tuple[float, int]:
    """(seconds to the first text, tokens) of one greedy stream read as plain server-sent events."""
    import httpx2 as httpx

    assert isinstance(client, httpx.AsyncClient)
    body = {
        "model": "default",
        "prompt": list(ids),
        "max_tokens": NEW_TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    first = 0.0
    tokens = 0
    async with client.stream("POST", "/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["text"] and not first:
                first = time.perf_counter() - sent
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return first, tokens


Run = Callable[[object, Sequence[int]], Awaitable[tuple[float, int]]]


async def concurrent(run: Run, client: object, prompts: Sequence[Sequence[int]]) -> float:
    """Generated tokens per second of wall time with every prompt streaming at once."""
    started = time.perf_counter()
    results = await asyncio.gather(*(run(client, ids) for ids in prompts))
    return sum(tokens for _, tokens in results) / (time.perf_counter() - started)


async def measure(grpc_target: str, http_url: str, repetitions: int) -> dict[str, dict[str, list[float]]]:
    import httpx2 as httpx
    import openai

    from tokenwire.client import AsyncClient

    directory = benchkit.model_dir()
    single = benchkit.prompt_ids(directory, PROMPT_TOKENS)
    # Each concurrent stream its own prompt, so no stream rides another's prefix cache.
    many = [benchkit.prompt_ids(directory, PROMPT_TOKENS, offset=1 + i) for i in range(STREAMS)]
    grpc_client = AsyncClient(grpc_target, retries=False)
    http_client = openai.AsyncOpenAI(base_url=http_url, api_key="unused", max_retries=0)
    raw_client = httpx.AsyncClient(base_url=http_url, timeout=600)
    apis: dict[str, tuple[Run, object]] = {
        "grpc": (grpc_stream, grpc_client),
        "http": (http_stream, http_client),
        "http_raw": (raw_http_stream, raw_client),
    }
    figures: dict[str, dict[str, list[float]]] = {api: {"ttft": [], "throughput": []} for api in apis}
    for run, client in apis.values():  # warm-up: connections, the prompts' first prefill
        await run(client, single)
        await concurrent(run, client, many)
    order = list(apis)
    for repetition in range(repetitions):
        shift = repetition % len(order)
        for api in order[shift:] + order[:shift]:
            run, client = apis[api]
            # A prompt never seen before for the TTFT: the prefix cache must not answer it.
            fresh = benchkit.prompt_ids(
                directory, PROMPT_TOKENS, offset=100 + len(order) * repetition + order.index(api)
            )
            ttft, _ = await run(client, fresh)
            figures[api]["ttft"].append(ttft)
            offset = 200 + 10 * (len(order) * repetition + order.index(api))
            prompts = [
                benchkit.prompt_ids(directory, PROMPT_TOKENS, offset=offset + i) for i in range(STREAMS)
            ]
            figures[api]["throughput"].append(await concurrent(run, client, prompts))
    await http_client.close()
    await raw_client.aclose()
    await grpc_client.close()
    return figures


def main() -> None:
    repetitions = benchkit.command_line(__doc__, repetitions=5).repetitions
    directory = benchkit.model_dir()
    with benchkit.ServerProcess(
        directory,
        model_name="default",
        max_batch_size=STREAMS,
        # The passage repeats within the benchmark's prompts: with the prefix cache on, some
        # "fresh" prompts would be answered from it, on one API and not the other.
        extra=("--http-port", "0", "--prefix-cache-mb", "0"),
    ) as server:
        found = next(filter(None, (re.search(r"API on (https?://\S+)", line) for line in server.log)))
        assert found is not None
        figures = asyncio.run(measure(server.target, found.group(1), repetitions))
    ttft = {api: median(values["ttft"]) for api, values in figures.items()}
    throughput = {api: median(values["throughput"]) for api, values in figures.items()}
    rows = [
        [
            "single-stream TTFT (ms)",
            *(f"{ttft[api] * 1000:.1f}" for api in figures),
            *(f"{ttft[api] / ttft['grpc']:.3f}x" for api in ("http", "http_raw")),
        ],
        [
            f"{STREAMS}-stream throughput (tok/s)",
            *(f"{throughput[api]:.1f}" for api in figures),
            *(f"{throughput[api] / throughput['grpc']:.3f}x" for api in ("http", "http_raw")),
        ],
    ]
    header = ["", "gRPC", "HTTP (OpenAI SDK)", "HTTP (httpx2)", "SDK / gRPC", "httpx2 / gRPC"]
    print(benchkit.markdown_table(header, rows))
    path = benchkit.save_results(
        "openai_overhead",
        {
            "figures": figures,
            "ttft": ttft,
            "throughput": throughput,
            "repetitions": repetitions,
            "new_tokens": NEW_TOKENS,
            "streams": STREAMS,
            "machine": benchkit.machine_summary(),
        },
    )
    print(f"results: {path}")


if __name__ == "__main__":
    main()

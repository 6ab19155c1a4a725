"""What one message per token costs: the same greedy generations streamed and unary, side by side.

Starts a server with one slot and 2 threads, then alternates, for each repetition, one streamed
and one unary generation (100-token prompt, 128 new tokens, greedy). For each it reads the
server's per-thread CPU time from /proc before and after, and this process's own CPU time, and
reports per generated token: the event loop's CPU (the server's main thread: gRPC, protobuf, the
stream's writer), the rest of the server (the engine thread with ONNX Runtime's calling thread,
ONNX Runtime's pool, gRPC's own threads), the client's CPU, and the decode rate the server
measured. On a machine where client, server and ONNX Runtime share two cores, the difference
between the two columns is what streaming takes from the model.

    python benchmarks/stream_cost.py [--repetitions 5]
"""

from __future__ import annotations

import asyncio
import time

import benchkit
from benchkit import NEW_TOKENS

from tokenwire.client import AsyncClient, Chunk, Completed, GenerateOptions, Generation, Sampling, Stopping


async def _generate(client: AsyncClient, ids: list[int], *, stream: bool) -> Generation:
    options = GenerateOptions(
        sampling=Sampling(temperature=0.0), stopping=Stopping(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    )
    if not stream:
        return await client.generate(ids, options, deadline=600)
    tokens = 0
    async for event in client.stream(ids, options, deadline=600):
        if isinstance(event, Chunk):
            tokens += len(event.token_ids)
        elif isinstance(event, Completed):
            assert tokens == event.generation.completion_tokens
            return event.generation
    raise RuntimeError("stream ended without completing")


async def _measure(
    server: benchkit.ServerProcess, client: AsyncClient, ids: list[int], *, stream: bool
) -> dict[str, float]:
    before = benchkit.thread_cpu_seconds(server.pid)
    client_before = time.process_time()
    generation = await _generate(client, ids, stream=stream)
    client_cpu = time.process_time() - client_before
    after = benchkit.thread_cpu_seconds(server.pid)
    used = {tid: seconds - before.get(tid, (name, 0.0))[1] for tid, (name, seconds) in after.items()}
    tokens = generation.completion_tokens
    event_loop = used.get(server.pid, 0.0)  # the main thread runs the asyncio event loop
    rest = sum(used.values()) - event_loop
    return {
        "event_loop_us_per_token": event_loop / tokens * 1e6,
        "rest_of_server_us_per_token": rest / tokens * 1e6,
        "client_us_per_token": client_cpu / tokens * 1e6,
        "decode_rate": generation.timing.decode_tokens_per_second,
    }


async def _compare(
    server: benchkit.ServerProcess, ids: list[int], repetitions: int
) -> dict[str, list[dict[str, float]]]:
    results: dict[str, list[dict[str, float]]] = {"stream": [], "unary": []}
    # One client for the whole run: no measurement pays for a connection.
    async with AsyncClient(server.target, retries=False) as client:
        for stream in (True, False):  # warm-up
            await _measure(server, client, ids, stream=stream)
        for repetition in range(repetitions):
            benchkit.wait_for_quiet()
            order = (True, False) if repetition % 2 == 0 else (False, True)
            for stream in order:
                results["stream" if stream else "unary"].append(
                    await _measure(server, client, ids, stream=stream)
                )
    return results


def main() -> None:
    repetitions = benchkit.command_line(__doc__, repetitions=5).repetitions

    directory = benchkit.model_dir()
    ids = benchkit.prompt_ids(directory)
    with benchkit.ServerProcess(directory, max_batch_size=1) as server:
        results = asyncio.run(_compare(server, ids, repetitions))

    figures = (
        ("event loop CPU µs/token", "event_loop_us_per_token"),
        ("rest of the server CPU µs/token", "rest_of_server_us_per_token"),
        ("client CPU µs/token", "client_us_per_token"),
        ("decode tok/s (server-measured)", "decode_rate"),
    )
    rows = [
        [label, *(f"{benchkit.median([r[key] for r in results[mode]]):.1f}" for mode in ("stream", "unary"))]
        for label, key in figures
    ]
    print(
        f"\n## Streamed against unary: one slot, prompt {len(ids)} tokens, {NEW_TOKENS} new tokens, "
        f"greedy, median of {repetitions}\n"
    )
    print(benchkit.markdown_table(["figure", "StreamGenerate", "Generate (unary)"], rows))
    record = {"repetitions": repetitions, "runs": results}
    path = benchkit.save_results("stream_cost", record)
    print(f"\nwrote {path.relative_to(benchkit.REPO)}")


if __name__ == "__main__":
    main()

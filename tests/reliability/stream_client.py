"""A StreamGenerate client in a process of its own, so a test can kill it with SIGKILL.

It submits the generations, then prints one JSON line per event ({"id": ..., "event": ...}) and
keeps reading until it is killed or the stream ends.

Run as `python -m tests.reliability.stream_client TARGET GENERATIONS MAX_NEW_TOKENS`.
"""

from __future__ import annotations

import asyncio
import json
import sys

from tokenwire.client import AsyncClient, GenerateOptions, Sampling, Stopping


async def stream(target: str, generations: int, max_new_tokens: int) -> None:
    options = GenerateOptions(
        sampling=Sampling(temperature=0.0), stopping=Stopping(max_new_tokens=max_new_tokens, ignore_eos=True)
    )
    async with AsyncClient(target, retries=False) as client, client.open_stream() as call:
        for index in range(generations):
            await call.submit(f"g{index}", f"A client that will be killed ({index})", options)
        async for event in call.events():
            print(json.dumps({"id": event.request_id, "event": type(event).__name__}), flush=True)


if __name__ == "__main__":
    asyncio.run(stream(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))

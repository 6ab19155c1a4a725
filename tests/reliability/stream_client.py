"""A StreamGenerate client in a process of its own, so a test can kill it with SIGKILL.

It submits the generations, then prints one JSON line per event ({"id": ..., "event": ...}) and
keeps reading until it is killed or the stream ends.

Run as `python -m tests.reliability.stream_client TARGET GENERATIONS MAX_NEW_TOKENS`, or from a
test through ClientProcess, which starts it, reads its lines on a thread and kills it.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
from pathlib import Path

from tokenwire.client import AsyncClient, GenerateOptions, Sampling, Stopping

ROOT = Path(__file__).resolve().parents[2]


async def stream(target: str, generations: int, max_new_tokens: int) -> None:
    options = GenerateOptions(
        sampling=Sampling(temperature=0.0), stopping=Stopping(max_new_tokens=max_new_tokens, ignore_eos=True)
    )
    async with AsyncClient(target, retries=False) as client, client.open_stream() as call:
        for index in range(generations):
            await call.submit(f"g{index}", f"A client that will be killed ({index})", options)
        async for event in call.events():
            print(json.dumps({"id": event.request_id, "event": type(event).__name__}), flush=True)


class ClientProcess:
    """tests/reliability/stream_client.py in a child process; its event lines, read with a bound."""

    def __init__(self, port: int, generations: int, max_new_tokens: int) -> None:
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.reliability.stream_client",
                f"127.0.0.1:{port}",
                str(generations),
                str(max_new_tokens),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            cwd=ROOT,
        )
        self.events: list[tuple[str, str]] = []
        self._changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            parsed = json.loads(line)
            with self._changed:
                self.events.append((parsed["id"], parsed["event"]))
                self._changed.notify_all()

    def seen(self, request_id: str, event: str) -> bool:
        with self._changed:
            return (request_id, event) in self.events

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)


if __name__ == "__main__":
    asyncio.run(stream(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))

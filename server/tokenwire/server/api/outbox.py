"""A stream's responses not yet sent, counted in bytes and bounded.

gRPC sends a response only as fast as the client reads (HTTP/2 flow control), so the responses
of a client that reads slowly, or not at all, wait here. Chunks that pile up are merged when
taken (see coalesce_chunks), which is enough for a reader that is merely slow; the byte bound is
for the one that does not read: past it the stream stops its generations and ends the call
instead of holding ever more output in memory. The outbox also knows since when its oldest
response has waited, so the stream can tell a client that reads nothing at all well before the
bytes add up (stream.py).

Used on the event loop only.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

from tokenwire.v1 import inference_service_pb2 as pb


class Outbox:
    def __init__(self, max_bytes: int, clock: Callable[[], float]) -> None:
        self.max_bytes = max_bytes
        self._clock = clock
        self._messages: deque[tuple[pb.StreamGenerateResponse | None, int, float]] = deque()
        self._waiting = asyncio.Event()
        self.unsent_bytes = 0
        """Bytes queued here plus those of the batch being sent."""
        self._sending_bytes = 0
        self._sending_since: float | None = None
        """When the oldest response of the batch being sent was queued; None: no batch is out."""

    def put(self, message: pb.StreamGenerateResponse | None) -> bool:
        """Queue `message` (None only wakes the sender); False once the unsent bytes exceed the bound."""
        size = 0 if message is None else message.ByteSize()
        self._messages.append((message, size, self._clock()))
        self.unsent_bytes += size
        self._waiting.set()
        return self.unsent_bytes <= self.max_bytes

    def unsent_since(self) -> float | None:
        """When the oldest response not yet handed to gRPC was queued; None when all were."""
        if self._sending_since is not None:
            return self._sending_since
        return next((at for message, _, at in self._messages if message is not None), None)

    def empty(self) -> bool:
        return not self._messages

    async def take_all(self) -> list[pb.StreamGenerateResponse | None]:
        """Everything queued, once there is something; its bytes count until sent() is called."""
        while not self._messages:
            self._waiting.clear()
            await self._waiting.wait()
        taken = list(self._messages)
        self._messages.clear()
        self._sending_bytes = sum(size for _, size, _ in taken)
        self._sending_since = next((at for message, _, at in taken if message is not None), None)
        return [message for message, _, _ in taken]

    def sent(self) -> None:
        """The batch from take_all() has been handed to gRPC."""
        self.unsent_bytes -= self._sending_bytes
        self._sending_bytes = 0
        self._sending_since = None

    def discard(self) -> None:
        """Drop everything queued (the call is ending): its memory goes at once."""
        self.unsent_bytes -= sum(size for _, size, _ in self._messages)
        self._messages.clear()
        self._messages.append((None, 0, self._clock()))
        self._waiting.set()

"""Helpers to read a multiplexed stream in tests."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from tokenwire.client import Chunk, Completed, Failed, StreamEvent


@dataclass
class Transcript:
    """Every event of a stream, grouped by request id."""

    events: dict[str, list[StreamEvent]] = field(default_factory=lambda: defaultdict(list))

    def add(self, event: StreamEvent) -> None:
        self.events[event.request_id].append(event)

    def chunks(self, request_id: str) -> list[Chunk]:
        return [e for e in self.events[request_id] if isinstance(e, Chunk)]

    def tokens(self, request_id: str) -> list[int]:
        return [t for c in self.chunks(request_id) for t in c.token_ids]

    def text(self, request_id: str) -> str:
        return "".join(c.text for c in self.chunks(request_id))

    def final(self, request_id: str) -> StreamEvent:
        last = self.events[request_id][-1]
        assert isinstance(last, Completed | Failed), f"{request_id} has not finished: {last}"
        return last

    def finished(self, request_id: str) -> bool:
        seen = self.events.get(request_id)
        return bool(seen) and isinstance(seen[-1], Completed | Failed)


async def read_until(events: AsyncIterator[StreamEvent], transcript: Transcript, condition) -> None:  # type: ignore[no-untyped-def]
    """Read events into `transcript` until `condition(transcript)` holds."""
    while not condition(transcript):
        transcript.add(await anext(events))

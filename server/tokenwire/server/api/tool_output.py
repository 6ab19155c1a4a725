"""One gRPC request's output read for tool calls, completion by completion (text/tool_calls.py).

A request without tools passes through untouched: its text is all content. With tools, each
chunk's text is split into what is content and the call deltas, the calls are kept for the
`completed` event, and a completion that ended by itself with calls ends with TOOL_CALLS.
"""

from __future__ import annotations

from tokenwire.server.engine.types import FinishReason
from tokenwire.server.text.tool_calls import CallDelta, ContentDelta, ReaderDelta, ToolCallReader
from tokenwire.server.text.tools import ToolCall, ToolCalling


def ends_with_calls(reason: FinishReason, calls: list[ToolCall]) -> bool:
    """Whether a completion's finish reason is tool calls: it holds calls and ended by itself."""
    return bool(calls) and reason in (FinishReason.EOS, FinishReason.STOP)


class ToolOutput:
    def __init__(self, calling: ToolCalling | None) -> None:
        self._calling = calling
        self._readers: dict[int, ToolCallReader] = {}

    def chunk(self, index: int, text: str) -> tuple[str, list[CallDelta]]:
        """A chunk's text as content, and the call deltas it holds."""
        if self._calling is None:
            return text, []
        return _split(self._reader(index).feed(text))

    def finish(self, index: int) -> tuple[str, list[CallDelta]]:
        """What completion `index` still holds back once it has ended."""
        if self._calling is None:
            return "", []
        return _split(self._reader(index).finish())

    def calls(self, index: int) -> list[ToolCall]:
        reader = self._readers.get(index)
        return [] if reader is None else reader.calls

    def whole(self, text: str) -> tuple[str, list[ToolCall]]:
        """A whole output's content and calls."""
        if self._calling is None:
            return text, []
        reader = ToolCallReader(self._calling)
        reader.feed(text)
        reader.finish()
        return reader.content, reader.calls

    def _reader(self, index: int) -> ToolCallReader:
        reader = self._readers.get(index)
        if reader is None:
            assert self._calling is not None
            reader = self._readers[index] = ToolCallReader(self._calling)
        return reader


def _split(deltas: list[ReaderDelta]) -> tuple[str, list[CallDelta]]:
    content = "".join(delta.text for delta in deltas if isinstance(delta, ContentDelta))
    return content, [delta for delta in deltas if isinstance(delta, CallDelta)]

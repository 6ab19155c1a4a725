"""Engine results and events -> the Responses API's response object and its stream's events.

The output is read as chat's is (text/tool_calls.py's reader, when the request offers tools) and
written as output items: a `message` item (one `output_text` part) for each run of text, a
`function_call` item for each call. An answer with neither is one message with empty text, so
every answer has an item to read.

With `include: ["message.output_text.logprobs"]` (or `top_logprobs`), each token's
log-probability comes with the text it produced: on its `response.output_text.delta` (token,
logprob, top_logprobs) and in the message's `output_text` part (with each token's bytes, as
chat's logprobs). Text the tool-call reader holds back carries its tokens' log-probabilities to
the text sent after it; the tokens of a call have none, as on chat's `tool_calls`.

A stream says, in OpenAI's event names (each `event: NAME` and `data: {..., "sequence_number"}`):

    response.created, response.in_progress
    for a message:  response.output_item.added, response.content_part.added,
                    response.output_text.delta ..., response.output_text.done,
                    response.content_part.done, response.output_item.done
    for a call:     response.output_item.added, response.function_call_arguments.delta ...,
                    response.function_call_arguments.done, response.output_item.done
    response.completed (or response.incomplete, when max_output_tokens cut the answer short)

and a generation that fails after the stream began ends it with response.failed. The unary
answer is built by the same writer from the whole text, so it is exactly the stream's last
response. Every response carries `usage` and tokenwire's timing extension (responses.py).
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Sequence

from tokenwire.server.engine.errors import ErrorKind, GenerationError
from tokenwire.server.engine.types import FinishReason, GenerationResult, TokenLogprobs
from tokenwire.server.openai_api.parsing import ParsedRequest
from tokenwire.server.openai_api.responses import EXTENSION, Identity, timing
from tokenwire.server.text.tool_calls import CallDelta, ContentDelta, ReaderDelta, ToolCallReader

Event = dict[str, object]

_ERROR_CODES = {
    ErrorKind.RESOURCE_EXHAUSTED: "rate_limit_exceeded",
    ErrorKind.INVALID_ARGUMENT: "invalid_prompt",
}
"""A failure's code, among the few OpenAI's ResponseError defines; the message says the rest."""


def usage(result: GenerationResult) -> dict[str, object]:
    return {
        "input_tokens": result.prompt_tokens,
        "input_tokens_details": {"cached_tokens": result.cached_prompt_tokens},
        "output_tokens": result.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": result.prompt_tokens + result.completion_tokens,
    }


class _Output:
    """A response's output items, built from its text as it is generated: each piece of text
    hands back the events that say what it added."""

    def __init__(self, identity: Identity, *, logprobs: bool) -> None:
        calling = identity.tool_calling
        self._reader = ToolCallReader(calling) if calling is not None else None
        self._token_bytes = identity.token_bytes
        self._logprobs = logprobs
        self._pending: list[TokenLogprobs] = []
        """Log-probabilities of steps whose text has not been sent yet (held back by the reader)."""
        self._message_logprobs: list[TokenLogprobs] = []
        """The open message's."""
        self.items: list[dict[str, object]] = []
        """The items written so far, the open one last."""
        self._open: dict[str, object] | None = None
        self._written = ""
        """The open item's text (a message) or arguments (a call) so far."""

    def feed(self, text: str, logprobs: Sequence[TokenLogprobs] = ()) -> list[Event]:
        if self._logprobs:
            self._pending += logprobs
        if self._reader is not None:
            return self._apply(self._reader.feed(text) if text else [])
        return self._apply([ContentDelta(text)] if text else [])

    def finish(self, *, incomplete: bool) -> list[Event]:
        events = self._apply(self._reader.finish()) if self._reader is not None else []
        if not self.items:
            events += self._open_message()
        if self._open is not None and self._open["type"] == "message":
            self._message_logprobs += self._pending  # text the reader held back, sent as the last text
        self._pending = []
        return events + self._close("incomplete" if incomplete else "completed")

    def _apply(self, deltas: Sequence[ReaderDelta]) -> list[Event]:
        events: list[Event] = []
        for delta in deltas:
            if isinstance(delta, ContentDelta):
                if self._open is None or self._open["type"] != "message":
                    events += self._close("completed") + self._open_message()
                self._written += delta.text
                carried, self._pending = self._pending, []
                self._message_logprobs += carried
                events.append(
                    {
                        "type": "response.output_text.delta",
                        **self._at(),
                        "content_index": 0,
                        "delta": delta.text,
                        "logprobs": [self._streamed_logprob(item) for item in carried],
                    }
                )
            elif isinstance(delta, CallDelta) and delta.id:
                events += self._close("completed") + self._open_call(delta)
            elif delta.arguments:
                self._written += delta.arguments
                events.append(
                    {"type": "response.function_call_arguments.delta", **self._at(), "delta": delta.arguments}
                )
        return events

    def _at(self) -> Event:
        assert self._open is not None
        return {"item_id": self._open["id"], "output_index": len(self.items) - 1}

    def _open_message(self) -> list[Event]:
        self._open = {
            "id": "msg_" + secrets.token_hex(12),
            "type": "message",
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        self.items.append(self._open)
        self._written = ""
        added = {
            "type": "response.output_item.added",
            "output_index": len(self.items) - 1,
            "item": dict(self._open),
        }
        part = {
            **self._at(),
            "type": "response.content_part.added",
            "content_index": 0,
            "part": _text_part(""),
        }
        return [added, part]

    def _open_call(self, delta: CallDelta) -> list[Event]:
        self._open = {
            "id": "fc_" + secrets.token_hex(12),
            "type": "function_call",
            "status": "in_progress",
            "call_id": delta.id,
            "name": delta.name,
            "arguments": "",
        }
        self.items.append(self._open)
        self._written = ""
        events: list[Event] = [
            {
                "type": "response.output_item.added",
                "output_index": len(self.items) - 1,
                "item": dict(self._open),
            }
        ]
        return events + self._apply([CallDelta(delta.index, arguments=delta.arguments)])

    def _close(self, status: str) -> list[Event]:
        item = self._open
        if item is None:
            return []
        at = self._at()
        events: list[Event] = []
        if item["type"] == "message":
            part = _text_part(self._written, [self._logprob(item) for item in self._message_logprobs])
            events.append(
                {
                    "type": "response.output_text.done",
                    **at,
                    "content_index": 0,
                    "text": self._written,
                    "logprobs": [self._streamed_logprob(item) for item in self._message_logprobs],
                }
            )
            events.append({"type": "response.content_part.done", **at, "content_index": 0, "part": part})
            item["content"] = [part]
        else:
            events.append(
                {
                    "type": "response.function_call_arguments.done",
                    **at,
                    "name": item["name"],
                    "arguments": self._written,
                }
            )
            item["arguments"] = self._written
        item["status"] = status
        events.append(
            {"type": "response.output_item.done", "output_index": at["output_index"], "item": dict(item)}
        )
        self._open = None
        return events

    def _logprob(self, item: TokenLogprobs) -> dict[str, object]:
        """A token's log-probability in a message's content: with its bytes, as chat's are."""
        return {
            "token": item.token,
            "logprob": item.logprob,
            "bytes": list(self._token_bytes(item.token_id)),
            "top_logprobs": [
                {"token": text, "logprob": logprob, "bytes": list(self._token_bytes(token_id))}
                for token_id, text, logprob in item.top
            ],
        }

    @staticmethod
    def _streamed_logprob(item: TokenLogprobs) -> dict[str, object]:
        """A token's log-probability on a text event (OpenAI's events carry no bytes)."""
        return {
            "token": item.token,
            "logprob": item.logprob,
            "top_logprobs": [{"token": text, "logprob": logprob} for _, text, logprob in item.top],
        }


def _text_part(text: str, logprobs: list[dict[str, object]] | None = None) -> dict[str, object]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def response_object(
    identity: Identity,
    parsed: ParsedRequest,
    status: str,
    output: list[dict[str, object]],
    result: GenerationResult | None = None,
    error: GenerationError | None = None,
) -> dict[str, object]:
    """The response object at `status` (completed, incomplete, in_progress or failed)."""
    body: dict[str, object] = {
        "id": identity.id,
        "object": "response",
        "created_at": identity.created,
        "status": status,
        "completed_at": int(time.time()) if status == "completed" else None,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "model": identity.model,
        "output": output,
        "previous_response_id": None,
        "reasoning": None,
        **parsed.echo,
    }
    if error is not None:
        body["error"] = {"code": _ERROR_CODES.get(error.kind, "server_error"), "message": error.message}
    if result is not None:
        body["usage"] = usage(result)
        body[EXTENSION] = {"timing": timing(result.timing)}
    return body


def _status(result: GenerationResult) -> str:
    return "incomplete" if result.finish_reason is FinishReason.LENGTH else "completed"


def whole_response(identity: Identity, parsed: ParsedRequest, result: GenerationResult) -> bytes:
    """The response object of a request that did not stream: what its stream would end with."""
    output = _Output(identity, logprobs=parsed.spec.logprobs)
    output.feed(result.text, result.logprobs)
    status = _status(result)
    output.finish(incomplete=status == "incomplete")
    return json.dumps(response_object(identity, parsed, status, output.items, result)).encode()


class ResponseEventWriter:
    """The server-sent events of one streamed response (the module's docstring lists them)."""

    def __init__(self, identity: Identity, parsed: ParsedRequest) -> None:
        self._identity = identity
        self._parsed = parsed
        self._output = _Output(identity, logprobs=parsed.spec.logprobs)
        self._sequence = 0

    def opening(self) -> bytes:
        started = response_object(self._identity, self._parsed, "in_progress", [])
        return self._frame({"type": "response.created", "response": started}) + self._frame(
            {"type": "response.in_progress", "response": started}
        )

    def tokens(self, text: str, logprobs: Sequence[TokenLogprobs], index: int = 0) -> bytes:
        return b"".join(self._frame(event) for event in self._output.feed(text, logprobs))

    def closing(self, result: GenerationResult) -> bytes:
        status = _status(result)
        events = self._output.finish(incomplete=status == "incomplete")
        final = response_object(self._identity, self._parsed, status, self._output.items, result)
        events.append({"type": f"response.{status}", "response": final})
        return b"".join(self._frame(event) for event in events)

    def failure(self, error: GenerationError) -> bytes:
        items = self._output.items
        failed = response_object(self._identity, self._parsed, "failed", items, error=error)
        return self._frame({"type": "response.failed", "response": failed})

    def _frame(self, event: Event) -> bytes:
        event["sequence_number"] = self._sequence
        self._sequence += 1
        return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()

"""Engine results and events -> OpenAI's JSON objects and server-sent-event chunks.

Besides OpenAI's own fields, every completion (and a stream's last chunk) carries tokenwire's
timing as an extension member, all in seconds from the moment the request was received:

    "tokenwire": {"timing": {"queued": ..., "time_to_first_token": ..., "prefill": ...,
                             "total": ..., "decode_tokens_per_second": ...}}

A stage the request never reached is null. OpenAI's SDKs keep unknown members, so a client
reads it as `completion.tokenwire` (Python) or `completion["tokenwire"]` (Node).

Every object follows OpenAI's published OpenAPI document (tests/support/openapi checks each one):
no `system_fingerprint` (a string there, and tokenwire has none to give), `refusal` null on chat
messages and their logprobs, and each logprob's `bytes` the token's own bytes (a token holding
part of a multi-byte character has that part). One departure, OpenAI's own: a completions
stream's chunks before the last carry `finish_reason: null`, as OpenAI's API streams them; the
document describes no completions stream (its CreateCompletionResponse has no null there).

A request with tools has its output read by text/tool_calls.py: the calls go out as
`tool_calls` (streamed as argument deltas), the rest as content, and a completion that ended by
itself with calls has finish reason `tool_calls`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from tokenwire.server.engine.errors import GenerationError
from tokenwire.server.engine.types import (
    CompletionChoice,
    FinishReason,
    GenerationResult,
    TimingReport,
    TokenLogprobs,
)
from tokenwire.server.openai_api.errors import error_object
from tokenwire.server.openai_api.parsing import ParsedRequest
from tokenwire.server.text.tool_calls import ContentDelta, ReaderDelta, ToolCallReader
from tokenwire.server.text.tools import ToolCall, ToolCalling

EXTENSION = "tokenwire"
DONE = b"data: [DONE]\n\n"

_FINISH_REASONS = {
    FinishReason.EOS: "stop",
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.CANCELLED: "stop",  # only a client that has gone away is cancelled: nobody reads it
}


@dataclass(frozen=True)
class Identity:
    """What every object of one response repeats, and what its outputs are read with."""

    id: str
    created: int
    model: str
    chat: bool
    token_bytes: Callable[[int], bytes] = lambda token_id: b""
    """The served model's bytes of a token (text/tokenizer.py)."""
    tool_calling: ToolCalling | None = None
    """The request's tools, when its output is read for calls."""


def finish_reason(reason: FinishReason, calls: Sequence[ToolCall]) -> str:
    """OpenAI's finish reason: `tool_calls` for an output that ended by itself with calls."""
    if calls and reason in (FinishReason.EOS, FinishReason.STOP):
        return "tool_calls"
    return _FINISH_REASONS[reason]


def timing(report: TimingReport) -> dict[str, object]:
    return {
        "queued": report.queued,
        "time_to_first_token": report.time_to_first_token,
        "prefill": report.prefill,
        "paced": report.paced,
        "total": report.total,
        "decode_tokens_per_second": report.decode_tokens_per_second,
    }


def usage(result: GenerationResult) -> dict[str, object]:
    found: dict[str, object] = {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "total_tokens": result.prompt_tokens + result.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": result.cached_prompt_tokens},
    }
    if result.draft_tokens:
        # OpenAI's names for a prediction's tokens the model kept and those it did not: the
        # nearest thing its API has to speculative drafts.
        found["completion_tokens_details"] = {
            "accepted_prediction_tokens": result.accepted_draft_tokens,
            "rejected_prediction_tokens": result.draft_tokens - result.accepted_draft_tokens,
        }
    return found


class StreamWriter(Protocol):
    """The events of one streamed answer, in its route's format."""

    def opening(self) -> bytes:
        """What the stream says once the generation has started."""
        ...

    def tokens(self, text: str, logprobs: Sequence[TokenLogprobs], index: int = 0) -> bytes: ...

    def closing(self, result: GenerationResult) -> bytes:
        """The stream's last events, for a generation that completed."""
        ...

    def failure(self, error: GenerationError) -> bytes:
        """The stream's last event, for a generation that failed after the stream began."""
        ...


WholeAnswer = Callable[[Identity, ParsedRequest, GenerationResult], bytes]
"""The body of an answer that does not stream."""
StreamAnswer = Callable[[Identity, ParsedRequest], StreamWriter]
"""The writer of a streamed answer's events."""


def whole_completion(identity: Identity, parsed: ParsedRequest, result: GenerationResult) -> bytes:
    """A chat completion's or completion's whole body."""
    return completion(identity, result, logprobs=parsed.spec.logprobs)


def completion(identity: Identity, result: GenerationResult, *, logprobs: bool) -> bytes:
    """The whole answer of a request that did not stream: one choice per completion (n)."""
    completions = result.choices or (
        CompletionChoice(0, result.text, result.token_ids, result.finish_reason, result.logprobs),
    )
    choices: list[dict[str, object]] = []
    for completed in completions:
        calls: list[ToolCall] = []
        content = completed.text
        if identity.tool_calling is not None:
            reader = ToolCallReader(identity.tool_calling)
            reader.feed(completed.text)
            reader.finish()
            content, calls = reader.content, reader.calls
        choice: dict[str, object] = {
            "index": completed.index,
            "finish_reason": finish_reason(completed.finish_reason, calls),
        }
        if identity.chat:
            message: dict[str, object] = {
                "role": "assistant",
                "content": content if content or not calls else None,
                "refusal": None,
            }
            if calls:
                message["tool_calls"] = [_tool_call(call) for call in calls]
            choice["message"] = message
            choice["logprobs"] = chat_logprobs(completed.logprobs, identity.token_bytes) if logprobs else None
        else:
            choice["text"] = completed.text
            choice["logprobs"] = completion_logprobs(completed.logprobs, 0) if logprobs else None
        choices.append(choice)
    body = {
        **_head(identity, chunk=False),
        "choices": choices,
        "usage": usage(result),
        EXTENSION: {"timing": timing(result.timing)},
    }
    return json.dumps(body).encode()


class ChunkWriter:
    """The server-sent events of one streamed response, in OpenAI's chunk format.

    With n completions every chunk carries one choice, whose index says which completion it
    belongs to; their chunks interleave as the completions are generated, and each completion's
    finish reason comes in a chunk of its own once all of them have ended.
    """

    def __init__(
        self, identity: Identity, *, logprobs: bool, include_usage: bool, completions: int = 1
    ) -> None:
        self._identity = identity
        self._logprobs = logprobs
        self._include_usage = include_usage
        self._completions = completions
        self._text_offsets: dict[int, int] = {}
        """Per completion, how much text its chunks have carried (the legacy logprobs' offsets)."""
        self._readers: dict[int, ToolCallReader] = {}

    @classmethod
    def of(cls, identity: Identity, parsed: ParsedRequest) -> ChunkWriter:
        """The writer of a chat completion's or completion's chunks for `parsed`."""
        return cls(
            identity,
            logprobs=parsed.spec.logprobs,
            include_usage=parsed.include_usage,
            completions=parsed.spec.n or 1,
        )

    def opening(self) -> bytes:
        """Chat's first chunk of each completion names the role; completions have none."""
        if not self._identity.chat:
            return b""
        return b"".join(
            self._event(self._choice(index, {"role": "assistant", "content": ""}, None, None))
            for index in range(self._completions)
        )

    def tokens(self, text: str, logprobs: Sequence[TokenLogprobs], index: int = 0) -> bytes:
        if not text and not logprobs:
            return b""
        if self._identity.chat and self._identity.tool_calling is not None:
            deltas = self._reader(index).feed(text) if text else []
            return self._deltas(index, deltas, logprobs)
        if self._identity.chat:
            choice = self._choice(
                index,
                {"content": text},
                chat_logprobs(logprobs, self._identity.token_bytes) if self._logprobs else None,
                None,
            )
        else:
            offset = self._text_offsets.get(index, 0)
            choice = self._choice(
                index,
                text,
                completion_logprobs(logprobs, offset) if self._logprobs else None,
                None,
            )
            self._text_offsets[index] = offset + len(text)
        return self._event(choice)

    def closing(self, result: GenerationResult) -> bytes:
        """Each completion's finish reason, the usage chunk when asked for, then [DONE]; timing
        on the last."""
        extension: dict[str, object] = {EXTENSION: {"timing": timing(result.timing)}}
        ended = [(choice.index, choice.finish_reason) for choice in result.choices] or [
            (0, result.finish_reason)
        ]
        empty: object = {} if self._identity.chat else ""
        data = b""
        finishes = []
        for index, reason in ended:
            calls: list[ToolCall] = []
            if self._identity.chat and self._identity.tool_calling is not None:
                reader = self._reader(index)
                data += self._deltas(index, reader.finish(), ())
                calls = reader.calls
            finishes.append(self._choice(index, empty, None, finish_reason(reason, calls)))
        data += b"".join(self._event(finish) for finish in finishes[:-1])
        if not self._include_usage:
            return data + self._event(finishes[-1], extension) + DONE
        last = {**_head(self._identity, chunk=True), "choices": [], "usage": usage(result), **extension}
        return data + self._event(finishes[-1]) + self._frame(last) + DONE

    def failure(self, error: GenerationError) -> bytes:
        return error_event(error_object(error))

    def _reader(self, index: int) -> ToolCallReader:
        reader = self._readers.get(index)
        if reader is None:
            assert self._identity.tool_calling is not None
            reader = self._readers[index] = ToolCallReader(self._identity.tool_calling)
        return reader

    def _deltas(self, index: int, deltas: Sequence[ReaderDelta], logprobs: Sequence[TokenLogprobs]) -> bytes:
        """One chunk per content or call delta; the logprobs of the step on the first (on an
        empty delta when the step's text is all held back)."""
        chosen = chat_logprobs(logprobs, self._identity.token_bytes) if self._logprobs and logprobs else None
        deltas_json: list[dict[str, object]] = [_delta(delta) for delta in deltas]
        if not deltas_json and chosen is not None:
            deltas_json = [{}]
        data = b""
        for delta in deltas_json:
            data += self._event(self._choice(index, delta, chosen, None))
            chosen = None
        return data

    def _choice(self, index: int, delta: object, logprobs: object, finish: str | None) -> dict[str, object]:
        choice: dict[str, object] = {"index": index}
        if self._identity.chat:
            choice["delta"] = delta
        else:
            choice["text"] = delta
        choice["logprobs"] = logprobs
        choice["finish_reason"] = finish
        return choice

    def _event(self, choice: dict[str, object], extra: dict[str, object] | None = None) -> bytes:
        body: dict[str, object] = {**_head(self._identity, chunk=True), "choices": [choice]}
        if self._include_usage and self._identity.chat:
            body["usage"] = None  # OpenAI's chat chunks say so; completions chunks have no null usage
        if extra:
            body.update(extra)
        return self._frame(body)

    @staticmethod
    def _frame(body: dict[str, object]) -> bytes:
        return b"data: " + json.dumps(body).encode() + b"\n\n"


def error_event(error: dict[str, object]) -> bytes:
    """A failure after the stream began: OpenAI's SDKs raise on an event with an `error` member."""
    return b"data: " + json.dumps({"error": error}).encode() + b"\n\n"


def chat_logprobs(items: Sequence[TokenLogprobs], token_bytes: Callable[[int], bytes]) -> dict[str, object]:
    return {
        "content": [
            {
                "token": item.token,
                "logprob": item.logprob,
                "bytes": list(token_bytes(item.token_id)),
                "top_logprobs": [
                    {"token": text, "logprob": logprob, "bytes": list(token_bytes(token_id))}
                    for token_id, text, logprob in item.top
                ],
            }
            for item in items
        ],
        "refusal": None,
    }


def _tool_call(call: ToolCall) -> dict[str, object]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def _delta(delta: ReaderDelta) -> dict[str, object]:
    if isinstance(delta, ContentDelta):
        return {"content": delta.text}
    call: dict[str, object] = {"index": delta.index}
    function: dict[str, object] = {"arguments": delta.arguments}
    if delta.id:
        call.update(id=delta.id, type="function")
        function["name"] = delta.name
    call["function"] = function
    return {"tool_calls": [call]}


def completion_logprobs(items: Sequence[TokenLogprobs], offset: int) -> dict[str, object]:
    """The legacy completions layout: parallel lists, alternatives as {token: logprob}."""
    offsets: list[int] = []
    for item in items:
        offsets.append(offset)
        offset += len(item.token)
    return {
        "tokens": [item.token for item in items],
        "token_logprobs": [item.logprob for item in items],
        "top_logprobs": [{text: logprob for _, text, logprob in item.top} for item in items],
        "text_offset": offsets,
    }


def models_list(entries: Sequence[tuple[str, str | None]], created: int) -> bytes:
    """The served models and adapters, each as (id, the base model an adapter runs on or None)."""
    data = [model_object(name, created, parent) for name, parent in entries]
    return json.dumps({"object": "list", "data": data}).encode()


def model_object(name: str, created: int, parent: str | None = None) -> dict[str, object]:
    """A model, or a LoRA adapter with its base as `parent` (vLLM's fields; `root` is the id)."""
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "tokenwire",
        "root": name,
        "parent": parent,
    }


def model_json(name: str, created: int, parent: str | None = None) -> bytes:
    return json.dumps(model_object(name, created, parent)).encode()


def _head(identity: Identity, *, chunk: bool) -> dict[str, object]:
    kind = ("chat.completion.chunk" if chunk else "chat.completion") if identity.chat else "text_completion"
    return {"id": identity.id, "object": kind, "created": identity.created, "model": identity.model}

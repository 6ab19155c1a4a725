"""The ASGI application of the OpenAI-compatible API, served by uvicorn (listener.py).

Threads: every call runs on the server's one event loop, the gRPC server's. Parsing a body
larger than INLINE_BODY_BYTES runs on this app's parse workers, and validating a large prompt
on the admission's validation workers, so nothing that grows with the input holds the loop.
Engine events arrive on the loop (the engine's sinks are called there) and go into one queue
per request, which the request's own task writes out.

A request's life: the protocol bounds its head (http_protocol.py); then route, authenticate (a
header check: an unauthenticated body is never read), require a JSON body (415 otherwise, so no
web page's form can post here), bound the body (Content-Length first, then a running byte count
with a deadline for the whole body), parse it into a RequestSpec, admit it exactly as gRPC
admits a GenerateRequest (api/admission.py: same callers, queue, priorities, validator,
telemetry), then answer with one JSON object or a stream of server-sent events. From admission
on, a task watches for the client going away; when it does, the generation is stopped with the
same abort path a gRPC cancel takes, within one decode step, and recorded as cancelled.

Every request writes exactly one access-log line (and span), whatever ends it: a refusal by the
protocol or here (404, 405, 401, 415, 413, 408, a malformed body), a client gone mid-body, an
internal error, the models routes, or the admission's own record from admission on. A refusal
sent before the request's body was read closes the connection, so that body is never read.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from tokenwire.server.api.adapter_admin import AdapterAdmin, check_may_manage
from tokenwire.server.api.admission import Admission, Admitted
from tokenwire.server.api.embeddings import Embedder
from tokenwire.server.api.registry import ModelRegistry
from tokenwire.server.engine.errors import ErrorKind, FieldViolation, GenerationError, excerpt
from tokenwire.server.engine.types import (
    AbortReason,
    Completed,
    EngineEvent,
    Failed,
    Started,
    TokensGenerated,
)
from tokenwire.server.openai_api import responses, responses_api
from tokenwire.server.openai_api.adapter_routes import (
    ADMIN_PATHS,
    LOAD_PATH,
    apply_adapter_change,
    parse_adapter_change,
)
from tokenwire.server.openai_api.embeddings import EMBEDDINGS_PATH, embeddings_json, parse_embeddings
from tokenwire.server.openai_api.endings import RequestEnding
from tokenwire.server.openai_api.errors import HttpResponse, error_object, http_error
from tokenwire.server.openai_api.http_protocol import REFUSAL_STATE
from tokenwire.server.openai_api.parsing import (
    IGNORED_HEADER,
    ParseBody,
    ParsedRequest,
    parse_chat,
    parse_completion,
)
from tokenwire.server.openai_api.responses_input import parse_responses
from tokenwire.server.security.auth import BearerTokenInterceptor
from tokenwire.server.security.callers import CallerDirectory
from tokenwire.server.telemetry.requests import RequestTelemetry

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

INLINE_BODY_BYTES = 16 * 1024
"""Bodies up to this size are parsed on the event loop: less work than the hop to a worker."""
PARSE_WORKERS = 2
JSON = b"application/json"
EVENT_STREAM = b"text/event-stream"


@dataclass(frozen=True)
class Route:
    operation: str
    """The method name the access log, spans and metrics record."""
    parse: ParseBody
    id_prefix: str
    whole: responses.WholeAnswer = responses.whole_completion
    """The answer's body, for a request that does not stream."""
    streamed: responses.StreamAnswer = responses.ChunkWriter.of
    """The writer of the answer's events, for a request that streams."""


ROUTES = {
    "/v1/chat/completions": Route("/v1/chat/completions", parse_chat, "chatcmpl-"),
    "/v1/completions": Route("/v1/completions", parse_completion, "cmpl-"),
}

# The Responses API: its own request parser and event writer, on chat's admission and output path.
ROUTES["/v1/responses"] = Route(
    "/v1/responses",
    parse_responses,
    "resp_",
    responses_api.whole_response,
    responses_api.ResponseEventWriter,
)
MODELS_PATH = "/v1/models"
RECORDED_PATH_CHARACTERS = 128
"""Longest path an access-log line names as its method, for a request to no route."""


def operation_of(path: str) -> str:
    """What the access log, spans and metrics name a request to `path` by."""
    route = ROUTES.get(path)
    if route is not None:
        return route.operation
    if path == MODELS_PATH or path.startswith(MODELS_PATH + "/"):
        return MODELS_PATH
    if path == EMBEDDINGS_PATH:
        return EMBEDDINGS_PATH
    if path in ADMIN_PATHS:
        return path
    return excerpt(path, RECORDED_PATH_CHARACTERS)


def _declares_body(metadata: list[tuple[str, str]]) -> bool:
    return any(
        (name == "content-length" and value.strip() != "0") or name == "transfer-encoding"
        for name, value in metadata
    )


def _is_json(metadata: list[tuple[str, str]]) -> bool:
    """Whether the request says its body is JSON: application/json, in UTF-8 if it names a charset."""
    declared = next((value for name, value in metadata if name == "content-type"), None)
    if declared is None:
        return False
    media, *parameters = (part.strip().lower() for part in declared.split(";"))
    charsets = [p.partition("=")[2].strip('" ') for p in parameters if p.startswith("charset=")]
    return media == "application/json" and all(charset == "utf-8" for charset in charsets)


class _ClientGoneError(Exception):
    """The client disconnected before its request was whole."""


class OpenAIApp:
    def __init__(
        self,
        registry: ModelRegistry,
        admission: Admission,
        telemetry: RequestTelemetry,
        callers: CallerDirectory,
        *,
        tokens: BearerTokenInterceptor | None,
        adapter_admin: AdapterAdmin | None = None,
        max_body_bytes: int,
        body_timeout: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._registry = registry
        self._admission = admission
        self._telemetry = telemetry
        self._callers = callers
        self._tokens = tokens
        self._adapter_admin = adapter_admin
        self._max_body_bytes = max_body_bytes
        self._body_timeout = body_timeout
        self._clock = clock
        self._workers = ThreadPoolExecutor(PARSE_WORKERS, thread_name_prefix="http-parse")
        self._created = int(time.time())
        self._embedder = Embedder(registry)

    def close(self) -> None:
        self._workers.shutdown(wait=False, cancel_futures=True)

    def record_refusal(
        self, operation: str, metadata: list[tuple[str, str]] | None, received: float, error: GenerationError
    ) -> None:
        """Record a request refused before this app saw it (by the protocol, from its head)."""
        RequestEnding(self._telemetry, self._callers, operation, metadata, received).refused(error)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return  # the listener runs without lifespan events and refuses websockets
        received = self._clock()
        metadata = [(name.decode("latin-1"), value.decode("latin-1")) for name, value in scope["headers"]]
        path: str = scope["path"]
        ending = RequestEnding(self._telemetry, self._callers, operation_of(path), metadata, received)
        unread = _declares_body(metadata)
        try:
            if path == MODELS_PATH or path.startswith(MODELS_PATH + "/"):
                await self._models(scope["method"], path, metadata, ending, send)
                return
            if path == EMBEDDINGS_PATH:
                await self._embeddings(scope["method"], metadata, received, ending, receive, send)
                return
            if path in ADMIN_PATHS and self._adapter_admin is not None:
                await self._change_adapter(path, scope["method"], metadata, received, ending, receive, send)
                return
            route = ROUTES.get(path)
            if route is None:
                error = GenerationError(
                    ErrorKind.NOT_FOUND, f"no route {excerpt(path, 256)}", reason="NOT_FOUND"
                )
                await _refuse(send, ending, error, close=unread)
                return
            if scope["method"] != "POST":
                await _refuse(
                    send, ending, _method_not_allowed("POST"), status=405, close=unread, allow=b"POST"
                )
                return
            await self._generate(route, metadata, received, ending, receive, send)
        except _ClientGoneError:
            refused = scope["state"].get(REFUSAL_STATE)  # the protocol refused it and closed
            if isinstance(refused, GenerationError):
                ending.refused(refused)
            else:
                ending.left()
        except Exception:
            log.exception("HTTP request %s failed", excerpt(path, 256))
            error = GenerationError(ErrorKind.INTERNAL, "internal error", reason="INTERNAL")
            # Past the response's start the connection can only be dropped; uvicorn does that.
            ending.refused(error)
            with contextlib.suppress(Exception):
                await _respond(send, http_error(error))

    async def _models(
        self, method: str, path: str, metadata: list[tuple[str, str]], ending: RequestEnding, send: Send
    ) -> None:
        if method != "GET":
            await _refuse_method(send, ending, metadata, "GET")
            return
        refused = self._authenticate(metadata)
        if refused is not None:
            await _refuse(send, ending, refused, close=_declares_body(metadata))
            return
        entries: dict[str, str | None] = {}
        for served in self._registry.all():
            entries[served.name] = None
            entries.update((adapter.name, served.name) for adapter in served.adapters)
        if path == MODELS_PATH:
            ending.served()
            await _respond(send, _ok(responses.models_list(list(entries.items()), self._created)))
            return
        name = path[len(MODELS_PATH) + 1 :]
        if name not in entries:
            error = GenerationError(
                ErrorKind.NOT_FOUND, f"model {name[:256]!r} is not served here", reason="MODEL_NOT_FOUND"
            )
            await _refuse(send, ending, error)
            return
        ending.served()
        await _respond(send, _ok(responses.model_json(name, self._created, entries[name])))

    def _authenticate(self, metadata: list[tuple[str, str]]) -> GenerationError | None:
        return None if self._tokens is None else self._tokens.check(metadata)

    async def _generate(
        self,
        route: Route,
        metadata: list[tuple[str, str]],
        received: float,
        ending: RequestEnding,
        receive: Receive,
        send: Send,
    ) -> None:
        if not await self._takes_body(metadata, ending, send):
            return
        try:
            body = await self._read_body(metadata, received, receive)
            headers = dict(metadata)
            request_id = route.id_prefix + uuid.uuid4().hex[:24]
            if len(body) <= INLINE_BODY_BYTES:
                parsed = route.parse(body, headers, request_id)
            else:
                loop = asyncio.get_running_loop()
                parsed = await loop.run_in_executor(self._workers, route.parse, body, headers, request_id)
        except GenerationError as error:
            ending.refused(error)
            await _respond(send, _refusal(error))
            return
        events: asyncio.Queue[EngineEvent | None] = asyncio.Queue()
        # From here on the admission writes the request's record (an unexpected error inside it
        # excepted, which this app records as INTERNAL).
        try:
            admitted = await self._admission.admit(
                route.operation,
                metadata,
                parsed.admission_input(),
                received=received,
                call_deadline=None,
                on_event=events.put_nowait,
            )
        except GenerationError as error:
            ending.handed_over()
            await _respond(send, http_error(error))
            return
        ending.handed_over()
        watcher = asyncio.create_task(_watch_disconnect(receive, admitted, events))
        try:
            model = admitted_model(parsed, self._registry)
            identity = responses.Identity(
                parsed.spec.request_id,
                int(time.time()),
                model,
                parsed.chat,
                self._registry.resolve(model).model.tokenizer.token_bytes,
                admitted.tool_calling,
            )
            if parsed.stream:
                await _stream(route.streamed(identity, parsed), identity, parsed, events, watcher, send)
            else:
                await _whole(route.whole, identity, parsed, events, watcher, send)
        except BaseException:
            admitted.stop(AbortReason.DISCONNECTED)  # nobody is left to hear the generation
            raise
        finally:
            watcher.cancel()

    async def _takes_body(self, metadata: list[tuple[str, str]], ending: RequestEnding, send: Send) -> bool:
        """Whether the request may send its body: authenticated, and JSON; otherwise refused
        here, its body unread."""
        refused = self._authenticate(metadata)
        if refused is not None:
            await _refuse(send, ending, refused, close=_declares_body(metadata))
            return False
        if not _is_json(metadata):
            await _refuse(send, ending, _unsupported_media_type(), status=415, close=_declares_body(metadata))
            return False
        return True

    # -- /v1/embeddings --------------------------------------------------------------------------

    async def _embeddings(
        self,
        method: str,
        metadata: list[tuple[str, str]],
        received: float,
        ending: RequestEnding,
        receive: Receive,
        send: Send,
    ) -> None:
        async def answer(body: bytes) -> bytes:
            loop = asyncio.get_running_loop()
            parsed = await loop.run_in_executor(self._workers, parse_embeddings, body)
            embedded = await self._embedder.embed(parsed.request)
            # The response grows with the inputs: it is written off the event loop too.
            return await loop.run_in_executor(self._workers, embeddings_json, embedded, parsed.encoding)

        await self._post_json(method, metadata, received, ending, receive, send, answer)

    # -- /v1/load_lora_adapter, /v1/unload_lora_adapter ------------------------------------------

    async def _change_adapter(
        self,
        path: str,
        method: str,
        metadata: list[tuple[str, str]],
        received: float,
        ending: RequestEnding,
        receive: Receive,
        send: Send,
    ) -> None:
        admin = self._adapter_admin
        assert admin is not None
        loading = path == LOAD_PATH

        async def answer(body: bytes) -> bytes:
            check_may_manage(self._callers.identify(metadata))
            change = await asyncio.get_running_loop().run_in_executor(
                self._workers, functools.partial(parse_adapter_change, body, loading=loading)
            )
            return await apply_adapter_change(admin, change, loading=loading)

        await self._post_json(method, metadata, received, ending, receive, send, answer)

    async def _post_json(
        self,
        method: str,
        metadata: list[tuple[str, str]],
        received: float,
        ending: RequestEnding,
        receive: Receive,
        send: Send,
        answer: Callable[[bytes], Awaitable[bytes]],
    ) -> None:
        """A POST route answered whole in JSON: refused unless authenticated and JSON, its body
        read within the bounds, then `answer(body)` (its GenerationError the refusal)."""
        if method != "POST":
            await _refuse_method(send, ending, metadata, "POST")
            return
        if not await self._takes_body(metadata, ending, send):
            return
        try:
            body = await self._read_body(metadata, received, receive)
            response = await answer(body)
        except GenerationError as error:
            ending.refused(error)
            await _respond(send, _refusal(error))
            return
        ending.served()
        await _respond(send, _ok(response))

    async def _read_body(self, metadata: list[tuple[str, str]], received: float, receive: Receive) -> bytes:
        """The whole body, within its byte bound and the body deadline. Raises GenerationError
        for a body too large (413) or too slow (408), _ClientGoneError for a client gone away."""
        limit = self._max_body_bytes
        declared = next((value for name, value in metadata if name == "content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise _too_large(int(declared), limit)
        deadline = received + self._body_timeout
        chunks: list[bytes] = []
        size = 0
        while True:
            remaining = deadline - self._clock()
            try:
                if remaining <= 0:
                    raise TimeoutError
                message = await asyncio.wait_for(receive(), remaining)
            except TimeoutError:
                raise GenerationError(
                    ErrorKind.DEADLINE_EXCEEDED,
                    f"the request body did not arrive within {self._body_timeout:g}s (--http-body-timeout)",
                    reason="BODY_TIMEOUT",
                ) from None
            if message["type"] == "http.disconnect":
                raise _ClientGoneError
            chunk: bytes = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _too_large(size, limit, at_least=True)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def admitted_model(parsed: ParsedRequest, registry: ModelRegistry) -> str:
    """The served model's name: the one asked for (a `base:adapter` or an adapter's name routed
    to its base, as admission did), or the default."""
    model, _ = registry.route(parsed.spec.model, parsed.spec.adapter)
    return model or registry.default.name


async def _watch_disconnect(
    receive: Receive, admitted: Admitted, events: asyncio.Queue[EngineEvent | None]
) -> None:
    # After the body, uvicorn's receive() returns only when the client has gone (or the
    # response is complete, by which time this task has been cancelled).
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            admitted.stop(AbortReason.DISCONNECTED)
            events.put_nowait(None)
            return


async def _whole(
    whole: responses.WholeAnswer,
    identity: responses.Identity,
    parsed: ParsedRequest,
    events: asyncio.Queue[EngineEvent | None],
    watcher: asyncio.Task[None],
    send: Send,
) -> None:
    while True:
        event = await events.get()
        if event is None:
            return
        if isinstance(event, Completed):
            watcher.cancel()
            body = whole(identity, parsed, event.result)
            await _respond(send, HttpResponse(200, body, _ignored_header(parsed)))
            return
        if isinstance(event, Failed):
            watcher.cancel()
            await _respond(send, http_error(event.error))
            return


async def _stream(
    writer: responses.StreamWriter,
    identity: responses.Identity,
    parsed: ParsedRequest,
    events: asyncio.Queue[EngineEvent | None],
    watcher: asyncio.Task[None],
    send: Send,
) -> None:
    first = await events.get()
    if first is None:
        return
    if isinstance(first, Failed):  # nothing sent yet: a plain error response with its status
        watcher.cancel()
        await _respond(send, http_error(first.error))
        return
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [
                (b"content-type", EVENT_STREAM),
                (b"cache-control", b"no-cache"),
                (b"x-request-id", identity.id.encode()),
                *_ignored_header(parsed),
            ],
        }
    )
    opening = writer.opening()
    event: EngineEvent | None = first
    while True:
        if event is None:
            return
        if isinstance(event, Started | TokensGenerated):
            data = opening + (
                writer.tokens(event.text, event.logprobs, event.index)
                if isinstance(event, TokensGenerated)
                else b""
            )
            opening = b""
            if data:
                await send({"type": "http.response.body", "body": data, "more_body": True})
        elif isinstance(event, Completed):
            watcher.cancel()
            await send({"type": "http.response.body", "body": opening + writer.closing(event.result)})
            return
        elif isinstance(event, Failed):
            watcher.cancel()
            data = opening + writer.failure(event.error)
            await send({"type": "http.response.body", "body": data})
            return
        event = await events.get()


def _ignored_header(parsed: ParsedRequest) -> tuple[tuple[bytes, bytes], ...]:
    """Names the parameters of the request that this server accepted and ignored."""
    if not parsed.ignored:
        return ()
    return ((IGNORED_HEADER.encode(), ", ".join(parsed.ignored).encode()),)


def _refusal(error: GenerationError) -> HttpResponse:
    if error.reason == "BODY_TOO_LARGE":  # bad input, not load: the client must send less
        refusal = {**error_object(error), "type": "invalid_request_error"}
        # The rest of the body is never read: the connection closes after the answer.
        return HttpResponse(413, json.dumps({"error": refusal}).encode(), (_CLOSE,))
    if error.reason == "BODY_TIMEOUT":
        return HttpResponse(408, http_error(error).body, (_CLOSE,))
    return http_error(error)


_CLOSE = (b"connection", b"close")


async def _refuse(
    send: Send,
    ending: RequestEnding,
    error: GenerationError,
    *,
    status: int | None = None,
    close: bool = False,
    allow: bytes | None = None,
) -> None:
    """Record `error` as the request's ending and answer it (with `status` instead of the error
    kind's); `close`: the request's body is unread, so the connection closes after the answer;
    `allow`: the method a 405 names."""
    ending.refused(error)
    response = http_error(error)
    headers = response.headers
    if error.kind is ErrorKind.UNAUTHENTICATED:
        headers += ((b"www-authenticate", b"Bearer"),)
    if allow is not None:
        headers += ((b"allow", allow),)
    if close:
        headers += (_CLOSE,)
    await _respond(send, HttpResponse(status or response.status, response.body, headers))


async def _refuse_method(
    send: Send, ending: RequestEnding, metadata: list[tuple[str, str]], allowed: str
) -> None:
    """A 405 naming the method the path takes."""
    await _refuse(
        send,
        ending,
        _method_not_allowed(allowed),
        status=405,
        close=_declares_body(metadata),
        allow=allowed.encode(),
    )


def _unsupported_media_type() -> GenerationError:
    return GenerationError(
        ErrorKind.INVALID_ARGUMENT,
        "the body must be JSON, sent with Content-Type: application/json",
        violations=(FieldViolation("content-type", "must be application/json"),),
        reason="UNSUPPORTED_MEDIA_TYPE",
    )


def _too_large(size: int, limit: int, *, at_least: bool = False) -> GenerationError:
    amount = f"at least {size}" if at_least else str(size)
    return GenerationError(
        ErrorKind.RESOURCE_EXHAUSTED,
        f"the request body is {amount} bytes, more than {limit} (--max-receive-message-bytes)",
        reason="BODY_TOO_LARGE",
    )


def _method_not_allowed(allowed: str) -> GenerationError:
    return GenerationError(ErrorKind.INVALID_ARGUMENT, f"use {allowed}", reason="METHOD_NOT_ALLOWED")


def _ok(body: bytes) -> HttpResponse:
    return HttpResponse(200, body)


async def _respond(send: Send, response: HttpResponse, content_type: bytes = JSON) -> None:
    headers = [
        (b"content-type", content_type),
        (b"content-length", str(len(response.body)).encode()),
        *response.headers,
    ]
    await send({"type": "http.response.start", "status": response.status, "headers": headers})
    await send({"type": "http.response.body", "body": response.body})

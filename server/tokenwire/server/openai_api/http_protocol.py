"""uvicorn's httptools protocol with bounds on everything a client sends before the app runs.

uvicorn bounds nothing of a request's head: httptools buffers a header until it is whole and
uvicorn keeps every header (and every trailer, into the same list) and the whole URL, all before
any application code, so one connection sending endless headers grows the server without limit,
and a connection that never finishes its head is held forever. Here, at the protocol, before any
parsing work is done on bytes past a bound and before the app (and authentication) run:

- the head (request line and headers) may hold `head_bytes`: bytes are fed to the parser at most
  one past the bound at a time, so a head that passes it is refused at once with 431;
- at most `headers` headers (431) and a URL of at most `url_bytes` (414);
- chunk framing and trailers together at most `head_bytes` beyond the body's own bytes, and at
  most `headers` trailers (413); trailers never join the request's headers;
- the head must be whole within `header_timeout` seconds of its first byte (of the connection,
  for its first request): 408;
- at most `max_connections` connections, or open requests, at once: 503.

A refusal is written here as a JSON error body with `connection: close`, and nothing more of the
request is parsed; it is recorded through `refusals` (the access log), or,
when the app already runs for that request, handed to the app in its scope's state
(REFUSAL_STATE), which records it instead, so each request still writes exactly one line.

Closing a connection whose client is still sending would make the kernel answer its next bytes
with a reset, which can destroy the answer before the client reads it. So a connection closed in
the middle of a request (every refusal, uvicorn's own `connection: close` after a 413) is closed
the way HTTP servers do it: the answer, then end-of-stream, then whatever the client still sends
is discarded unparsed, at most LINGER_BYTES or LINGER_SECONDS, then the socket closes.
"""

from __future__ import annotations

import asyncio
import http
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from tokenwire.server.engine.errors import ErrorKind, GenerationError, excerpt
from tokenwire.server.openai_api.errors import http_error

UNKNOWN_OPERATION = "HTTP"
"""The access log's method for a request refused before its path was known."""
REFUSAL_STATE = "tokenwire.refusal"
"""Key in a request's scope["state"] under which the protocol hands the app its refusal."""

LINGER_BYTES = 64 * 1024
LINGER_SECONDS = 2.0

Headers = list[tuple[str, str]]
RecordRefusal = Callable[[str, Headers | None, float, GenerationError], None]
"""(operation, headers so far, when the request's first byte came, the error) -> one log line."""


@dataclass(frozen=True)
class HeadLimits:
    head_bytes: int = 64 * 1024
    headers: int = 100
    url_bytes: int = 8 * 1024
    header_timeout: float = 10.0
    max_connections: int = 1024


@dataclass(frozen=True)
class Refusal:
    status: int
    error: GenerationError


def _invalid(status: int, reason: str, message: str) -> Refusal:
    return Refusal(status, GenerationError(ErrorKind.INVALID_ARGUMENT, message, reason=reason))


class _RefusedError(Exception):
    """Raised from a parser callback to stop parsing a refused request at once."""


@dataclass(frozen=True)
class ProtocolSettings:
    limits: HeadLimits
    record_refusal: RecordRefusal
    operation_of: Callable[[str], str]
    """The access log's name for a request to a path."""


class BoundedHttpProtocol(HttpToolsProtocol):
    """HttpToolsProtocol within HeadLimits. Configure a subclass with `bounded_protocol`."""

    settings: ClassVar[ProtocolSettings]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = self.settings.limits
        self._reading_head = True
        self._head_bytes = 0
        self._head_started: float | None = None
        self._head_deadline: asyncio.TimerHandle | None = None
        self._header_count = 0
        self._body_phase_bytes = 0
        self._payload_bytes = 0
        self._app_runs = False
        self._refused = False
        self._socket: asyncio.Transport | None = None
        self._lingering: asyncio.TimerHandle | None = None
        self._discarded = 0

    # -- the connection ---------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._socket = transport
        # uvicorn (and its request cycles) close through this, so every close can linger.
        super().connection_made(cast(asyncio.Transport, _LingeringClose(transport, self._close)))
        self._arm_head_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_deadline()
        if self._lingering is not None:
            self._lingering.cancel()
        super().connection_lost(exc)

    def _close(self) -> None:
        """Close the connection; in the middle of a request, with a lingering close."""
        socket = self._socket
        assert socket is not None
        if self._lingering is not None or socket.is_closing():
            return
        between_requests = self._reading_head and self._head_bytes == 0
        if between_requests or not socket.can_write_eof():
            socket.close()
            return
        socket.write_eof()
        socket.resume_reading()
        self._lingering = self.loop.call_later(LINGER_SECONDS, socket.close)

    def data_received(self, data: bytes) -> None:
        if self._lingering is not None:
            self._discarded += len(data)
            if self._discarded > LINGER_BYTES and self._socket is not None:
                self._socket.close()
            return
        self._unset_keepalive_if_required()
        limit = self.limits.head_bytes
        while data and not self._refused:
            if self._reading_head:
                if self._head_deadline is None:
                    self._arm_head_deadline()
                if self._head_started is None:
                    self._head_started = time.monotonic()
                # One byte past the bound at most: the parser never sees a head beyond it.
                piece, data = data[: limit - self._head_bytes + 1], data[limit - self._head_bytes + 1 :]
                self._head_bytes += len(piece)
            else:
                piece, data = data, b""
                self._body_phase_bytes += len(piece)
            try:
                self.parser.feed_data(piece)
            except httptools.HttpParserUpgrade:
                pass  # no protocol upgrades here: the request is served as plain HTTP/1.1
            except httptools.HttpParserError as error:
                if not self._refused:
                    self._refuse(
                        _invalid(400, "MALFORMED_HTTP", f"malformed HTTP request: {excerpt(str(error), 120)}")
                    )
                return
            if self._refused:
                return
            if self._reading_head and self._head_bytes > limit:
                self._refuse(
                    _invalid(
                        431,
                        "HEADERS_TOO_LARGE",
                        f"the request's head is larger than {limit} bytes (--http-max-head-bytes)",
                    )
                )
            elif not self._reading_head and self._body_phase_bytes - self._payload_bytes > limit:
                self._refuse(
                    _invalid(
                        413,
                        "TRAILERS_TOO_LARGE",
                        f"chunk framing and trailers past {limit} bytes (--http-max-head-bytes)",
                    )
                )

    # -- parser callbacks -------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_count = 0
        self._app_runs = False

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        if len(self.url) > self.limits.url_bytes:
            self._refuse(
                _invalid(
                    414,
                    "URL_TOO_LONG",
                    f"the URL is longer than {self.limits.url_bytes} bytes (--http-max-url-bytes)",
                )
            )
            raise _RefusedError

    def on_header(self, name: bytes, value: bytes) -> None:
        # Headers and trailers are counted alike (each costs a callback); a trailer is never one
        # of the request's headers, and its bytes count with the framing.
        self._header_count += 1
        if not self._reading_head:
            if self._header_count > self.limits.headers:
                self._refuse(
                    _invalid(
                        413,
                        "TRAILERS_TOO_LARGE",
                        f"more than {self.limits.headers} trailers (--http-max-headers)",
                    ),
                    path=self._path(),
                )
                raise _RefusedError
            return
        if self._header_count > self.limits.headers:
            self._refuse(
                _invalid(
                    431, "TOO_MANY_HEADERS", f"more than {self.limits.headers} headers (--http-max-headers)"
                ),
                path=self._path(),
            )
            raise _RefusedError
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._reading_head = False
        self._disarm_head_deadline()
        self._body_phase_bytes = self._payload_bytes = self._header_count = 0
        limit = self.limits.max_connections
        if len(self.connections) > limit or len(self.tasks) >= limit:
            error = GenerationError(
                ErrorKind.UNAVAILABLE,
                f"more than {limit} connections or requests are open (--http-max-connections)",
                reason="TOO_MANY_CONNECTIONS",
                retry_after=1.0,
            )
            self._refuse(Refusal(503, error), path=self._path())
            raise _RefusedError
        super().on_headers_complete()
        self._app_runs = True

    def on_body(self, body: bytes) -> None:
        self._payload_bytes += len(body)
        super().on_body(body)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._reading_head = True
        self._head_bytes = 0
        self._head_started = None

    # -- refusals ---------------------------------------------------------------------------------

    def _path(self) -> str | None:
        try:
            raw = httptools.parse_url(self.url).path
        except httptools.HttpParserInvalidURLError:
            return None
        return raw.decode("latin-1") if raw is not None else None

    def _refuse(self, refusal: Refusal, *, path: str | None = None) -> None:
        """Answer `refusal`, close the connection and record the request, once."""
        if self._refused:
            return
        self._refused = True
        self._disarm_head_deadline()
        response = http_error(refusal.error)
        status = refusal.status
        head = [
            f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}".encode(),
            b"content-type: application/json",
            b"content-length: " + str(len(response.body)).encode(),
            *(name + b": " + value for name, value in response.headers),
            b"connection: close",
        ]
        if self._app_runs and self.cycle is not None and not self.cycle.response_started:
            # The app is reading this request's body: it records the refusal when it sees the
            # connection go (a request whose response began can only be cut off).
            self.scope["state"][REFUSAL_STATE] = refusal.error
        elif not self._app_runs:
            operation = UNKNOWN_OPERATION if path is None else self.settings.operation_of(path)
            headers = [(n.decode("latin-1"), v.decode("latin-1")) for n, v in (self.headers or [])]
            received = self._head_started if self._head_started is not None else time.monotonic()
            self.settings.record_refusal(operation, headers, received, refusal.error)
        if self.transport.is_closing():
            return
        # A response already on its way (a pipelined request's predecessor) can only be cut off.
        streaming = (
            self.cycle is not None and self.cycle.response_started and not self.cycle.response_complete
        )
        if not streaming:
            self.transport.write(b"\r\n".join(head) + b"\r\n\r\n" + response.body)
        self._close()

    def _arm_head_deadline(self) -> None:
        self._disarm_head_deadline()
        self._head_deadline = self.loop.call_later(self.limits.header_timeout, self._head_too_slow)

    def _disarm_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_too_slow(self) -> None:
        self._head_deadline = None
        if not self._reading_head or self._refused:
            return
        if self._head_bytes == 0:  # nothing sent: not a request, so nothing to answer or record
            self.transport.close()
            return
        timeout = self.limits.header_timeout
        error = GenerationError(
            ErrorKind.DEADLINE_EXCEEDED,
            f"the request's headers did not arrive within {timeout:g}s (--http-header-timeout)",
            reason="HEADER_TIMEOUT",
        )
        self._refuse(Refusal(408, error))


class _LingeringClose:
    """A transport whose close() is the protocol's own; everything else is the transport's."""

    def __init__(self, transport: asyncio.Transport, close: Callable[[], None]) -> None:
        self._transport = transport
        self.close = close

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def bounded_protocol(
    limits: HeadLimits, record_refusal: RecordRefusal, operation_of: Callable[[str], str]
) -> type[BoundedHttpProtocol]:
    """The protocol class uvicorn instantiates per connection, with these limits and this log."""
    settings = ProtocolSettings(limits, record_refusal, operation_of)
    return type("ConfiguredHttpProtocol", (BoundedHttpProtocol,), {"settings": settings})

"""What an HTTP client sends before its body is bounded at the protocol, before any app code or
authentication runs: the head's bytes, its header count, the URL, chunk framing and trailers, and
the time to send the head. Each bound is refused with its status and `connection: close`, the
connection ends, and the request writes one access-log line. A body refused from its headers is
not read; a body that is not JSON is 415.

Requests are written on raw sockets (raw_http.exchange): no client library sends such requests.
"""

from __future__ import annotations

import asyncio
import io
import json
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.server.openai_api.conftest import http_settings
from tests.server.openai_api.raw_http import RawReply, exchange, request
from tests.support.polling import wait_until
from tests.support.servers import serving
from tokenwire.server.app import TokenwireServer
from tokenwire.server.openai_api import app as openai_app
from tokenwire.server.openai_api.settings import HttpSettings

HEADER_TIMEOUT = 0.5
MIB = 1 << 20
BODY = json.dumps({"model": "tiny", "prompt": "Hi", "max_tokens": 2}).encode()


@pytest.fixture
async def server(tiny_model_dir: Path) -> AsyncIterator[TokenwireServer]:
    settings = http_settings(tiny_model_dir, http=HttpSettings(port=0, header_timeout=HEADER_TIMEOUT))
    async with serving(settings) as started:
        yield started


def port_of(server: TokenwireServer) -> int:
    assert server.http_port is not None
    return server.http_port


async def send(server: TokenwireServer, chunks: Iterator[bytes] | list[bytes]) -> RawReply:
    return await asyncio.to_thread(exchange, port_of(server), chunks)


def lines(access: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in access.getvalue().splitlines()]


async def one_line(access: io.StringIO) -> dict[str, Any]:
    """The only access-log line written so far, once it is written."""
    await wait_until(lambda: len(lines(access)) >= 1)
    (line,) = lines(access)
    return line


def assert_refused(reply: RawReply, status: int, code: str) -> None:
    assert reply.status == status, reply
    assert reply.head.get("connection") == "close"
    assert reply.error()["code"] == code
    assert reply.closed, "the server kept the connection open"


def endless_headers() -> Iterator[bytes]:
    """A head that never ends: 16 MiB of 1 KiB headers, sent until the server answers."""
    yield b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"
    for _ in range(16 * MIB // 4096):
        yield (b"x-pad: " + b"p" * 1017 + b"\r\n") * 4


async def test_a_head_past_its_bound_is_431_before_it_is_whole(
    server: TokenwireServer, access_lines: io.StringIO
) -> None:
    reply = await send(server, endless_headers())
    assert_refused(reply, 431, "headers_too_large")
    line = await one_line(access_lines)
    assert (line["method"], line["outcome"], line["reason"]) == ("HTTP", "invalid", "HEADERS_TOO_LARGE")


async def test_too_many_headers_are_431(server: TokenwireServer, access_lines: io.StringIO) -> None:
    head = (
        b"GET /v1/models HTTP/1.1\r\nhost: x\r\n" + b"".join(b"x-%d: 1\r\n" % i for i in range(101)) + b"\r\n"
    )
    assert_refused(await send(server, [head]), 431, "too_many_headers")
    line = await one_line(access_lines)
    assert (line["method"], line["reason"]) == ("/v1/models", "TOO_MANY_HEADERS")


async def test_a_url_past_its_bound_is_414(server: TokenwireServer, access_lines: io.StringIO) -> None:
    url = b"/v1/models?" + b"q" * 9000
    assert_refused(await send(server, [b"GET " + url + b" HTTP/1.1\r\nhost: x\r\n\r\n"]), 414, "url_too_long")
    assert (await one_line(access_lines))["reason"] == "URL_TOO_LONG"


def endless_trailers() -> Iterator[bytes]:
    yield (
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"transfer-encoding: chunked\r\n\r\n"
    )
    yield b"%x\r\n" % len(BODY) + BODY + b"\r\n0\r\n"
    for _ in range(16 * MIB // 4096):
        yield b"t: v\r\n" * 680


async def test_trailers_past_the_bound_are_413(server: TokenwireServer, access_lines: io.StringIO) -> None:
    reply = await send(server, endless_trailers())
    assert_refused(reply, 413, "trailers_too_large")
    line = await one_line(access_lines)
    assert (line["method"], line["reason"]) == ("/v1/completions", "TRAILERS_TOO_LARGE")


def slow_head() -> Iterator[bytes]:
    yield b"POST /v1/completions HTTP/1.1\r\n"  # and then nothing: the rest never comes


async def test_a_head_slower_than_its_deadline_is_408(
    server: TokenwireServer, access_lines: io.StringIO
) -> None:
    assert_refused(await send(server, slow_head()), 408, "header_timeout")
    line = await one_line(access_lines)
    assert (line["outcome"], line["reason"]) == ("deadline", "HEADER_TIMEOUT")


async def test_a_connection_that_sends_nothing_is_closed_at_the_deadline(
    server: TokenwireServer, access_lines: io.StringIO
) -> None:
    reply = await send(server, [])
    assert reply.closed and reply.status is None and reply.body == b""
    assert lines(access_lines) == []  # not a request: nothing to answer or record


def huge_declared_body() -> Iterator[bytes]:
    yield (
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n" % (150 * MIB)
    )
    for _ in range(150 * MIB // 65536):
        yield b" " * 65536


async def test_a_body_refused_from_its_length_is_not_read(
    server: TokenwireServer, access_lines: io.StringIO
) -> None:
    reply = await send(server, huge_declared_body())
    assert_refused(reply, 413, "body_too_large")
    assert (await one_line(access_lines))["reason"] == "BODY_TOO_LARGE"


@pytest.mark.parametrize(
    "content_type",
    [
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        None,
        "application/json; charset=latin-1",
    ],
)
async def test_a_body_that_is_not_json_is_415(
    content_type: str | None, server: TokenwireServer, access_lines: io.StringIO
) -> None:
    typed = b"" if content_type is None else b"content-type: %s\r\n" % content_type.encode()
    head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n" + typed + b"content-length: %d\r\n\r\n" % len(BODY)
    reply = await send(server, [head + BODY])
    assert reply.status == 415, reply
    assert reply.error()["param"] == "content-type" and reply.error()["code"] == "unsupported_media_type"
    assert (await one_line(access_lines))["reason"] == "UNSUPPORTED_MEDIA_TYPE"


async def test_json_with_its_charset_is_served(server: TokenwireServer) -> None:
    reply = await request(
        port_of(server),
        "POST",
        "/v1/completions",
        BODY,
        headers={"content-type": "application/json; charset=UTF-8"},
    )
    assert reply.status == 200, reply.body


# -- one access-log line whatever ends a request ---------------------------------------------------


async def test_refusals_and_endings_each_write_one_access_line(
    server: TokenwireServer, access_lines: io.StringIO, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = port_of(server)
    assert (await request(port, "GET", "/nowhere")).status == 404
    assert (await request(port, "GET", "/v1/completions")).status == 405
    assert (await request(port, "GET", "/v1/models")).status == 200
    assert (await send(server, [b"BREW /v1/models HTCPCP/1.0\r\n\r\n"])).status == 400

    # A client gone in the middle of its body.
    head = (
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: 1000\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", port)) as gone:
        gone.sendall(head + b'{"model":')
    await wait_until(lambda: len(lines(access_lines)) >= 5)

    # An internal error.
    def broken(*_: object) -> object:
        raise RuntimeError("a bug")

    route = openai_app.ROUTES["/v1/completions"]
    monkeypatch.setitem(
        openai_app.ROUTES, "/v1/completions", openai_app.Route(route.operation, broken, "cmpl-")
    )
    assert (await request(port, "POST", "/v1/completions", BODY)).status == 500
    await wait_until(lambda: len(lines(access_lines)) >= 6)

    written = [(line["method"], line["outcome"], line["reason"]) for line in lines(access_lines)]
    assert written == [
        ("/nowhere", "invalid", "NOT_FOUND"),
        ("/v1/completions", "invalid", "METHOD_NOT_ALLOWED"),
        ("/v1/models", "ok", None),
        ("HTTP", "invalid", "MALFORMED_HTTP"),
        ("/v1/completions", "cancelled", None),
        ("/v1/completions", "error", "INTERNAL"),
    ]


async def test_over_the_connection_bound_is_503_with_its_line(
    tiny_model_dir: Path, access_lines: io.StringIO
) -> None:
    settings = http_settings(tiny_model_dir, http=HttpSettings(port=0, max_connections=2))
    async with serving(settings) as server:
        port = port_of(server)
        # Accepted in order: both are open by the time the third's request is read.
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
        try:
            reply = await send(server, [b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n"])
        finally:
            for connection in held:
                connection.close()
    assert_refused(reply, 503, "too_many_connections")
    assert reply.head.get("retry-after") == "1"
    (line,) = lines(access_lines)
    assert (line["method"], line["outcome"], line["reason"]) == (
        "/v1/models",
        "rejected",
        "TOO_MANY_CONNECTIONS",
    )

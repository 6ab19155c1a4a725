"""The isolation attacks, against the OpenAI-compatible HTTP edge of the same `tokenwire serve`.

The server, the innocent gRPC streaming client and the measurement are those of
test_isolation.py (its module fixtures, imported): the serve process there also listens with
`--http-port 0 --http-body-timeout 1`. Each attack here comes over HTTP, and each test checks
what test_isolation's do: the innocent's longest gap stays within its bound and it sees no
failure, the server's memory grows by a bounded amount, and the attacker gets the documented
status with a small error body.

Requests are written with http.client, which sends headers and body separately, so a test can
declare a body and never send it, send one slowly, or send more than it declared a chunk at a time.
"""

# The shared module fixtures are imported by name and taken as arguments of the same name.
# ruff: noqa: F811

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import time
from typing import Any

import pytest

from tests.reliability.server_process import procfs_available
from tests.reliability.test_isolation import (  # noqa: F401 - module fixtures of the shared server
    MIB,
    SMALL_ERROR_BYTES,
    TOKEN,
    Innocent,
    Scale,
    Server,
    alone,
    during,
    innocent,
    scale,
    server,
)

pytestmark = pytest.mark.skipif(not procfs_available(), reason="reads RSS from /proc (Linux)")

AUTH = {"authorization": f"Bearer {TOKEN}"}
MAX_BODY_BYTES = 1024 * 1024
"""--max-receive-message-bytes at its default: the HTTP body bound too."""
BODY_TIMEOUT = 1.0
"""--http-body-timeout of the shared server."""


def _connection(server: Server, timeout: float = 30) -> http.client.HTTPConnection:
    assert server.http_port, "the shared server was started without --http-port"
    return http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=timeout)


def _reply(connection: http.client.HTTPConnection) -> tuple[int, dict[str, Any], int]:
    response = connection.getresponse()
    body = response.read()
    return response.status, json.loads(body), len(body)


def declared_but_never_sent(
    server: Server, size: int, headers: dict[str, str]
) -> tuple[int, dict[str, Any], int]:
    """Headers announcing a `size`-byte body, then nothing: the answer must not wait for it."""
    connection = _connection(server)
    try:
        connection.putrequest("POST", "/v1/chat/completions")
        for name, value in {
            **headers,
            "content-type": "application/json",
            "content-length": str(size),
        }.items():
            connection.putheader(name, value)
        connection.endheaders()
        return _reply(connection)
    finally:
        connection.close()


def chunked_past_the_bound(server: Server) -> tuple[int, dict[str, Any], int]:
    """A chunked body with no length, sent until the server answers (or twice the bound)."""
    connection = _connection(server)
    piece = b'{"pad": "' + b"x" * (64 * 1024) + b'"}'
    try:
        connection.putrequest("POST", "/v1/completions")
        for name, value in {
            **AUTH,
            "content-type": "application/json",
            "transfer-encoding": "chunked",
        }.items():
            connection.putheader(name, value)
        connection.endheaders()
        sent = 0
        try:
            while sent < 2 * MAX_BODY_BYTES:
                connection.send(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
                sent += len(piece)
        except OSError:
            pass  # the server answered and closed while more was on its way
        return _reply(connection)
    finally:
        connection.close()


async def test_bodies_over_the_bound_are_refused_before_they_are_read(
    server: Server, innocent: Innocent, alone: dict[str, Any], scale: Scale
) -> None:
    replies: list[tuple[int, dict[str, Any], int]] = []

    async def attack() -> None:
        for _ in range(scale.repeats):
            replies.append(await asyncio.to_thread(declared_but_never_sent, server, 64 * MIB, AUTH))
            replies.append(await asyncio.to_thread(chunked_past_the_bound, server))

    measured = await during(server, innocent, alone, "HTTP bodies over the bound", attack())
    assert len(replies) == 2 * scale.repeats
    for status, body, size in replies:
        assert status == 413, body
        assert "--max-receive-message-bytes" in body["error"]["message"]
        assert body["error"]["code"] == "body_too_large" and body["error"]["type"] == "invalid_request_error"
        assert size < SMALL_ERROR_BYTES
    assert measured.rss_growth < 64 * MIB


async def test_unauthenticated_big_bodies_cost_a_header_check(
    server: Server, innocent: Innocent, alone: dict[str, Any], scale: Scale
) -> None:
    replies: list[tuple[int, dict[str, Any], int]] = []

    async def attack() -> None:
        deadline = time.monotonic() + scale.seconds
        while time.monotonic() < deadline:
            replies.append(await asyncio.to_thread(declared_but_never_sent, server, MAX_BODY_BYTES, {}))

    measured = await during(server, innocent, alone, "HTTP unauthenticated big bodies", attack())
    assert replies and all(
        status == 401 and body["error"]["code"] == "token_missing" for status, body, _ in replies
    )
    assert measured.rss_growth < 64 * MIB


def json_with_too_many_messages() -> bytes:
    """As many empty chat messages as fit the body bound (about 37,000), far over --max-messages."""
    one = b'{"role":"user","content":""},'
    count = (MAX_BODY_BYTES - 100) // len(one)
    return b'{"model":"tiny","messages":[' + one * (count - 1) + one[:-1] + b"]}"


def post(server: Server, path: str, body: bytes) -> tuple[int, dict[str, Any], int]:
    connection = _connection(server)
    try:
        connection.request("POST", path, body=body, headers={**AUTH, "content-type": "application/json"})
        return _reply(connection)
    finally:
        connection.close()


async def test_a_body_at_the_bound_full_of_messages_is_refused_small_off_the_loop(
    server: Server, innocent: Innocent, alone: dict[str, Any], scale: Scale
) -> None:
    body = json_with_too_many_messages()
    assert MAX_BODY_BYTES - 200 < len(body) <= MAX_BODY_BYTES
    replies: list[tuple[int, dict[str, Any], int]] = []

    async def attack() -> None:
        for _ in range(scale.repeats):
            replies.append(await asyncio.to_thread(post, server, "/v1/chat/completions", body))

    measured = await during(server, innocent, alone, "HTTP body full of messages", attack())
    for status, error, size in replies:
        assert status == 400 and error["error"]["param"] == "messages", error
        assert size < SMALL_ERROR_BYTES
    assert measured.rss_growth < 128 * MIB


def trickled(server: Server) -> tuple[int, dict[str, Any], int]:
    """A body sent a byte at a time, slower than the body deadline allows."""
    connection = _connection(server, timeout=10 * BODY_TIMEOUT)
    try:
        connection.putrequest("POST", "/v1/completions")
        for name, value in {**AUTH, "content-type": "application/json", "content-length": "1000"}.items():
            connection.putheader(name, value)
        connection.endheaders()
        started = time.monotonic()
        try:
            while time.monotonic() - started < 3 * BODY_TIMEOUT:
                connection.send(b" ")
                time.sleep(0.2)
        except OSError:
            pass  # refused and closed
        return _reply(connection)
    finally:
        connection.close()


async def test_slow_bodies_get_408_at_the_body_deadline(
    server: Server, innocent: Innocent, alone: dict[str, Any]
) -> None:
    async def attack() -> list[tuple[int, dict[str, Any], int]]:
        return list(await asyncio.gather(*(asyncio.to_thread(trickled, server) for _ in range(16))))

    task = asyncio.ensure_future(attack())
    measured = await during(server, innocent, alone, "HTTP slow bodies", _awaited(task))
    for status, body, size in task.result():
        assert status == 408, body
        assert body["error"]["code"] == "body_timeout" and size < SMALL_ERROR_BYTES
    assert measured.rss_growth < 64 * MIB


async def test_many_idle_connections_leave_streams_and_new_requests_alone(
    server: Server, innocent: Innocent, alone: dict[str, Any], scale: Scale
) -> None:
    assert server.http_port
    answers: list[tuple[int, dict[str, Any], int]] = []

    async def attack() -> None:
        idle = [socket.create_connection(("127.0.0.1", server.http_port)) for _ in range(300)]
        try:
            await asyncio.sleep(scale.seconds / 2)
            body = json.dumps({"model": "tiny", "prompt": "Still served", "max_tokens": 3}).encode()
            answers.append(await asyncio.to_thread(post, server, "/v1/completions", body))
        finally:
            for connection in idle:
                connection.close()

    measured = await during(server, innocent, alone, "HTTP 300 idle connections", attack())
    ((status, answer, _),) = answers
    assert status == 200 and answer["usage"]["completion_tokens"] >= 1
    assert measured.rss_growth < 64 * MIB


async def _awaited(task: asyncio.Future[Any]) -> None:
    await task

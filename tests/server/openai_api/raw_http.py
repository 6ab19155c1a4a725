"""Plain HTTP/1.1 requests with the standard library, for what an SDK will not send: malformed
bodies, wrong methods, bodies larger than declared, a body that never finishes."""

from __future__ import annotations

import asyncio
import http.client
import json
import select
import socket
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def error(self) -> dict[str, Any]:
        decoded = json.loads(self.body)
        assert set(decoded) == {"error"}, decoded
        assert set(decoded["error"]) == {"message", "type", "param", "code"}, decoded
        return dict(decoded["error"])


def request_now(
    port: int,
    method: str,
    path: str,
    body: bytes | Iterator[bytes] | None = None,
    headers: dict[str, str] | None = None,
    *,
    timeout: float = 30,
) -> Reply:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        sent = {"content-type": "application/json", **(headers or {})}
        if isinstance(body, bytes | type(None)):
            connection.request(method, path, body=body, headers=sent)
        else:
            connection.request(method, path, body=body, headers=sent, encode_chunked=True)
        response = connection.getresponse()
        return Reply(response.status, {k.lower(): v for k, v in response.getheaders()}, response.read())
    finally:
        connection.close()


async def request(port: int, method: str, path: str, body: Any = None, **options: Any) -> Reply:
    """A request from a worker thread, so the server's loop in this process serves it."""
    if body is not None and not isinstance(body, bytes):
        body = json.dumps(body).encode()
    return await asyncio.to_thread(request_now, port, method, path, body, **options)


@dataclass(frozen=True)
class RawReply:
    """What a raw connection got back: the answer's status line and head parsed, and whether the
    server ended the connection (end-of-stream within the read timeout)."""

    status: int | None
    head: dict[str, str]
    body: bytes
    closed: bool
    sent: int
    """Bytes the client got to send before it stopped (answered, or refused by the socket)."""

    def error(self) -> dict[str, Any]:
        return Reply(self.status or 0, self.head, self.body).error()


def exchange(
    port: int, chunks: Iterable[bytes], *, read_timeout: float = 10.0, send_buffer: int | None = None
) -> RawReply:
    """Send `chunks` until the server answers (or stops taking bytes), then read until it ends
    the connection or `read_timeout` passes without a byte. `send_buffer` bounds the socket's
    buffer, so the client cannot run far ahead of what the server reads."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if send_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
    sock.connect(("127.0.0.1", port))
    received = bytearray()
    sent = 0
    closed = False
    try:
        for chunk in chunks:
            readable, _, _ = select.select([sock], [], [], 0)
            if readable:
                break
            try:
                sock.sendall(chunk)
            except OSError:
                break
            sent += len(chunk)
        sock.settimeout(read_timeout)
        while True:
            try:
                data = sock.recv(65536)
            except TimeoutError:
                break
            except ConnectionResetError:
                closed = True
                break
            if not data:
                closed = True
                break
            received += data
    finally:
        sock.close()
    head, _, body = bytes(received).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1]) if lines[0].startswith("HTTP/1.1 ") else None
    fields = {
        name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines[1:])
    }
    return RawReply(status, fields, body, closed, sent)

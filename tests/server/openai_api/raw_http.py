"""Plain HTTP/1.1 requests with the standard library, for what an SDK will not send: malformed
bodies, wrong methods, bodies larger than declared, a body that never finishes."""

from __future__ import annotations

import asyncio
import http.client
import json
from collections.abc import Iterator
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

"""Domain errors -> OpenAI's error shape and HTTP status, as api/errors.py maps them to gRPC.

Body: {"error": {"message", "type", "param", "code"}}. `param` names the first offending
request parameter (or header) of a 400; `code` is the engine's stable reason in lower case
(e.g. "queue_full", "model_not_found"), or null. A 429 carries Retry-After in whole seconds,
rounded up, from the engine's own estimate.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from tokenwire.server.engine.errors import ErrorKind, GenerationError

STATUSES: dict[ErrorKind, tuple[int, str]] = {
    ErrorKind.INVALID_ARGUMENT: (400, "invalid_request_error"),
    ErrorKind.NOT_FOUND: (404, "invalid_request_error"),
    ErrorKind.ALREADY_EXISTS: (409, "invalid_request_error"),
    ErrorKind.UNAUTHENTICATED: (401, "authentication_error"),
    ErrorKind.PERMISSION_DENIED: (403, "permission_error"),
    ErrorKind.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    ErrorKind.DEADLINE_EXCEEDED: (504, "timeout_error"),
    ErrorKind.UNAVAILABLE: (503, "service_unavailable_error"),
    ErrorKind.INTERNAL: (500, "server_error"),
}


@dataclass(frozen=True)
class HttpResponse:
    """A whole response: status, JSON body and extra headers."""

    status: int
    body: bytes
    headers: tuple[tuple[bytes, bytes], ...] = ()


def error_object(error: GenerationError) -> dict[str, object]:
    """The `error` member of OpenAI's error body for `error`."""
    _, kind = STATUSES[error.kind]
    return {
        "message": error.message,
        "type": kind,
        "param": error.violations[0].field if error.violations else None,
        "code": error.reason.lower() if error.reason else None,
    }


def http_error(error: GenerationError) -> HttpResponse:
    status, _ = STATUSES[error.kind]
    headers: list[tuple[bytes, bytes]] = []
    if error.retry_after is not None:
        headers.append((b"retry-after", str(max(1, math.ceil(error.retry_after))).encode()))
    body = json.dumps({"error": error_object(error)}).encode()
    return HttpResponse(status, body, tuple(headers))


def plain_error(status: int, kind: str, message: str, code: str | None = None) -> HttpResponse:
    """An HTTP-level refusal that no engine error stands for: 404 path, 405, 408, 413."""
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return HttpResponse(status, json.dumps(body).encode())

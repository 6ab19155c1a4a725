"""Bearer-token authentication of every call, as a grpc.aio server interceptor.

A call must carry `authorization: Bearer <token>` metadata with one of the configured tokens;
otherwise it ends with UNAUTHENTICATED and the same rich details (ErrorInfo reason) as every
other error. The health and ORCA load report services can be left open, so load balancers
(and gRPC clients' own balancing) probe without a token.
Reflection is protected like the inference service.

Tokens are compared as SHA-256 digests with hmac.compare_digest against every configured token,
so neither a token's value, its length, nor which token matched shows in the response time.
Tokens are never logged; the refusal callback hears only the method and the reason.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import grpc

from tokenwire.server.engine.errors import ErrorKind, GenerationError
from tokenwire.server.engine.types import Caller
from tokenwire.server.metadata import Metadata
from tokenwire.server.method_handlers import Continuation
from tokenwire.server.security.callers import TokenLineError, default_name, parse_token_line

AUTH_TOKENS_ENV = "TOKENWIRE_AUTH_TOKENS"
LOAD_BALANCER_SERVICE_PREFIXES = ("/grpc.health.v1.Health/", "/xds.service.orca.v3.OpenRcaService/")
"""Health checks and ORCA load reports: gRPC clients open these per replica without call metadata."""
AUTHORIZATION = "authorization"
_SCHEME = "bearer"

MISSING = GenerationError(
    ErrorKind.UNAUTHENTICATED,
    "this server requires authorization: Bearer <token> metadata",
    reason="TOKEN_MISSING",
)
INVALID = GenerationError(ErrorKind.UNAUTHENTICATED, "the bearer token is not valid", reason="TOKEN_INVALID")

RefusalListener = Callable[[str, Metadata | None, GenerationError], None]
"""Hears (full method name, call metadata, error) for each refused call."""
Refuse = Callable[[grpc.aio.ServicerContext, GenerationError], Awaitable[None]]
"""Ends a call with an error's status (the wire edge owns how errors become statuses)."""


class TokenFileError(ValueError):
    pass


def load_tokens(path: Path | None, environ: Mapping[str, str] = os.environ) -> tuple[str, ...]:
    """Tokens from `path` and TOKENWIRE_AUTH_TOKENS (see load_token_callers)."""
    return tuple(token for token, _ in load_token_callers(path, environ))


def load_token_callers(
    path: Path | None, environ: Mapping[str, str] = os.environ
) -> tuple[tuple[str, Caller], ...]:
    """(token, caller) pairs from `path` and TOKENWIRE_AUTH_TOKENS (comma-separated plain tokens).

    A file line is a token, or `NAME TOKEN [weight=W] [max_queued=N] [group=GROUP] [adapters=A,B]`
    (security/callers.py);
    blank lines and # comments are skipped. Raises TokenFileError when the file cannot be read,
    holds no token or has a malformed line (named by its number, never by its token).
    """
    found: list[tuple[str, Caller]] = []
    if path is not None:
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as error:
            raise TokenFileError(f"--auth-tokens-file: cannot read {path}: {error}") from error
        for number, line in enumerate(lines, start=1):
            if not line.strip() or line.strip().startswith("#"):
                continue
            try:
                found.append(parse_token_line(line))
            except TokenLineError as error:
                raise TokenFileError(f"--auth-tokens-file: {path} line {number}: {error}") from None
        if not found:
            raise TokenFileError(f"--auth-tokens-file: {path} holds no token")
    found += [
        (part.strip(), Caller(default_name(part.strip())))
        for part in environ.get(AUTH_TOKENS_ENV, "").split(",")
        if part.strip()
    ]
    for token, _ in found:
        if any(c.isspace() for c in token) or not token.isprintable():
            raise TokenFileError(
                f"--auth-tokens-file / {AUTH_TOKENS_ENV}: a token may not hold spaces or control characters"
            )
    return tuple(dict(found).items())


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    def __init__(
        self,
        tokens: Iterable[str],
        *,
        refuse: Refuse,
        protect_health: bool = False,
        on_refused: RefusalListener | None = None,
    ) -> None:
        self._refuse = refuse
        self._digests = tuple(_digest(token.encode()) for token in tokens)
        if not self._digests:
            raise ValueError("authentication needs at least one token")
        self._protect_health = protect_health
        self._on_refused = on_refused

    async def intercept_service(
        self, continuation: Continuation, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        method: str = details.method
        if handler is None or (
            not self._protect_health and method.startswith(LOAD_BALANCER_SERVICE_PREFIXES)
        ):
            return handler
        metadata: Metadata | None = details.invocation_metadata
        error = self.check(metadata)
        if error is None:
            return handler
        if self._on_refused is not None:
            self._on_refused(method, metadata, error)
        return _refusal(handler, error, self._refuse)

    def check(self, metadata: Metadata | None) -> GenerationError | None:
        """Why a call with this metadata is refused, or None for a valid token. The HTTP edge
        asks it with the request's headers (lower-case names), so both edges take one token set."""
        presented = _bearer_token(metadata)
        if presented is None:
            return MISSING
        candidate = _digest(presented)
        matched = False
        for digest in self._digests:  # every token, no early exit
            matched |= hmac.compare_digest(candidate, digest)
        return None if matched else INVALID


def _bearer_token(metadata: Metadata | None) -> bytes | None:
    for key, value in metadata or ():
        if key != AUTHORIZATION:
            continue
        text = value.decode("latin-1") if isinstance(value, bytes) else value
        scheme, _, token = text.strip().partition(" ")
        if scheme.lower() != _SCHEME or not token.strip():
            return None
        return token.strip().encode()
    return None


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


def _refusal(handler: grpc.RpcMethodHandler, error: GenerationError, end: Refuse) -> grpc.RpcMethodHandler:
    """A handler that ends the call with `error` without reading, let alone decoding, its body.

    It takes requests as a stream whatever the method's shape (the wire format is the same), so
    gRPC hands the call over before any request message arrives, and it has no deserializer, so
    the bytes that do arrive are never parsed: an unauthenticated call costs a header check.
    """

    async def refuse(requests: Any, context: grpc.aio.ServicerContext) -> None:
        await end(context, error)

    if handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    return grpc.stream_unary_rpc_method_handler(refuse)

"""Aborted calls let go of their request as soon as they end.

`context.abort` keeps its AbortError on the call's state, which the servicer context refers to;
the error's traceback refers back to every frame it left, and those frames hold the context and
the decoded request. That is a reference cycle: the request lived until the cyclic collector
ran, several refused calls later. A decoded request can be tens of times its wire size (a
message of half a million empty chat turns decodes to about 36 MB), so a stream of refused
requests held hundreds of megabytes.

`AbortsReleaseTheirFrames`, the server's first (outermost) interceptor, catches the AbortError
leaving any handler, drops its traceback and the exceptions chained to it, and returns: gRPC
raises the same error again once a handler returns after an abort (the status is already sent),
now with no frame of ours in its traceback, so everything the call held is freed when it ends.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator
from typing import Any

import grpc

from tokenwire.server.method_handlers import Continuation, Streaming, Unary, rewrapped


class AbortsReleaseTheirFrames(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    async def intercept_service(
        self, continuation: Continuation, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return None
        return rewrapped(handler, unary=_unary, streaming=_streaming)


def _unary(behavior: Unary) -> Unary:
    async def releasing(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await behavior(request, context)
        except grpc.aio.AbortError as aborted:
            _forget_frames(aborted)
            return None  # gRPC discards it: the call was aborted and raises that again

    return releasing


def _streaming(behavior: Streaming) -> Streaming:
    async def releasing(requests: Any, context: grpc.aio.ServicerContext) -> AsyncGenerator[Any, None]:
        try:
            async with contextlib.aclosing(behavior(requests, context)) as responses:  # see Streaming
                async for response in responses:
                    yield response
        except grpc.aio.AbortError as aborted:
            _forget_frames(aborted)

    return releasing


def _forget_frames(aborted: grpc.aio.AbortError) -> None:
    """Cut `aborted` loose from the frames it passed and the errors it was raised while handling
    (whose tracebacks hold frames too). The call's status went out before it was raised."""
    aborted.__traceback__ = None
    aborted.__context__ = None
    aborted.__cause__ = None

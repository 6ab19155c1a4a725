"""Rewrapping a gRPC method handler's behaviour, whatever its kind, for the server's interceptors."""

from __future__ import annotations

import inspect
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

import grpc

Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]]
"""What an interceptor calls for the handler the rest of the chain gives a call."""
Unary = Callable[[Any, Any], Awaitable[Any]]
"""A behaviour that answers once: unary-unary or stream-unary."""
Streaming = Callable[[Any, Any], AsyncGenerator[Any, None]]
"""A behaviour that answers with a stream: unary-stream or stream-stream. A wrapper closes it
with `contextlib.aclosing`: closed early (the call ended), the servicer's own cleanup must run
then, not whenever the garbage collector finalizes its generator, since it aborts generations."""


def rewrapped(
    handler: grpc.RpcMethodHandler,
    *,
    unary: Callable[[Unary], Unary],
    streaming: Callable[[Streaming], Streaming],
) -> grpc.RpcMethodHandler:
    """`handler` with its behaviour wrapped by `unary` or `streaming`, as its kind asks; the
    (de)serializers stay. A streaming handler written as a coroutine (gRPC's reader/writer
    style, which writes through its context and returns) is wrapped as a unary behaviour."""
    codecs = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(unary(handler.unary_unary), **codecs)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(unary(handler.stream_unary), **codecs)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(_either(handler.unary_stream, unary, streaming), **codecs)
    if handler.stream_stream is not None:
        return grpc.stream_stream_rpc_method_handler(
            _either(handler.stream_stream, unary, streaming), **codecs
        )
    return handler


def _either(
    behavior: Any, unary: Callable[[Unary], Unary], streaming: Callable[[Streaming], Streaming]
) -> Unary | Streaming:
    return unary(behavior) if inspect.iscoroutinefunction(behavior) else streaming(behavior)

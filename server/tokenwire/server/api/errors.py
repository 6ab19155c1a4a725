"""Domain errors -> gRPC status codes with google.rpc details, the same for unary and streams."""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2
from google.protobuf.duration_pb2 import Duration
from google.rpc import error_details_pb2, status_pb2

from tokenwire.server.engine.errors import ErrorKind, GenerationError

ERROR_DOMAIN = "tokenwire"

CODES: dict[ErrorKind, grpc.StatusCode] = {
    ErrorKind.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorKind.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    ErrorKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.INTERNAL: grpc.StatusCode.INTERNAL,
    ErrorKind.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
}

RETRY_PUSHBACK_HEADER = "grpc-retry-pushback-ms"
STATUS_DETAILS_HEADER = "grpc-status-details-bin"


def status_proto(error: GenerationError) -> status_pb2.Status:
    """The google.rpc.Status a client receives for `error`."""
    code = CODES[error.kind]
    details: list[any_pb2.Any] = []
    if error.violations:
        bad_request = error_details_pb2.BadRequest(
            field_violations=[
                error_details_pb2.BadRequest.FieldViolation(field=v.field, description=v.description)
                for v in error.violations
            ]
        )
        details.append(_pack(bad_request))
    if error.retry_after is not None:
        delay = Duration()
        delay.FromMilliseconds(retry_pushback_ms(error.retry_after))
        details.append(_pack(error_details_pb2.RetryInfo(retry_delay=delay)))
    if error.reason:
        details.append(_pack(error_details_pb2.ErrorInfo(reason=error.reason, domain=ERROR_DOMAIN)))
    return status_pb2.Status(code=code.value[0], message=error.message, details=details)


def trailing_metadata(error: GenerationError) -> tuple[tuple[str, str | bytes], ...]:
    """Trailers of a failed unary call: rich details, plus gRPC's retry pushback when known."""
    metadata: list[tuple[str, str | bytes]] = [
        (STATUS_DETAILS_HEADER, status_proto(error).SerializeToString())
    ]
    if error.retry_after is not None:
        metadata.append((RETRY_PUSHBACK_HEADER, str(retry_pushback_ms(error.retry_after))))
    return tuple(metadata)


async def abort(context: grpc.aio.ServicerContext, error: GenerationError) -> None:
    """End the call with `error`'s status; never returns."""
    await context.abort(CODES[error.kind], error.message, trailing_metadata=trailing_metadata(error))


def retry_pushback_ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def _pack(message: object) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)  # type: ignore[arg-type]
    return packed

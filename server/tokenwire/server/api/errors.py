"""Domain errors -> gRPC status codes with google.rpc details, the same for unary and streams."""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2
from google.protobuf.duration_pb2 import Duration
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

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
    ErrorKind.ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    ErrorKind.PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED,
}

RETRY_PUSHBACK_HEADER = "grpc-retry-pushback-ms"


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


def grpc_status(error: GenerationError) -> grpc.Status:
    """The status that ends a failed unary call: rich details (grpc_status's own encoding of the
    grpc-status-details-bin trailer), plus gRPC's retry pushback when known."""
    status = rpc_status.to_status(status_proto(error))
    if error.retry_after is not None:
        pushback = (RETRY_PUSHBACK_HEADER, str(retry_pushback_ms(error.retry_after)))
        status = status._replace(trailing_metadata=(*status.trailing_metadata, pushback))
    return status


async def abort(context: grpc.aio.ServicerContext, error: GenerationError) -> None:
    """End the call with `error`'s status; never returns."""
    await context.abort_with_status(grpc_status(error))


def retry_pushback_ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def _pack(message: object) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)  # type: ignore[arg-type]
    return packed

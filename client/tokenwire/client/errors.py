"""Errors raised by the client, with the server's rich details already decoded."""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status


@dataclass(frozen=True)
class FieldViolation:
    field: str
    description: str


class TokenwireError(Exception):
    """A failed call or generation: the gRPC status code plus google.rpc details."""

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        *,
        field_violations: tuple[FieldViolation, ...] = (),
        retry_after: float | None = None,
        reason: str | None = None,
    ) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.field_violations = field_violations
        self.retry_after = retry_after
        """Seconds the server asked the client to wait before retrying."""
        self.reason = reason

    @property
    def retryable(self) -> bool:
        """Whether retrying the same request is safe: it never ran."""
        return self.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)

    @classmethod
    def from_status(cls, status: status_pb2.Status) -> TokenwireError:
        code = next((c for c in grpc.StatusCode if c.value[0] == status.code), grpc.StatusCode.UNKNOWN)
        violations: list[FieldViolation] = []
        retry_after: float | None = None
        reason: str | None = None
        for detail in status.details:
            if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
                bad_request = error_details_pb2.BadRequest()
                detail.Unpack(bad_request)
                violations += [FieldViolation(v.field, v.description) for v in bad_request.field_violations]
            elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
                retry = error_details_pb2.RetryInfo()
                detail.Unpack(retry)
                retry_after = retry.retry_delay.ToNanoseconds() / 1e9
            elif detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                detail.Unpack(info)
                reason = info.reason
        return cls(
            code, status.message, field_violations=tuple(violations), retry_after=retry_after, reason=reason
        )

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError) -> TokenwireError:
        """Decode a failed call; details come from its grpc-status-details-bin trailer."""
        code: grpc.StatusCode = error.code()
        message: str = error.details() or ""
        try:
            status = rpc_status.from_call(error)
        except ValueError:  # details that contradict the call's own code or message: keep the call's
            status = None
        if status is None:
            return cls(code, message)
        decoded = cls.from_status(status)
        decoded.message = message or decoded.message
        return decoded

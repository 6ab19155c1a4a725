"""Errors are values inside the engine; only the API edge turns them into gRPC statuses."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class ErrorKind(Enum):
    INVALID_ARGUMENT = "invalid_argument"
    NOT_FOUND = "not_found"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    UNAVAILABLE = "unavailable"
    INTERNAL = "internal"
    UNAUTHENTICATED = "unauthenticated"


@dataclass(frozen=True)
class FieldViolation:
    field: str
    """Path of the offending field relative to the request, e.g. "sampling.top_p"."""
    description: str


class GenerationError(Exception):
    """Why a request could not be served, in terms a client can act on."""

    def __init__(
        self,
        kind: ErrorKind,
        message: str,
        *,
        violations: tuple[FieldViolation, ...] = (),
        retry_after: float | None = None,
        reason: str | None = None,
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.violations = violations
        self.retry_after = retry_after
        """Seconds after which retrying is likely to succeed (RESOURCE_EXHAUSTED)."""
        self.reason = reason
        """A stable machine-readable reason, e.g. "QUEUE_FULL"."""

    @classmethod
    def invalid(cls, *violations: FieldViolation) -> GenerationError:
        summary = "; ".join(f"{v.field}: {v.description}" for v in violations)
        return cls(ErrorKind.INVALID_ARGUMENT, f"invalid request: {summary}", violations=violations)

    def __repr__(self) -> str:
        return f"GenerationError({self.kind.name}, {self.message!r})"

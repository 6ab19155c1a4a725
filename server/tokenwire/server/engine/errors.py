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


MAX_VIOLATIONS = 8
"""Most field violations one error lists; a request with more problems learns of the first few."""
EXCERPT_CHARACTERS = 40


def excerpt(text: str, limit: int = EXCERPT_CHARACTERS) -> str:
    """`text` shortened to `limit` characters, saying how long it was, for errors and logs."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


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
        """INVALID_ARGUMENT for the first MAX_VIOLATIONS of `violations`, so the error stays small."""
        shown = violations[:MAX_VIOLATIONS]
        summary = "; ".join(f"{v.field}: {v.description}" for v in shown)
        if len(violations) > len(shown):
            summary += f"; and {len(violations) - len(shown)} more"
        return cls(ErrorKind.INVALID_ARGUMENT, f"invalid request: {summary}", violations=shown)

    def __repr__(self) -> str:
        return f"GenerationError({self.kind.name}, {self.message!r})"

"""Errors are values inside the engine; only the API edge turns them into gRPC statuses."""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from enum import Enum


class ErrorKind(Enum):
    INVALID_ARGUMENT = "invalid_argument"
    NOT_FOUND = "not_found"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    UNAVAILABLE = "unavailable"
    INTERNAL = "internal"
    UNAUTHENTICATED = "unauthenticated"
    ALREADY_EXISTS = "already_exists"
    PERMISSION_DENIED = "permission_denied"


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
    """The offending field. In the engine, a RequestSpec field with [i] for an element and .name
    for its part, e.g. "top_p", "stop[1]", "messages[0].role"; the API edge maps it to the path
    in the client's message, e.g. "sampling.top_p"."""
    description: str
    presence: bool = False
    """The problem is that the field is set at all (one input too many), not its value."""


@dataclass(eq=False)  # compared by identity, as exceptions are
class GenerationError(Exception):
    """Why a request could not be served, in terms a client can act on."""

    kind: ErrorKind
    message: str
    _: KW_ONLY
    violations: tuple[FieldViolation, ...] = ()
    retry_after: float | None = None
    """Seconds after which retrying is likely to succeed (RESOURCE_EXHAUSTED)."""
    reason: str | None = None
    """A stable machine-readable reason, e.g. "QUEUE_FULL"."""
    omitted_violations: int = 0
    """Violations found beyond those listed, which the message only counts."""

    def __post_init__(self) -> None:
        super().__init__(self.message)

    @classmethod
    def invalid(cls, *violations: FieldViolation, omitted: int = 0) -> GenerationError:
        """INVALID_ARGUMENT for the first MAX_VIOLATIONS of `violations`, so the error stays small.

        omitted: violations found besides these, counted in the message only.
        """
        shown = violations[:MAX_VIOLATIONS]
        omitted += len(violations) - len(shown)
        summary = "; ".join(f"{v.field}: {v.description}" for v in shown)
        if omitted:
            summary += f"; and {omitted} more"
        return cls(
            ErrorKind.INVALID_ARGUMENT,
            f"invalid request: {summary}",
            violations=shown,
            omitted_violations=omitted,
        )

    def __repr__(self) -> str:
        return f"GenerationError({self.kind.name}, {self.message!r})"

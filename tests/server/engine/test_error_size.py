"""Errors stay small whatever the request: a few violations, never one per bad entry."""

from __future__ import annotations

from tokenwire.server.engine.errors import MAX_VIOLATIONS, ErrorKind, FieldViolation, GenerationError


def test_an_invalid_request_lists_the_first_few_violations_and_counts_the_rest() -> None:
    violations = [FieldViolation(f"messages[{i}].role", "unknown role") for i in range(100_000)]
    error = GenerationError.invalid(*violations)
    assert error.kind is ErrorKind.INVALID_ARGUMENT
    assert [v.field for v in error.violations] == [f"messages[{i}].role" for i in range(MAX_VIOLATIONS)]
    assert error.message.endswith(f"; and {100_000 - MAX_VIOLATIONS} more")
    assert len(error.message) < 1000

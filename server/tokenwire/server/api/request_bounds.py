"""Bounds a request must meet before any work that grows with its size, whichever edge it came by.

A decoded request can hold millions of entries (4 MB of two-byte chat messages is two million
of them). Converting it to domain objects, checking each entry, tokenizing or logging it would
each cost time and memory in proportion, on the event loop, for every caller. So each edge
describes its decoded request by its sizes (`RequestSizes`: the length of a repeated field or a
string is known without looking inside it), and these checks read the sizes first, look inside
only once a size is within its bound, and stop at the first few violations, each quoting at most
a short excerpt of the offending value. They run before the request is converted, validated,
tokenized or recorded anywhere. The bounds and their wording are the validator's
(engine/validation.py), which checks the converted request again; fields are named as in
RequestSpec, and each edge renames them into its own terms.

request_id and idempotency_key: at most 128 characters, each a printable ASCII character other
than space (`!` to `~`), so either can be logged, put in a header or a file name as is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from tokenwire.server.engine.errors import MAX_VIOLATIONS, FieldViolation, GenerationError
from tokenwire.server.engine.validation import (
    RequestLimits,
    RequestSpec,
    context_violation,
    count_violation,
    identifier_violation,
    prompt_length_violation,
    role_violation,
)
from tokenwire.server.text.tools import MAX_TOOLS

MAX_MODEL_NAME_CHARACTERS = 256
MAX_IDEMPOTENCY_KEY_LENGTH = 128


@dataclass(frozen=True)
class RequestSizes:
    """What the bounds read of a decoded request: sizes, and views that look inside only when
    called (after the count they iterate is known to be bounded)."""

    request_id: str = ""
    idempotency_key: str = ""
    model: str = ""
    messages: int = 0
    roles: Callable[[], Iterable[str]] = tuple
    """The messages' roles, in order."""
    message_characters: Callable[[], int] = int
    """All messages' content, in characters."""
    prompt_characters: int | None = None
    """None: no text prompt."""
    token_ids: int | None = None
    """None: no token-id prompt."""
    logit_bias: int = 0
    stop: int = 0
    tools: int = 0


def check_before_model(sizes: RequestSizes, limits: RequestLimits) -> None:
    """What can be bounded before the model is known: ids, names, counts. Raises GenerationError."""
    found: list[FieldViolation] = []
    for violation in (
        identifier_violation("request_id", sizes.request_id, limits.max_request_id_length),
        identifier_violation("idempotency_key", sizes.idempotency_key, MAX_IDEMPOTENCY_KEY_LENGTH),
        model_violation(sizes.model),
        count_violation("messages", sizes.messages, limits.max_messages, "messages"),
        count_violation("logit_bias", sizes.logit_bias, limits.max_logit_bias_entries, "entries"),
        count_violation("stop", sizes.stop, limits.max_stop_strings, "stop strings"),
        count_violation("tools", sizes.tools, MAX_TOOLS, "tools"),
    ):
        if violation is not None:
            found.append(violation)
    if sizes.messages <= limits.max_messages:
        for index, role in enumerate(sizes.roles()):
            violation = role_violation(index, role)
            if violation is not None:
                found.append(violation)
                if len(found) >= MAX_VIOLATIONS:
                    break
    if found:
        raise GenerationError.invalid(*found)


def check_against_model(sizes: RequestSizes, limits: RequestLimits, context_length: int) -> None:
    """What is bounded by the model's context: prompt characters and token ids. Raises
    GenerationError, before anything is converted or tokenized."""
    found: list[FieldViolation | None] = []
    if sizes.prompt_characters is not None:
        found.append(prompt_length_violation("prompt", sizes.prompt_characters, limits, context_length))
    if sizes.messages:
        found.append(
            prompt_length_violation(
                "messages", sizes.message_characters(), limits, context_length, in_all=True
            )
        )
    if sizes.token_ids is not None and sizes.token_ids >= context_length:
        found.append(context_violation("token_ids", sizes.token_ids, context_length))
    violations = [violation for violation in found if violation is not None]
    if violations:
        raise GenerationError.invalid(*violations)


def model_violation(model: str) -> FieldViolation | None:
    if len(model) <= MAX_MODEL_NAME_CHARACTERS:
        return None
    return FieldViolation("model", f"{len(model)} characters: no model has such a name")


def spec_sizes(spec: RequestSpec, idempotency_key: str = "") -> RequestSizes:
    """The sizes of a request an edge has already converted (its body bounded by bytes)."""
    return RequestSizes(
        request_id=spec.request_id,
        idempotency_key=idempotency_key,
        model=spec.model,
        messages=len(spec.messages),
        roles=lambda: (turn.role for turn in spec.messages),
        message_characters=lambda: sum(len(turn.content) for turn in spec.messages),
        prompt_characters=None if spec.prompt is None else len(spec.prompt),
        token_ids=None if spec.token_ids is None else len(spec.token_ids),
        logit_bias=len(spec.logit_bias),
        stop=len(spec.stop),
        tools=len(spec.tools),
    )

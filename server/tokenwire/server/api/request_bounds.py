"""Bounds a GenerateRequest must meet before any work that grows with its size.

A decoded request can hold millions of entries (4 MB of two-byte chat messages is two million
of them). Converting it to domain objects, checking each entry, tokenizing or logging it would
each cost time and memory in proportion, on the event loop, for every caller. These checks read
sizes first (the length of a repeated field or a string is known without looking inside it),
look inside only once the size is within its bound, and stop at the first few violations, each
quoting at most a short excerpt of the offending value. They run before the request is
converted, validated, tokenized or recorded anywhere.

request_id and idempotency_key: at most 128 characters, each a printable ASCII character other
than space (`!` to `~`), so either can be logged, put in a header or a file name as is.
"""

from __future__ import annotations

from tokenwire.server.engine.errors import MAX_VIOLATIONS, FieldViolation, GenerationError, excerpt
from tokenwire.server.engine.validation import PROMPT_CHARS_PER_TOKEN, RequestLimits
from tokenwire.server.text.chat import ALLOWED_ROLES
from tokenwire.v1 import inference_service_pb2 as pb

MAX_MODEL_NAME_CHARACTERS = 256
REQUEST_ID_CHARACTERS = "printable ASCII other than space (! to ~)"
MAX_IDEMPOTENCY_KEY_LENGTH = 128


def check_before_model(message: pb.GenerateRequest, limits: RequestLimits) -> None:
    """What can be bounded before the model is known: ids, names, counts. Raises GenerationError."""
    found: list[FieldViolation] = []
    found += _check_id("request_id", message.request_id, limits.max_request_id_length)
    found += _check_id("idempotency_key", message.idempotency_key, MAX_IDEMPOTENCY_KEY_LENGTH)
    if len(message.model) > MAX_MODEL_NAME_CHARACTERS:
        found.append(FieldViolation("model", f"{len(message.model)} characters: no model has such a name"))
    messages = message.messages
    if len(messages) > limits.max_messages:
        found.append(FieldViolation("messages", f"{len(messages)} messages, more than {limits.max_messages}"))
    else:
        allowed = ", ".join(sorted(ALLOWED_ROLES))
        for index, turn in enumerate(messages):
            role = turn.role
            if role not in ALLOWED_ROLES:
                found.append(
                    FieldViolation(
                        f"messages[{index}].role", f"unknown role {excerpt(role)!r}; use one of {allowed}"
                    )
                )
                if len(found) >= MAX_VIOLATIONS:
                    break
    biases = message.sampling.logit_bias
    if len(biases) > limits.max_logit_bias_entries:
        found.append(
            FieldViolation(
                "sampling.logit_bias",
                f"{len(biases)} entries, more than {limits.max_logit_bias_entries}",
            )
        )
    stops = message.stopping.stop
    if len(stops) > limits.max_stop_strings:
        found.append(
            FieldViolation("stopping.stop", f"{len(stops)} stop strings, more than {limits.max_stop_strings}")
        )
    if found:
        raise GenerationError.invalid(*found)


def check_against_model(message: pb.GenerateRequest, limits: RequestLimits, context_length: int) -> None:
    """What is bounded by the model's context: prompt characters and token ids. Raises
    GenerationError, before anything is converted or tokenized."""
    max_chars = limits.prompt_chars(context_length)
    found: list[FieldViolation] = []
    if message.HasField("prompt") and len(message.prompt) > max_chars:
        found.append(FieldViolation("prompt", _too_long(len(message.prompt), max_chars, limits)))
    if message.messages:
        total = sum(len(turn.content) for turn in message.messages)
        if total > max_chars:
            found.append(FieldViolation("messages", _too_long(total, max_chars, limits, in_all=True)))
    if message.HasField("token_ids") and len(message.token_ids.ids) >= context_length:
        found.append(
            FieldViolation(
                "token_ids.ids",
                f"{len(message.token_ids.ids)} tokens leave no room in the context of "
                f"{context_length} tokens",
            )
        )
    if found:
        raise GenerationError.invalid(*found)


def _too_long(length: int, max_chars: int, limits: RequestLimits, *, in_all: bool = False) -> str:
    where = " in all" if in_all else ""
    origin = (
        "--max-prompt-chars"
        if limits.max_prompt_chars is not None
        else f"--max-prompt-chars, by default the context length times {PROMPT_CHARS_PER_TOKEN}"
    )
    return f"{length} characters{where}, more than {max_chars} ({origin})"


def _check_id(field: str, value: str, max_length: int) -> list[FieldViolation]:
    """An identifier's bounds: its length first, its characters only once the length is known
    to be small."""
    if len(value) > max_length:
        return [FieldViolation(field, f"{len(value)} characters, more than {max_length}")]
    if not _id_characters(value):
        return [FieldViolation(field, f"{excerpt(ascii(value))}: use only {REQUEST_ID_CHARACTERS}")]
    return []


def _id_characters(value: str) -> bool:
    return value.isascii() and all("!" <= c <= "~" for c in value)

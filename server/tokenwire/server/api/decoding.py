"""Request decoding that turns undecodable bytes into a value instead of an exception.

gRPC decodes request bytes before any handler code runs; if the deserializer raises (a truncated
varint, invalid UTF-8 in a string field) the call ends with UNKNOWN and the client learns
nothing useful. Returning an `UndecodableRequest` lets the servicer answer INVALID_ARGUMENT like
any other bad input, and lets a stream carry on with its other requests. A string field whose
bytes are not valid UTF-8 (a lone surrogate, say, which no UTF-8 encoder writes) is named by its
path, found by walking the request's wire format against its descriptor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError

from tokenwire.server.engine.errors import FieldViolation, GenerationError


@dataclass(frozen=True)
class UndecodableRequest:
    """Request bytes that are not a valid message of the expected type."""

    message_type: str
    reason: str
    field: str | None = None
    """The string field whose bytes are not valid UTF-8, when that is what is wrong."""

    def error(self) -> GenerationError:
        if self.field is not None:
            return GenerationError.invalid(
                FieldViolation(
                    self.field, "is not valid UTF-8 (an unpaired surrogate, or bytes that are not UTF-8)"
                )
            )
        return GenerationError.invalid(
            FieldViolation("request", f"bytes do not decode as {self.message_type}: {self.reason}")
        )


def tolerant(
    parse: Callable[[bytes], Any],
    message_type: str,
    descriptor: Descriptor | None = None,
    *,
    within: str | None = None,
) -> Callable[[bytes], Any]:
    """A request deserializer that returns UndecodableRequest instead of raising; with the
    message's `descriptor`, naming a string field that is not valid UTF-8. `within`: the field
    holding the request whose paths errors name (a stream's `generate`: its error events name
    GenerateRequest's fields, as every other error of a stream's generation does)."""

    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except (DecodeError, UnicodeDecodeError, ValueError) as error:
            field = None if descriptor is None else invalid_utf8_field(data, descriptor)
            if field is not None and within is not None:
                field = field.removeprefix(within + ".")
            return UndecodableRequest(message_type, str(error) or type(error).__name__, field)

    return deserialize


def invalid_utf8_field(data: bytes, descriptor: Descriptor, prefix: str = "") -> str | None:
    """The path (e.g. `messages[0].content`) of the first string field in `data` whose bytes are
    not valid UTF-8; None when there is none or the bytes are not a message at all. Work is linear
    in the bytes: each byte is visited once, nested messages included."""
    position, seen = 0, dict[int, int]()
    while position < len(data):
        read = _varint(data, position)
        if read is None:
            return None
        key, position = read
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            read = _varint(data, position)
            if read is None:
                return None
            position = read[1]
        elif wire_type in (1, 5):
            position += 8 if wire_type == 1 else 4
        elif wire_type == 2:
            read = _varint(data, position)
            if read is None or read[1] + read[0] > len(data):
                return None
            length, start = read
            position = start + length
            field = descriptor.fields_by_number.get(number)
            if field is None:
                continue
            index = seen.get(number, 0)
            seen[number] = index + 1
            path = prefix + field.name + (f"[{index}]" if field.is_repeated else "")
            payload = data[start:position]
            if field.type == FieldDescriptor.TYPE_STRING:
                try:
                    payload.decode("utf-8")
                except UnicodeDecodeError:
                    return path
            elif field.type == FieldDescriptor.TYPE_MESSAGE and field.message_type is not None:
                found = invalid_utf8_field(payload, field.message_type, path + ".")
                if found is not None:
                    return found
        else:
            return None  # groups, or not a wire type at all
    return None


def _varint(data: bytes, position: int) -> tuple[int, int] | None:
    """(value, position after it), or None when `data` ends inside it or it runs past 10 bytes."""
    value = shift = 0
    for offset in range(10):
        if position + offset >= len(data):
            return None
        byte = data[position + offset]
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, position + offset + 1
    return None

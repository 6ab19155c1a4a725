"""Request decoding that turns undecodable bytes into a value instead of an exception.

gRPC decodes request bytes before any handler code runs; if the deserializer raises (a truncated
varint, invalid UTF-8 in a string field) the call ends with UNKNOWN and the client learns
nothing useful. Returning an `UndecodableRequest` lets the servicer answer INVALID_ARGUMENT like
any other bad input, and lets a stream carry on with its other requests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import DecodeError

from tokenwire.server.engine.errors import FieldViolation, GenerationError


@dataclass(frozen=True)
class UndecodableRequest:
    """Request bytes that are not a valid message of the expected type."""

    message_type: str
    reason: str

    def error(self) -> GenerationError:
        return GenerationError.invalid(
            FieldViolation("request", f"bytes do not decode as {self.message_type}: {self.reason}")
        )


def tolerant(parse: Callable[[bytes], Any], message_type: str) -> Callable[[bytes], Any]:
    """A request deserializer that returns UndecodableRequest instead of raising."""

    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except (DecodeError, UnicodeDecodeError, ValueError) as error:
            return UndecodableRequest(message_type, str(error) or type(error).__name__)

    return deserialize

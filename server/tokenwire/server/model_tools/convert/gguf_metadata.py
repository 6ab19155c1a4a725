"""Typed, range-checked reads of a GGUF file's metadata: each wrong value is one message naming its key.

A value of the wrong type (a string where a count belongs), out of its range (zero heads, a
negative window, a NaN rotary base) or an array where one number belongs is refused here, before
anything is computed or allocated from it; how a value must agree with the tensors present is
gguf_source.py's to check.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import NDArray

from tokenwire.server.model_tools.convert.errors import CorruptGgufError, UnsupportedModelError, excerpt
from tokenwire.server.model_tools.convert.gguf_file import GgufArray, GgufValue


def _kind(value: GgufValue) -> str:
    if isinstance(value, GgufArray):
        return f"an array of {value.count} items"
    if isinstance(value, bool):
        return f"a boolean ({value})"
    if isinstance(value, str):
        return f"a string ({excerpt(value)!r})"
    return f"{value!r}"


class GgufMetadata:
    def __init__(self, fields: dict[str, GgufValue]) -> None:
        self._fields = fields

    def __contains__(self, key: str) -> bool:
        return key in self._fields

    def is_array(self, key: str) -> bool:
        return isinstance(self._fields.get(key), GgufArray)

    def _found(self, key: str, required: bool) -> GgufValue | None:
        value = self._fields.get(key)
        if value is None and required:
            raise UnsupportedModelError(f"GGUF metadata lacks {key}")
        return value

    def integer(
        self, key: str, default: int | None = None, *, minimum: int = 0, maximum: int | None = None
    ) -> int:
        """A whole number within [minimum, maximum]; required when there is no default."""
        value = self._found(key, default is None)
        if value is None:
            assert default is not None
            return default
        if isinstance(value, GgufArray):
            raise UnsupportedModelError(
                f"GGUF metadata {key} is {_kind(value)} (one per layer?), not one number: not supported"
            )
        if isinstance(value, bool) or not isinstance(value, int):
            raise CorruptGgufError(f"GGUF metadata {key} is {_kind(value)}, not a whole number")
        if value < minimum or (maximum is not None and value > maximum):
            bound = f"at least {minimum}" if maximum is None else f"between {minimum} and {maximum}"
            raise CorruptGgufError(f"GGUF metadata {key} is {value}, but must be {bound}")
        return value

    def number(self, key: str, default: float, *, positive: bool = False) -> float:
        """A finite number, at least 0 (above 0 when `positive`)."""
        value = self._found(key, required=False)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise CorruptGgufError(f"GGUF metadata {key} is {_kind(value)}, not a number")
        number = float(value)
        if not math.isfinite(number) or number < 0 or (positive and number == 0):
            least = "above 0" if positive else "at least 0"
            raise CorruptGgufError(f"GGUF metadata {key} is {number}, but must be a finite number {least}")
        return number

    def text(self, key: str, default: str | None = None) -> str:
        """A string; required when there is no default."""
        value = self._found(key, default is None)
        if value is None:
            assert default is not None
            return default
        if not isinstance(value, str):
            raise CorruptGgufError(f"GGUF metadata {key} is {_kind(value)}, not a string")
        return value

    def optional_text(self, key: str) -> str | None:
        return self.text(key) if key in self._fields else None

    def flag(self, key: str, default: bool) -> bool:
        value = self._found(key, required=False)
        if value is None:
            return default
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise CorruptGgufError(f"GGUF metadata {key} is {_kind(value)}, not true or false")

    def array(self, key: str, *, required: bool = False, max_items: int | None = None) -> GgufArray | None:
        """An array, its item count checked against `max_items` before anything of it is decoded."""
        value = self._found(key, required)
        if value is None:
            return None
        if not isinstance(value, GgufArray):
            raise CorruptGgufError(f"GGUF metadata {key} is {_kind(value)}, not an array")
        if max_items is not None and value.count > max_items:
            raise CorruptGgufError(f"GGUF metadata {key} has {value.count} items, more than {max_items}")
        return value

    def strings(self, key: str, *, required: bool = False, max_items: int | None = None) -> list[str] | None:
        found = self.array(key, required=required, max_items=max_items)
        return None if found is None else found.strings()

    def numbers(self, key: str, *, exact_items: int) -> NDArray[np.generic] | None:
        """A numeric array of exactly `exact_items` items (one per token, per layer), or None."""
        found = self.array(key)
        if found is None:
            return None
        if found.count != exact_items:
            raise CorruptGgufError(
                f"GGUF metadata {key} has {found.count} items, but must have {exact_items}"
            )
        return found.numbers()

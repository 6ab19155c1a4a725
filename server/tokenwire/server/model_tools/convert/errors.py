"""Why a GGUF file cannot be converted: every refusal the converter makes is one of these.

Each message names what was found and what is supported, so the command line can print it as
one line (and exit with status 2) without a traceback.
"""

from __future__ import annotations


class ConversionError(ValueError):
    """A file the converter refuses, with a message fit to show a user as it is."""


class UnsupportedModelError(ConversionError):
    """The GGUF file describes a model this converter cannot express faithfully."""


class CorruptGgufError(ConversionError):
    """The file is not a well-formed GGUF file: bad magic, truncated, or metadata that lies."""


def excerpt(text: str, limit: int = 40) -> str:
    """At most `limit` characters of `text`, for a message that quotes what a file holds."""
    return text if len(text) <= limit else text[:limit] + "..."

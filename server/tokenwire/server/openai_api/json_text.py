"""Text in a JSON body that is not Unicode a tokenizer can take, found and named before any use.

JSON's escapes can spell a lone UTF-16 surrogate ("\\ud800"), which is no character: Python's
parser keeps it in the string, and it fails far later, inside the tokenizer, as a 500. A body's
bytes that are not UTF-8 fail the same way. Here the body is decoded with every invalid byte kept
as a lone surrogate (surrogateescape), so both become the same finding, and the parsed value is
searched for one, naming its parameter path (`messages[0].content`): a 400 instead. Most bodies
hold neither, and a byte search tells so without walking the value.
"""

from __future__ import annotations

import re
from typing import Any

_SURROGATE = re.compile("[\ud800-\udfff]")
_MAY_HOLD_ONE = re.compile(rb"\\u[dD][89a-fA-F]|[\x80-\xff]")
"""A surrogate's escape, or any byte beyond ASCII (one that is not UTF-8 among them)."""


def body_text(body: bytes) -> str:
    """The body as text, each byte that is not UTF-8 kept as a lone surrogate (a leading byte
    order mark, which JSON's parser takes from bytes, dropped)."""
    return body.removeprefix(b"\xef\xbb\xbf").decode("utf-8", "surrogateescape")


def unicode_violation(body: bytes, decoded: Any) -> str | None:
    """The path of the first string (or object key) of `decoded` that is not valid Unicode, or None."""
    if _MAY_HOLD_ONE.search(body) is None:
        return None
    pending: list[tuple[str, Any]] = [("", decoded)]
    while pending:
        path, value = pending.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                return path or "body"
        elif isinstance(value, dict):
            for key, item in reversed(value.items()):
                where = f"{path}.{key}" if path else str(key)
                if _SURROGATE.search(key):
                    return path or "body"
                pending.append((where, item))
        elif isinstance(value, list):
            pending.extend((f"{path}[{index}]", item) for index, item in reversed(list(enumerate(value))))
    return None

"""Process-wide logging: plain text or one JSON object per line, with structured fields.

A record may carry a `fields` mapping (logging's `extra={"fields": {...}}`): the JSON format
writes its entries as top-level keys, the text format appends them as key=value pairs, quoted
when they would otherwise be ambiguous, so a client-chosen request id cannot forge a line.

Both formats escape every character that is not printable (C0 and C1 controls such as U+0085
and U+009B, the line and paragraph separators U+2028 and U+2029, bidirectional overrides):
JSON parsers and log shippers split lines on some of them, and terminals act on others. The
only raw line breaks left are those of a traceback under the text format's first line.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

from tokenwire.server.telemetry.settings import LogFormat

FIELDS_ATTRIBUTE = "fields"
_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: str, log_format: LogFormat) -> None:
    """Send every log record to stderr in `log_format`, replacing earlier handlers."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter(_TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


def record_fields(record: logging.LogRecord) -> Mapping[str, object]:
    fields = getattr(record, FIELDS_ATTRIBUTE, None)
    return fields if isinstance(fields, Mapping) else {}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in record_fields(record).items():
            entry.setdefault(key, value)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        # json.dumps escapes C0 controls only; whatever else is unprintable can only be inside a
        # string here, where a \u escape keeps the line valid JSON.
        return escape_unprintable(json.dumps(entry, default=str, ensure_ascii=False))


class TextFormatter(logging.Formatter):
    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        # The message may hold client text (a request id in an error): it stays on one line.
        return escape_unprintable(super().formatMessage(record))

    def formatException(self, ei: Any) -> str:  # noqa: N802 - logging's name
        # A traceback keeps its own line breaks; anything else unprintable in it is escaped.
        return "\n".join(escape_unprintable(line) for line in super().formatException(ei).split("\n"))

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = record_fields(record)
        if not fields:
            return line
        pairs = " ".join(f"{key}={_text_value(value)}" for key, value in fields.items() if value is not None)
        head, newline, tail = line.partition("\n")  # keep a traceback below the fields
        return f"{head} {pairs}{newline}{tail}"


def escape_unprintable(text: str) -> str:
    """`text` with every unprintable character written as a \\uXXXX escape (valid in JSON too)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else _escape(c) for c in text)


def _escape(char: str) -> str:
    code = ord(char)
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    code -= 0x10000  # a UTF-16 surrogate pair, as JSON spells characters beyond the BMP
    return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"


def _text_value(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    text = str(value)
    if text and all(c.isalnum() or c in "-_.:/" for c in text) and text.isprintable():
        return text
    return escape_unprintable(json.dumps(text, ensure_ascii=False))

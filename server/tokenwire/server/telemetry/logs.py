"""Process-wide logging: plain text or one JSON object per line, with structured fields.

A record may carry a `fields` mapping (logging's `extra={"fields": {...}}`): the JSON format
writes its entries as top-level keys, the text format appends them as key=value pairs, quoted
when they would otherwise be ambiguous, so a client-chosen request id cannot forge a line.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Mapping
from datetime import datetime, timezone

from tokenwire.server.config import LogFormat

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
        return json.dumps(entry, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = record_fields(record)
        if not fields:
            return line
        pairs = " ".join(f"{key}={_text_value(value)}" for key, value in fields.items() if value is not None)
        head, newline, tail = line.partition("\n")  # keep a traceback below the fields
        return f"{head} {pairs}{newline}{tail}"


def _text_value(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    text = str(value)
    if text and all(c.isalnum() or c in "-_.:/" for c in text):
        return text
    return json.dumps(text, ensure_ascii=False)

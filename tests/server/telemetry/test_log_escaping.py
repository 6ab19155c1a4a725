"""Log lines stay one line each whatever a client puts in the text they carry."""

from __future__ import annotations

import json
import logging
import sys

import pytest

from tokenwire.server.engine.errors import excerpt
from tokenwire.server.telemetry.logs import JsonFormatter, TextFormatter, escape_unprintable

SPLITTERS = ["\n", "\r", "\x0b", "\x0c", "\x1c", "\x85", "\x9b", "\u2028", "\u2029", "\u202e", "\x00", "\x7f"]


def record(message: str, fields: dict[str, object] | None = None) -> logging.LogRecord:
    entry = logging.LogRecord("tokenwire.access", logging.INFO, __file__, 1, "%s", (message,), None)
    if fields is not None:
        entry.fields = fields
    return entry


@pytest.mark.parametrize("splitter", SPLITTERS, ids=[f"U+{ord(c):04X}" for c in SPLITTERS])
def test_the_text_format_escapes_every_line_splitter_in_fields_and_message(splitter: str) -> None:
    evil = f"a{splitter}2024-01-01 INFO forged"
    line = TextFormatter("%(message)s").format(record(f"request {evil}", {"request_id": evil}))
    assert line.isprintable()
    assert len(line.splitlines()) == 1
    assert f"\\u{ord(splitter):04x}" in line or repr(splitter)[1:-1] in line


@pytest.mark.parametrize("splitter", SPLITTERS, ids=[f"U+{ord(c):04X}" for c in SPLITTERS])
def test_the_json_format_escapes_every_line_splitter_and_stays_valid_json(splitter: str) -> None:
    evil = f"a{splitter}b"
    line = JsonFormatter().format(record(evil, {"request_id": evil}))
    assert line.isprintable()
    assert len(line.splitlines()) == 1
    parsed = json.loads(line)
    assert parsed["request_id"] == evil
    assert parsed["message"] == evil


def test_a_traceback_keeps_its_line_breaks_below_an_escaped_first_line() -> None:
    try:
        raise ValueError("bad\u2028value")
    except ValueError:
        entry = logging.LogRecord(
            "x", logging.ERROR, __file__, 1, "failed for %s", ("id\u2028x",), sys.exc_info()
        )
    text = TextFormatter("%(message)s").format(entry)
    first, *rest = text.split("\n")
    assert first == "failed for id\\u2028x"
    assert rest and all(line.isprintable() for line in rest)
    assert "bad\\u2028value" in text


def test_characters_beyond_the_basic_plane_are_escaped_as_json_surrogate_pairs() -> None:
    unassigned = "\U000e0fff"  # unprintable, outside the BMP
    assert escape_unprintable(f"x{unassigned}") == "x\\udb43\\udfff"
    assert json.loads(f'"{escape_unprintable(unassigned)}"') == unassigned


def test_printable_text_is_left_alone() -> None:
    assert escape_unprintable("héllo wörld 🙂 \u00e9") == "héllo wörld 🙂 \u00e9"


def test_an_excerpt_keeps_the_start_and_says_how_long_the_text_was() -> None:
    assert excerpt("short") == "short"
    assert excerpt("x" * 1_000_000) == "x" * 40 + "... (1000000 characters)"

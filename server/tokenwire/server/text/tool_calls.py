"""Tool calls in a model's output: read from its text as it streams, in its family's format.

`ToolCallReader` takes the generated text piece by piece (or whole) and hands back what the
client is sent: content deltas and call deltas (a call's index, then its id and name on its first
delta, then its arguments as JSON text in pieces). Both edges use it, streamed or not, so a unary
answer is exactly what its stream would have said.

How the output is read depends on the request's tool choice:

- **Forced** (`required`, or a named tool): a grammar made the output calls and nothing else, each
  `{"name": ..., "<arguments key>": {...}}` in that key order, so each call is streamed as it is
  generated: its id and name once the name is complete, then its arguments as they grow. The
  grammar guarantees the arguments validate against the tool's schema; a generation cut short
  (max tokens) ends with its last call's arguments incomplete, as OpenAI's API does.
- **Auto**: the model chose. Text flows as content; where the model starts a call (the family's
  marker, or for the JSON formats an output that opens with `{` or `[`), the call is held until it
  is whole, then checked: a known tool's name and arguments that validate against its schema (as
  JSON Schema). A valid call is sent as one call delta; anything else (malformed JSON, an unknown
  tool, invalid arguments, a second call when parallel calls are off, an unfinished call) is sent
  as the content it is, never an error.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

import jsonschema

from tokenwire.server.text.tools import ToolCall, ToolCallFormat, ToolCalling, new_call_id


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class CallDelta:
    index: int
    """Which call of the output, from 0."""
    id: str = ""
    """Set on a call's first delta only."""
    name: str = ""
    """Set on a call's first delta only."""
    arguments: str = ""
    """The next piece of the arguments' JSON text."""


ReaderDelta = ContentDelta | CallDelta

_OPENERS = {
    ToolCallFormat.HERMES: "<tool_call>",
    ToolCallFormat.MISTRAL: "[TOOL_CALLS]",
}
_HERMES_CLOSE = "</tool_call>"
_FENCES = ("```json", "```")
_WHITESPACE = " \t\r\n"
_STRING = r'"(?:[^"\\]|\\.)*"'


class _State(Enum):
    TEXT = "text"
    """Content, in which a call may begin at the family's marker."""
    START = "start"
    """Nothing but whitespace yet: a JSON-format output may open with calls here."""
    BEGIN = "begin"
    """A call region has begun: a list of calls ('[') or one call ('{') follows."""
    OBJECT = "object"
    """Expecting, or inside, a call object."""
    AFTER = "after"
    """After a call object: a separator, the region's end, or more calls."""
    PLAIN = "plain"
    """Content to the end: no call can begin any more."""


class ToolCallReader:
    def __init__(self, calling: ToolCalling, *, new_id: Callable[[], str] | None = None) -> None:
        self._calling = calling
        self._format = calling.format
        self._new_id = new_id or (lambda: new_call_id(calling.format))
        self._tools = {tool.name: tool for tool in calling.tools}
        self._validators: dict[str, Any] = {}
        self._text = ""
        self._pos = 0
        """Everything before this is decided: sent as content, or read as part of a call."""
        self._state = _State.TEXT if self._format in _OPENERS else _State.START
        self._region = 0
        """Where the current call region began: its text is content again if it holds no call."""
        self._region_calls = 0
        self._in_list = False
        """The region's calls are a JSON list: a ',' parts them and a ']' ends them."""
        self._fenced = False
        """The region is inside a Markdown code fence."""
        self._streaming: _Streaming | None = None
        self._held_whitespace = ""
        self.content = ""
        """The content sent so far."""
        self.calls: list[ToolCall] = []
        """The calls sent so far (in a forced output cut short, the last one's arguments are
        incomplete)."""

    def feed(self, text: str) -> list[ReaderDelta]:
        self._text += text
        deltas: list[ReaderDelta] = []
        self._advance(deltas, final=False)
        return deltas

    def finish(self) -> list[ReaderDelta]:
        """What is left to send once the generation has ended."""
        deltas: list[ReaderDelta] = []
        self._advance(deltas, final=True)
        streaming, self._streaming = self._streaming, None
        if streaming is not None and streaming.started:
            streaming.grow(self._text, deltas, final=True)
            assert streaming.call is not None
            self.calls.append(streaming.call)
        elif self._pos < len(self._text):  # a call region still open: it was no call
            self._not_a_call(self._pos, deltas)
        if self._held_whitespace and not self.calls:
            deltas.append(self._content_delta(self._held_whitespace))
        self._held_whitespace = ""
        return deltas

    # -- the states ------------------------------------------------------------------------------

    def _advance(self, deltas: list[ReaderDelta], *, final: bool) -> None:
        while True:
            before = (self._state, self._pos)
            if self._state is _State.PLAIN:
                self._send_content(self._text[self._pos :], deltas)
                self._pos = len(self._text)
            elif self._state is _State.TEXT:
                self._read_text(deltas, final=final)
            elif self._state is _State.START:
                self._read_start(final=final)
            elif self._state is _State.BEGIN:
                self._read_begin(deltas)
            elif self._state is _State.OBJECT:
                self._read_object(deltas)
            else:
                self._read_after(final=final)
            if (self._state, self._pos) == before:
                return

    def _rest(self) -> tuple[str, int]:
        """The undecided text from its first non-whitespace character, and where that is."""
        rest = self._text[self._pos :].lstrip(_WHITESPACE)
        return rest, len(self._text) - len(rest)

    def _read_text(self, deltas: list[ReaderDelta], *, final: bool) -> None:
        opener = _OPENERS[self._format]
        if self._format is ToolCallFormat.MISTRAL and not self.content and not self.calls:
            # Decoded without its control token, a Mistral call list opens the output with '['.
            rest, start = self._rest()
            if re.match(r"\[\s*\{", rest):
                self._open_region(start, 0, _State.BEGIN)
                return
            if rest.startswith("[") and not rest[1:].strip(_WHITESPACE) and not final:
                return  # wait for what follows the '['
        found = self._text.find(opener, self._pos)
        if found >= 0:
            self._send_content(self._text[self._pos : found], deltas)
            self._held_whitespace = ""
            after = _State.OBJECT if self._format is ToolCallFormat.HERMES else _State.BEGIN
            self._open_region(found, len(opener), after)
            return
        keep = 0 if final else _partial_suffix(self._text, opener, self._pos)
        self._send_content(self._text[self._pos : len(self._text) - keep], deltas)
        self._pos = len(self._text) - keep

    def _read_start(self, *, final: bool) -> None:
        rest, start = self._rest()
        if not rest:
            return
        if rest.startswith("`"):
            if not final and "```json".startswith(rest) and rest != "```json":
                return  # the fence may still grow
            fence = next((fence for fence in _FENCES if rest.startswith(fence)), None)
            if fence is None:
                self._state = _State.PLAIN
                return
            self._fenced = True
            self._open_region(start, len(fence), _State.BEGIN)
            return
        self._open_region(start, 0, _State.BEGIN)

    def _read_begin(self, deltas: list[ReaderDelta]) -> None:
        rest, start = self._rest()
        if not rest:
            return
        if rest.startswith("["):
            self._in_list = True
            self._pos = start + 1
            self._state = _State.OBJECT
        elif rest.startswith("{"):
            self._pos = start
            self._state = _State.OBJECT
        else:
            self._not_a_call(start, deltas)

    def _open_region(self, at: int, opener_length: int, state: _State) -> None:
        self._region = at
        self._region_calls = 0
        self._pos = at + opener_length
        self._state = state

    def _read_object(self, deltas: list[ReaderDelta]) -> None:
        rest, start = self._rest()
        if not rest:
            return
        if not rest.startswith("{"):
            self._not_a_call(start, deltas)
            return
        if self._calling.forced and self._streaming is None:
            self._streaming = _Streaming(start, len(self.calls), self._format, self._new_id)
        end = _object_end(self._text, start)
        if end is None:
            if self._streaming is not None:
                self._streaming.grow(self._text, deltas, final=False)
            return
        streaming, self._streaming = self._streaming, None
        if streaming is not None:
            call = streaming.complete(self._text, end, deltas)
        else:
            call = self._checked_call(self._text[start:end])
            if call is not None:
                deltas.append(CallDelta(len(self.calls), call.id, call.name, call.arguments))
        if call is None:
            self._not_a_call(start, deltas, end=end)
            return
        self.calls.append(call)
        self._region_calls += 1
        self._pos = end
        self._state = _State.AFTER

    def _read_after(self, *, final: bool) -> None:
        rest, start = self._rest()
        if not rest and not final:
            return
        call_format = self._format
        if call_format is ToolCallFormat.HERMES:
            if not final and _HERMES_CLOSE.startswith(rest) and rest != _HERMES_CLOSE:
                return
            self._pos = start + len(_HERMES_CLOSE) if rest.startswith(_HERMES_CLOSE) else start
            self._state = _State.TEXT
            return
        separator = "," if self._in_list else ";" if call_format is ToolCallFormat.LLAMA3_JSON else None
        if separator is not None and rest.startswith(separator):
            self._pos = start + 1
            self._state = _State.OBJECT
        elif not self._in_list and rest.startswith("{") and call_format is not ToolCallFormat.MISTRAL:
            self._pos = start
            self._state = _State.OBJECT
        elif self._in_list and rest.startswith("]"):
            self._in_list = False
            self._pos = start + 1
            self._close_region(final=final)
        elif not self._in_list:
            self._pos = start
            self._close_region(final=final)
        elif final:
            self._pos = start
            self._state = self._after_state()

    def _close_region(self, *, final: bool) -> None:
        if self._fenced:
            rest, start = self._rest()
            if not final and "```".startswith(rest) and rest != "```":
                return
            if rest.startswith("```"):
                self._pos = start + 3
            self._fenced = False
        self._state = self._after_state()

    def _after_state(self) -> _State:
        return _State.TEXT if self._format in _OPENERS else _State.PLAIN

    def _not_a_call(self, start: int, deltas: list[ReaderDelta], *, end: int | None = None) -> None:
        """What began as a call is not one. Its text goes out as content: from the region's
        start when the region holds no call yet, else from `start`."""
        origin = self._region if self._region_calls == 0 else start
        stop = len(self._text) if end is None else end
        self._send_content(self._text[origin:stop], deltas)
        self._pos = stop
        self._in_list = False
        self._fenced = False
        self._state = self._after_state()

    # -- checking a whole call -------------------------------------------------------------------

    def _checked_call(self, text: str) -> ToolCall | None:
        """The call `text` spells when it is a valid call of an offered tool, otherwise None."""
        if self.calls and not self._calling.parallel:
            return None
        try:
            found = json.loads(text)
        except (ValueError, RecursionError):
            return None
        if not isinstance(found, dict):
            return None
        name = found.get("name")
        key = self._format.arguments_key
        arguments = found.get(key, found.get("arguments", found.get("parameters", {})))
        if isinstance(arguments, str):  # some models write the arguments as JSON text
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError):
                return None
        if not isinstance(name, str) or name not in self._tools or not isinstance(arguments, dict):
            return None
        if not self._validates(name, arguments):
            return None
        return ToolCall(self._new_id(), name, json.dumps(arguments, ensure_ascii=False))

    def _validates(self, name: str, arguments: dict[str, Any]) -> bool:
        validator = self._validators.get(name)
        if validator is None:
            schema = json.loads(self._tools[name].parameters)
            validator = jsonschema.validators.validator_for(schema)(schema)
            self._validators[name] = validator
        try:
            return bool(validator.is_valid(arguments))
        except (jsonschema.exceptions.SchemaError, RecursionError, ValueError, TypeError):
            return False

    # -- sending content ---------------------------------------------------------------------------

    def _send_content(self, text: str, deltas: list[ReaderDelta]) -> None:
        """Content, its trailing whitespace held back: dropped if calls follow."""
        if not text:
            return
        text = self._held_whitespace + text
        body = text.rstrip(_WHITESPACE)
        self._held_whitespace = text[len(body) :]
        if body:
            deltas.append(self._content_delta(body))

    def _content_delta(self, text: str) -> ContentDelta:
        self.content += text
        return ContentDelta(text)


class _Streaming:
    """A forced call, streamed as it is generated: `{"name": "...", "<key>": ` then the arguments."""

    def __init__(
        self, start: int, index: int, call_format: ToolCallFormat, new_id: Callable[[], str]
    ) -> None:
        self._start = start
        self._index = index
        self._head = re.compile(
            r"\{\s*\"name\"\s*:\s*(" + _STRING + r")\s*,\s*\"" + call_format.arguments_key + r"\"\s*:\s*"
        )
        self._new_id = new_id
        self._arguments_start: int | None = None
        self._sent = 0
        """Characters of the arguments sent so far."""
        self.call: ToolCall | None = None

    @property
    def started(self) -> bool:
        return self.call is not None

    def grow(self, text: str, deltas: list[ReaderDelta], *, final: bool) -> None:
        if self._arguments_start is None:
            head = self._head.match(text, self._start)
            if head is None or head.end() == len(text):  # whitespace may still follow the ':'
                return
            self._arguments_start = head.end()
            self.call = ToolCall(self._new_id(), json.loads(head.group(1)), "")
            deltas.append(CallDelta(self._index, self.call.id, self.call.name, ""))
        assert self.call is not None
        end = _value_end(text, self._arguments_start)
        arguments = text[self._arguments_start : len(text) if end is None else end]
        if final and end is None:
            arguments = arguments.rstrip(_WHITESPACE)
        piece = arguments[self._sent :]
        if piece:
            self._sent = len(arguments)
            self.call = ToolCall(self.call.id, self.call.name, arguments)
            deltas.append(CallDelta(self._index, arguments=piece))

    def complete(self, text: str, end: int, deltas: list[ReaderDelta]) -> ToolCall | None:
        self.grow(text[:end], deltas, final=True)
        return self.call


def _partial_suffix(text: str, marker: str, start: int) -> int:
    """The length of the longest end of text[start:] that begins `marker`."""
    for size in range(min(len(marker) - 1, len(text) - start), 0, -1):
        if marker.startswith(text[len(text) - size :]):
            return size
    return 0


def _object_end(text: str, start: int) -> int | None:
    """Where the JSON object (or list) opening at text[start] ends, or None while it is open."""
    depth = 0
    in_string = False
    escaped = False
    for index in range(start, len(text)):
        char = text[index]
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return index + 1
    return None


_PRIMITIVE = re.compile(r"-?[0-9.eE+-]+|true|false|null|" + _STRING)


def _value_end(text: str, start: int) -> int | None:
    """Where the JSON value beginning at text[start] ends, or None while it is incomplete."""
    if start >= len(text):
        return None
    if text[start] in "{[":
        return _object_end(text, start)
    found = _PRIMITIVE.match(text, start)
    if found is None or found.end() == len(text):
        return None
    return found.end()

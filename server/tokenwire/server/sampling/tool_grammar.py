"""The grammar that forces a request's tool calls: `required` (one or more calls of any tool) or a
named tool (exactly one call of it).

A Lark grammar in llguidance's dialect, compiled and enforced like any response format, so the
output is calls in the model's own format (text/tools.py) and nothing else, each call's name one
of the tools and its arguments valid against that tool's schema (inlined as `%json`). The call
object's keys come in a fixed order, the name first, so a reader can stream the arguments as they
are generated, and in the layout of response formats (one space after each ',' and ':', no other
whitespace). An arguments object whose schema leaves `additionalProperties` unset holds only the
properties the schema names: still valid against it, and it keeps a small model from inventing
keys until its token limit. With parallel calls allowed, `required` permits up to
MAX_PARALLEL_CALLS calls.
"""

from __future__ import annotations

import json
from typing import Any

from tokenwire.server.sampling.params import FormatKind, ResponseFormat
from tokenwire.server.text.tools import ToolCallFormat, ToolCalling, ToolChoiceMode, ToolDefinition

LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""Response formats' JSON layout (sampling/constraint.py), for the schemas inlined here."""
MAX_PARALLEL_CALLS = 8
"""Most calls a forced output may hold: a small model may otherwise repeat calls to its limit."""

HERMES_OPEN = "<tool_call>\n"
HERMES_CLOSE = "\n</tool_call>"
_SEPARATORS = {
    ToolCallFormat.HERMES: "\n",
    ToolCallFormat.LLAMA3_JSON: "; ",
    ToolCallFormat.JSON: "\n",
}


def tool_format(calling: ToolCalling, *, mistral_marker_id: int | None = None) -> ResponseFormat:
    """The response format that forces `calling`'s choice (REQUIRED or NAMED).

    mistral_marker_id: the id of Mistral's `[TOOL_CALLS]` control token, which then opens the
    output as the model was trained to (None: the list alone)."""
    if calling.choice.mode is ToolChoiceMode.NAMED:
        tools = tuple(tool for tool in calling.tools if tool.name == calling.choice.name)
        most = 1
    else:
        assert calling.choice.mode is ToolChoiceMode.REQUIRED, "only a forced choice has a grammar"
        tools = calling.tools
        most = MAX_PARALLEL_CALLS if calling.parallel else 1
    key = calling.format.arguments_key
    one_call = {"anyOf": [_call_schema(tool, key) for tool in tools], "x-guidance": LAYOUT}
    if calling.format is ToolCallFormat.MISTRAL:
        listed: dict[str, Any] = {
            "type": "array",
            "items": {"anyOf": one_call["anyOf"]},
            "minItems": 1,
            "maxItems": most,
            "x-guidance": LAYOUT,
        }
        marker = f"<[{mistral_marker_id}]> " if mistral_marker_id is not None else ""
        grammar = f"start: {marker}calls\ncalls: %json {json.dumps(listed)}\n"
    else:
        call = "call"
        if calling.format is ToolCallFormat.HERMES:
            grammar_call = " ".join((json.dumps(HERMES_OPEN), "call_object", json.dumps(HERMES_CLOSE)))
        else:
            grammar_call = "call_object"
        separator = json.dumps(_SEPARATORS[calling.format])
        repeat = f"({separator} {call}){{0,{most - 1}}}" if most > 1 else ""
        grammar = (
            f"start: {call} {repeat}\n{call}: {grammar_call}\ncall_object: %json {json.dumps(one_call)}\n"
        )
    return ResponseFormat(FormatKind.GRAMMAR, grammar, field="tools")


def _call_schema(tool: ToolDefinition, key: str) -> dict[str, Any]:
    arguments = json.loads(tool.parameters)
    if isinstance(arguments, dict) and "properties" in arguments and "additionalProperties" not in arguments:
        arguments = {**arguments, "additionalProperties": False}
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, key: arguments},
        "required": ["name", key],
        "additionalProperties": False,
    }

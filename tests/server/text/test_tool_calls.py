"""Reading tool calls out of model text, per family format: whole outputs, the same outputs fed a
character at a time (the deltas must add up to the whole answer), malformed and invalid calls
(returned as content) and forced calls streamed as argument deltas."""

from __future__ import annotations

import itertools
import json

import pytest

from tokenwire.server.text.tool_calls import CallDelta, ContentDelta, ReaderDelta, ToolCallReader
from tokenwire.server.text.tools import (
    ToolCall,
    ToolCallFormat,
    ToolCalling,
    ToolChoice,
    ToolChoiceMode,
    ToolDefinition,
    tool_call_format,
)

WEATHER = ToolDefinition(
    "get_weather",
    "The weather in a city",
    json.dumps(
        {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
            "required": ["city"],
        }
    ),
)
TIME = ToolDefinition(
    "get_time", "", json.dumps({"type": "object", "properties": {"zone": {"type": "string"}}})
)
AUTO = ToolChoice()
REQUIRED = ToolChoice(ToolChoiceMode.REQUIRED)


def reader(
    call_format: ToolCallFormat, choice: ToolChoice = AUTO, *, parallel: bool = True
) -> ToolCallReader:
    counter = itertools.count()
    calling = ToolCalling(call_format, (WEATHER, TIME), choice, parallel)
    return ToolCallReader(calling, new_id=lambda: f"call_{next(counter)}")


def whole(
    call_format: ToolCallFormat, text: str, choice: ToolChoice = AUTO, **options: bool
) -> ToolCallReader:
    read = reader(call_format, choice, **options)
    read.feed(text)
    read.finish()
    return read


def streamed(
    call_format: ToolCallFormat, text: str, choice: ToolChoice = AUTO, **options: bool
) -> tuple[ToolCallReader, list[ReaderDelta]]:
    read = reader(call_format, choice, **options)
    deltas: list[ReaderDelta] = []
    for char in text:
        deltas += read.feed(char)
    deltas += read.finish()
    return read, deltas


def joined(deltas: list[ReaderDelta]) -> tuple[str, list[ToolCall]]:
    """The content and calls a client rebuilds from the deltas, as OpenAI's SDKs do."""
    content = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
    calls: dict[int, ToolCall] = {}
    for delta in deltas:
        if isinstance(delta, CallDelta):
            known = calls.get(delta.index)
            if known is None:
                assert delta.id and delta.name, "a call's first delta names it"
                calls[delta.index] = ToolCall(delta.id, delta.name, delta.arguments)
            else:
                assert not delta.id and not delta.name
                calls[delta.index] = ToolCall(known.id, known.name, known.arguments + delta.arguments)
    return content, [calls[i] for i in sorted(calls)]


CALL = ToolCall("call_0", "get_weather", '{"city": "Paris"}')
SECOND = ToolCall("call_1", "get_time", '{"zone": "CET"}')

VALID_OUTPUTS = [
    (
        "hermes, text then a call",
        ToolCallFormat.HERMES,
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        "Let me check.",
        [CALL],
    ),
    (
        "hermes, two calls",
        ToolCallFormat.HERMES,
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
        "",
        [CALL, SECOND],
    ),
    (
        "hermes, a last block left unclosed",
        ToolCallFormat.HERMES,
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}',
        "",
        [CALL],
    ),
    (
        "mistral, with its marker as text",
        ToolCallFormat.MISTRAL,
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_time", "arguments": {"zone": "CET"}}]',
        "",
        [CALL, SECOND],
    ),
    (
        "mistral, decoded without its control token",
        ToolCallFormat.MISTRAL,
        ' [{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        "",
        [CALL],
    ),
    (
        "llama 3, parameters",
        ToolCallFormat.LLAMA3_JSON,
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        "",
        [CALL],
    ),
    (
        "llama 3, two calls parted by ;",
        ToolCallFormat.LLAMA3_JSON,
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "get_time", "parameters": {"zone": "CET"}}',
        "",
        [CALL, SECOND],
    ),
    (
        "json, one object",
        ToolCallFormat.JSON,
        '{"name": "get_weather", "arguments": {"city": "Paris"}}',
        "",
        [CALL],
    ),
    (
        "json, a list in a code fence, arguments as JSON text",
        ToolCallFormat.JSON,
        '```json\n[{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}]\n```',
        "",
        [CALL],
    ),
]


@pytest.mark.parametrize(
    ("call_format", "text", "content", "calls"),
    [case[1:] for case in VALID_OUTPUTS],
    ids=[case[0] for case in VALID_OUTPUTS],
)
def test_a_valid_call_is_read_whole_and_streamed_alike(
    call_format: ToolCallFormat, text: str, content: str, calls: list[ToolCall]
) -> None:
    read = whole(call_format, text)
    assert (read.content, read.calls) == (content, calls)
    stream_reader, deltas = streamed(call_format, text)
    assert joined(deltas) == (content, calls)
    assert (stream_reader.content, stream_reader.calls) == (content, calls)


INVALID_OUTPUTS = [
    (
        "hermes, malformed JSON",
        ToolCallFormat.HERMES,
        '<tool_call>\n{"name": "get_weather", "arguments": {city}}\n</tool_call>',
    ),
    (
        "hermes, an unknown tool",
        ToolCallFormat.HERMES,
        '<tool_call>\n{"name": "rm", "arguments": {}}\n</tool_call>',
    ),
    (
        "hermes, arguments off the schema",
        ToolCallFormat.HERMES,
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 0}}\n</tool_call>',
    ),
    ("hermes, cut short", ToolCallFormat.HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"ci'),
    ("json, a missing required argument", ToolCallFormat.JSON, '{"name": "get_weather", "arguments": {}}'),
    ("json, not a call object", ToolCallFormat.JSON, '{"answer": 42}'),
    ("json, a list of numbers", ToolCallFormat.JSON, "[1, 2, 3]"),
    (
        "mistral, malformed list",
        ToolCallFormat.MISTRAL,
        '[TOOL_CALLS][{"name": "get_weather", "arguments": 5}]',
    ),
    (
        "llama 3, arguments not an object",
        ToolCallFormat.LLAMA3_JSON,
        '{"name": "get_weather", "parameters": [1]}',
    ),
]


@pytest.mark.parametrize(
    ("call_format", "text"), [case[1:] for case in INVALID_OUTPUTS], ids=[case[0] for case in INVALID_OUTPUTS]
)
def test_an_invalid_call_in_auto_mode_is_returned_as_the_text_it_is(
    call_format: ToolCallFormat, text: str
) -> None:
    read = whole(call_format, text)
    assert read.calls == []
    assert read.content == text.strip()
    _, deltas = streamed(call_format, text)
    assert joined(deltas) == (text.strip(), [])


def test_plain_text_is_content_in_every_format() -> None:
    text = "The weather is fine, {no call} here [1]."
    for call_format in ToolCallFormat:
        assert (whole(call_format, text).content, whole(call_format, text).calls) == (text, [])
        assert joined(streamed(call_format, text)[1]) == (text, [])


def test_text_that_begins_a_marker_is_held_until_it_is_known_not_to_be_one() -> None:
    read = reader(ToolCallFormat.HERMES)
    assert read.feed("See <tool") == [ContentDelta("See")]
    assert read.feed("box>") == [ContentDelta(" <toolbox>")]


def test_a_second_call_is_text_when_parallel_calls_are_off() -> None:
    text = (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
    )
    read = whole(ToolCallFormat.HERMES, text, parallel=False)
    assert read.calls == [CALL]
    assert read.content == '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'


def test_a_forced_call_streams_its_arguments_as_they_are_generated() -> None:
    read = reader(ToolCallFormat.JSON, REQUIRED)
    assert read.feed('{"name": "get_wea') == []
    assert read.feed('ther", "arguments": {"ci') == [
        CallDelta(0, "call_0", "get_weather", ""),
        CallDelta(0, arguments='{"ci'),
    ]
    assert read.feed('ty": "Par') == [CallDelta(0, arguments='ty": "Par')]
    assert read.feed('is"}}') == [CallDelta(0, arguments='is"}')]
    assert read.finish() == []
    assert read.calls == [CALL]
    assert read.content == ""


@pytest.mark.parametrize(
    ("call_format", "text"),
    [
        (
            ToolCallFormat.HERMES,
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        ),
        (ToolCallFormat.MISTRAL, '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'),
        (ToolCallFormat.LLAMA3_JSON, '{"name": "get_weather", "parameters": {"city": "Paris"}}'),
        (ToolCallFormat.JSON, '{"name": "get_weather", "arguments": {"city": "Paris"}}'),
    ],
)
def test_forced_calls_of_every_format_stream_in_deltas(call_format: ToolCallFormat, text: str) -> None:
    read, deltas = streamed(call_format, text, REQUIRED)
    argument_deltas = [d for d in deltas if isinstance(d, CallDelta) and d.arguments]
    assert len(argument_deltas) > 5, "the arguments arrive piece by piece"
    assert joined(deltas) == ("", [CALL])
    assert read.calls == [CALL]


def test_a_forced_call_cut_short_keeps_its_arguments_so_far() -> None:
    read, deltas = streamed(
        ToolCallFormat.JSON, '{"name": "get_weather", "arguments": {"city": "Pa', REQUIRED
    )
    assert read.calls == [ToolCall("call_0", "get_weather", '{"city": "Pa')]
    assert joined(deltas) == ("", read.calls)


@pytest.mark.parametrize(
    ("source", "renders_tools", "expected"),
    [
        ("{% for tool in tools %}{{ tool | tojson }}{% endfor %}<tool_call>", True, ToolCallFormat.HERMES),
        ("{{ '[TOOL_CALLS]' }}{{ tools }}", True, ToolCallFormat.MISTRAL),
        ("<|start_header_id|>ipython<|end_header_id|>{{ tools }}", True, ToolCallFormat.LLAMA3_JSON),
        ("{{ tools }}", True, ToolCallFormat.JSON),
        ("<tool_call> is mentioned, but tools are not rendered", False, ToolCallFormat.JSON),
    ],
)
def test_the_format_is_chosen_from_the_template(
    source: str, renders_tools: bool, expected: ToolCallFormat
) -> None:
    assert tool_call_format(source, renders_tools=renders_tools) is expected

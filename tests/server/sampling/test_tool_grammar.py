"""The grammar forcing a tool call: in every family's format it accepts the call (the named tool,
arguments valid against its schema, the name first) and refuses what is not; an arguments schema
the grammar engine cannot enforce fails naming `tools`."""

from __future__ import annotations

import json

import pytest

from tokenwire.server.engine.errors import GenerationError
from tokenwire.server.engine.format_cache import FormatCache
from tokenwire.server.model_tools.tiny_tokenizer import build_byte_level_tokenizer
from tokenwire.server.sampling.constraint import FormatCompiler
from tokenwire.server.sampling.tool_grammar import tool_format
from tokenwire.server.text.tokenizer import Tokenizer
from tokenwire.server.text.tools import (
    ToolCallFormat,
    ToolCalling,
    ToolChoice,
    ToolChoiceMode,
    ToolDefinition,
)

TOKENIZER = Tokenizer(build_byte_level_tokenizer(400))
EOS = TOKENIZER.token_to_id("<|endoftext|>")
assert EOS is not None
COMPILER = FormatCompiler(TOKENIZER.to_json(), vocab_size=TOKENIZER.vocab_size, eos_token_ids={EOS})
WEATHER = ToolDefinition(
    "get_weather",
    "",
    json.dumps({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
)
TIME = ToolDefinition("get_time", "", json.dumps({"type": "object", "properties": {}}))
ONE = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
WRITTEN = {
    ToolCallFormat.HERMES: f"<tool_call>\n{ONE}\n</tool_call>",
    ToolCallFormat.MISTRAL: f"[{ONE}]",
    ToolCallFormat.LLAMA3_JSON: ONE.replace("arguments", "parameters"),
    ToolCallFormat.JSON: ONE,
}


def accepts(call_format: ToolCallFormat, choice: ToolChoice, text: str, *, parallel: bool = True) -> bool:
    compiled = COMPILER.compile(tool_format(ToolCalling(call_format, (WEATHER, TIME), choice, parallel)))
    constraint = compiled.constraint()
    tokens = [*TOKENIZER.encode(text, add_special_tokens=False), EOS]
    return bool(constraint.matcher.validate_tokens(tokens) == len(tokens))


@pytest.mark.parametrize("call_format", list(ToolCallFormat))
def test_a_forced_call_in_the_family_format_is_accepted_and_little_else(call_format: ToolCallFormat) -> None:
    named = ToolChoice(ToolChoiceMode.NAMED, "get_weather")
    required = ToolChoice(ToolChoiceMode.REQUIRED)
    written = WRITTEN[call_format]
    assert accepts(call_format, named, written)
    assert accepts(call_format, required, written)
    assert not accepts(call_format, named, written.replace('"Paris"', "7")), "arguments off the schema"
    assert not accepts(call_format, named, written.replace("get_weather", "get_time"))
    assert not accepts(call_format, named, "Let me check. " + written), "nothing but the call"
    other_keys = written.replace('{"city": "Paris"}', '{"city": "Paris", "unit": "C"}')
    assert not accepts(call_format, named, other_keys), "only the properties the schema names"


def test_parallel_calls_are_allowed_only_when_asked_for() -> None:
    two = WRITTEN[ToolCallFormat.HERMES] + "\n" + WRITTEN[ToolCallFormat.HERMES]
    required = ToolChoice(ToolChoiceMode.REQUIRED)
    assert accepts(ToolCallFormat.HERMES, required, two)
    assert not accepts(ToolCallFormat.HERMES, required, two, parallel=False)
    assert not accepts(ToolCallFormat.HERMES, ToolChoice(ToolChoiceMode.NAMED, "get_weather"), two)


def test_a_schema_the_grammar_engine_cannot_enforce_fails_naming_tools() -> None:
    unique = ToolDefinition(
        "tag", "", json.dumps({"type": "object", "properties": {"t": {"type": "array", "uniqueItems": True}}})
    )
    forced = tool_format(
        ToolCalling(ToolCallFormat.JSON, (unique,), ToolChoice(ToolChoiceMode.REQUIRED), True)
    )
    cache = FormatCache(COMPILER)
    try:
        with pytest.raises(GenerationError) as failed:
            cache.prepare(forced).result(timeout=30)
    finally:
        cache.close()
    assert [v.field for v in failed.value.violations] == ["tools"]

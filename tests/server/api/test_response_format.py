"""Structured output on a real server: every output that ends by itself matches its format.

The tiny models' byte-level vocabularies can spell any JSON, and their near-random weights make
the mask do all the work: whatever they would have said, the output must still validate. Every
JSON output is checked with the `jsonschema` package.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import jsonschema
import pytest

from tokenwire.client import (
    AsyncClient,
    Chunk,
    Completed,
    Failed,
    FinishReason,
    GenerateOptions,
    Generation,
    ResponseFormat,
    Sampling,
    Stopping,
    TokenwireError,
)

# Shapes services ask a model to fill in: nested objects, enums, arrays, required fields.
SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "email": {"type": ["string", "null"], "maxLength": 20},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "order": {
        "type": "object",
        "properties": {
            "order_id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            "status": {"enum": ["pending", "shipped", "delivered", "cancelled"]},
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "maxLength": 8},
                        "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                    },
                    "required": ["sku", "quantity"],
                    "additionalProperties": False,
                },
            },
            "gift": {"type": "boolean"},
        },
        "required": ["order_id", "status", "items"],
        "additionalProperties": False,
    },
    "classification": {
        "type": "object",
        "properties": {
            "label": {"enum": ["positive", "negative", "neutral"]},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
            "reasons": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 2},
        },
        "required": ["label", "confidence"],
        "additionalProperties": False,
    },
    "tool_call": {
        "$defs": {
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "type": "object",
        "properties": {
            "name": {"const": "get_weather"},
            "arguments": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "minLength": 1, "maxLength": 10},
                    "unit": {"$ref": "#/$defs/unit"},
                    "days": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 14}, {"type": "null"}]},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    },
}

# Every sampling setting, each over several seeds.
SAMPLINGS = [
    Sampling(temperature=0.0),
    Sampling(temperature=1.0),
    Sampling(temperature=1.3, top_k=40),
    Sampling(temperature=0.9, top_p=0.9),
    Sampling(temperature=1.0, min_p=0.05, repetition_penalty=1.3),
]
SEEDS = range(4)


def options(
    response_format: ResponseFormat, sampling: Sampling, seed: int, **stopping: Any
) -> GenerateOptions:
    sampling = Sampling(**{**sampling.__dict__, "seed": seed})
    return GenerateOptions(
        sampling=sampling,
        stopping=Stopping(max_new_tokens=200, **stopping),
        response_format=response_format,
    )


def schema_format(name: str) -> ResponseFormat:
    return ResponseFormat(json_schema=json.dumps(SCHEMAS[name]))


def assert_valid(result: Generation, schema: dict[str, Any]) -> None:
    assert result.finish_reason is FinishReason.EOS, (result.finish_reason, result.text)
    jsonschema.validate(json.loads(result.text), schema)


async def test_every_json_output_validates_over_schemas_samplings_and_seeds_in_a_busy_batch(
    client: AsyncClient,
) -> None:
    cases = [(name, sampling, seed) for name in SCHEMAS for sampling in SAMPLINGS for seed in SEEDS]
    # Many at once (as many as the queue takes): constrained rows share batches with each other
    # and with free-text rows.
    room = asyncio.Semaphore(8)

    async def generate(prompt: str, chosen: GenerateOptions) -> Generation:
        async with room:
            return await client.generate(prompt, chosen)

    free_text = GenerateOptions(stopping=Stopping(max_new_tokens=40, ignore_eos=True))
    results = await asyncio.gather(
        *(generate("Fill in:", options(schema_format(n), s, seed)) for n, s, seed in cases),
        *(generate("Hello", free_text) for _ in range(4)),
    )
    for (name, sampling, seed), result in zip(cases, results, strict=False):
        try:
            assert_valid(result, SCHEMAS[name])
        except (AssertionError, jsonschema.ValidationError, ValueError) as error:
            pytest.fail(f"{name} with {sampling} seed {seed}: {result.text!r}: {error}")
    assert all(r.completion_tokens == 40 for r in results[len(cases) :])


async def test_streamed_json_output_validates_and_matches_the_unary_one(client: AsyncClient) -> None:
    for seed in SEEDS:
        chosen = options(schema_format("order"), Sampling(temperature=1.0), seed)
        unary = await client.generate("Order:", chosen)
        text = ""
        completed = None
        async for event in client.stream("Order:", chosen):
            if isinstance(event, Chunk):
                text += event.text
            elif isinstance(event, Completed):
                completed = event.generation
        assert completed is not None and completed.finish_reason is FinishReason.EOS
        jsonschema.validate(json.loads(text), SCHEMAS["order"])
        assert text == unary.text  # the same seed gives the same tokens, masked or not


async def test_regex_output_matches_the_whole_expression(client: AsyncClient) -> None:
    pattern = r"[A-Z]{2}-[0-9]{3}( [a-z]{1,5})?"
    for seed in SEEDS:
        result = await client.generate(
            "Code:", options(ResponseFormat(regex=pattern), Sampling(temperature=1.0), seed)
        )
        assert result.finish_reason is FinishReason.EOS
        assert re.fullmatch(pattern, result.text), result.text


async def test_choice_output_is_one_of_the_strings(client: AsyncClient) -> None:
    choices = ("yes", "no", "not sure", 'yes, "quoted"\nand more')
    seen = set()
    for seed in range(12):
        result = await client.generate(
            "Answer:", options(ResponseFormat(choice=choices), Sampling(temperature=1.5), seed)
        )
        assert result.text in choices
        seen.add(result.text)
    assert len(seen) > 1  # sampling still chooses among them


async def test_grammar_output_parses_as_the_grammar(client: AsyncClient) -> None:
    grammar = 'start: sum\nsum: NUM (("+" | "-") NUM)*\nNUM: /[1-9][0-9]?/\n'
    for seed in SEEDS:
        result = await client.generate(
            "Sum:", options(ResponseFormat(grammar=grammar), Sampling(temperature=1.0), seed)
        )
        assert result.finish_reason is FinishReason.EOS
        assert re.fullmatch(r"[1-9][0-9]?([+-][1-9][0-9]?)*", result.text), result.text


async def test_a_stop_string_inside_the_format_ends_the_output_there(client: AsyncClient) -> None:
    result = await client.generate(
        "Answer:",
        options(ResponseFormat(choice=("yes!", "no!")), Sampling(temperature=1.0), 3, stop=("!",)),
    )
    assert result.finish_reason is FinishReason.STOP
    assert result.text in ("yes", "no")


async def test_a_format_cut_short_by_max_new_tokens_is_a_prefix_of_a_match(client: AsyncClient) -> None:
    result = await client.generate(
        "Code:",
        GenerateOptions(
            stopping=Stopping(max_new_tokens=2),
            response_format=ResponseFormat(regex="[a-z]{30}"),
        ),
    )
    assert result.finish_reason is FinishReason.LENGTH
    assert re.fullmatch("[a-z]+", result.text) and len(result.text) < 30


@pytest.mark.parametrize(
    ("response_format", "field", "reason"),
    [
        (ResponseFormat(json_schema="{not json"), "response_format.json_schema", "not JSON"),
        (ResponseFormat(json_schema="[1, 2]"), "response_format.json_schema", "JSON object"),
        (ResponseFormat(json_schema='{"type": "strin"}'), "response_format.json_schema", "strin"),
        (
            ResponseFormat(json_schema='{"type": "array", "uniqueItems": true}'),
            "response_format.json_schema",
            "uniqueItems",
        ),
        (ResponseFormat(regex="a(b"), "response_format.regex", "unclosed group"),
        (ResponseFormat(regex=""), "response_format.regex", "must not be empty"),
        (ResponseFormat(regex="a" * 5000), "response_format.regex", "longer than 4096"),
        (ResponseFormat(choice=()), "response_format.choice.options", "1 to 256"),
        (ResponseFormat(choice=("a", "")), "response_format.choice.options[1]", "1 to 1024"),
        (ResponseFormat(grammar="start: missing_rule"), "response_format.grammar", "missing_rule"),
    ],
)
async def test_a_bad_format_is_invalid_argument_naming_the_field_with_the_reason(
    client: AsyncClient, response_format: ResponseFormat, field: str, reason: str
) -> None:
    with pytest.raises(TokenwireError) as raised:
        await client.generate("Hi", GenerateOptions(response_format=response_format))
    assert raised.value.code.name == "INVALID_ARGUMENT"
    violations = {v.field: v.description for v in raised.value.field_violations}
    assert field in violations, violations
    assert reason in violations[field]


async def test_a_bad_format_on_a_stream_is_an_error_event_and_the_stream_goes_on(client: AsyncClient) -> None:
    async with client.open_stream() as stream:
        await stream.submit("bad", "Hi", GenerateOptions(response_format=ResponseFormat(regex="(")))
        await stream.submit("good", "Hi", GenerateOptions(response_format=ResponseFormat(choice=("ok",))))
        await stream.close_requests()
        failures: dict[str, Exception] = {}
        text: dict[str, str] = {}
        async for event in stream.events():
            if isinstance(event, Failed):
                failures[event.request_id] = event.error
            elif isinstance(event, Chunk):
                text[event.request_id] = text.get(event.request_id, "") + event.text
    assert set(failures) == {"bad"}
    error = failures["bad"]
    assert isinstance(error, TokenwireError) and error.code.name == "INVALID_ARGUMENT"
    assert [v.field for v in error.field_violations] == ["response_format.regex"]
    assert text["good"] == "ok"


async def test_ignore_eos_with_a_format_is_refused(client: AsyncClient) -> None:
    with pytest.raises(TokenwireError) as raised:
        await client.generate(
            "Hi",
            GenerateOptions(
                stopping=Stopping(ignore_eos=True), response_format=ResponseFormat(choice=("a",))
            ),
        )
    assert [v.field for v in raised.value.field_violations] == ["stopping.ignore_eos"]

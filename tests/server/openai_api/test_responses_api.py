"""OpenAI's Responses API with openai-py's `client.responses.create` (and `parse`) against a real
server with the default model: string and message-list input, instructions, usage,
max_output_tokens, temperature and top_p, a stream's events in OpenAI's names and order, a
function tool round trip (function_call item -> function_call_output item -> answer) and
text.format json_schema. Every response object and stream event is also read as raw HTTP and
validated against OpenAI's published OpenAPI document.

The conversation a Responses request describes is the chat completion's: greedy decoding of the
same conversation gives the same text on both routes, which is how the input conversion is
checked. SmolLM2's template does not render tools, so tokenwire's own instructions carry them,
and the call is forced (a named tool) as in test_tool_calling.py.
"""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.conftest import DEFAULT_MODEL_NAME
from tests.server.openai_api.raw_http import request
from tests.support.openapi_schema import RESPONSE, sse_events, validate, validate_response_event
from tests.support.tools import WEATHER_RESULT, WEATHER_TOOL

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", **WEATHER_TOOL["function"]}
"""The weather tool in the Responses API's flat shape."""
FORCE_WEATHER = {"type": "function", "name": "get_weather"}
QUESTION = "What is the weather in Paris?"
FORCED: dict[str, Any] = {
    "model": DEFAULT_MODEL_NAME,
    "input": QUESTION,
    "tools": [WEATHER],
    "tool_choice": FORCE_WEATHER,
    "max_output_tokens": 48,
    "temperature": 0,
}
"""A request whose answer is one call of the weather tool, forced by the server's grammar."""
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
TEXT_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


class Person(BaseModel):
    name: str
    age: int


@pytest.fixture(scope="module")
def client(default_model_api: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=default_model_api, api_key="unused", max_retries=0) as made:
        yield made


def chat_text(client: openai.OpenAI, messages: list[dict[str, Any]], max_tokens: int, **more: Any) -> Any:
    return client.chat.completions.create(
        model=DEFAULT_MODEL_NAME,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=max_tokens,
        temperature=0,
        **more,
    )


async def raw(api: str, body: dict[str, Any]) -> bytes:
    port = urllib.parse.urlsplit(api).port
    assert port is not None
    reply = await request(
        port, "POST", "/v1/responses", {"model": DEFAULT_MODEL_NAME, "temperature": 0, **body}
    )
    assert reply.status == 200, reply.body
    return reply.body


def test_a_string_input_is_answered_as_the_same_chat_would_be(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=DEFAULT_MODEL_NAME, input="Name a colour.", max_output_tokens=32, temperature=0
    )
    chat = chat_text(client, [{"role": "user", "content": "Name a colour."}], 32)
    assert response.id.startswith("resp_") and response.object == "response"
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    assert response.output_text.strip()
    assert response.output_text == chat.choices[0].message.content
    assert response.usage is not None and chat.usage is not None
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    assert response.temperature == 0 and response.max_output_tokens == 32


def test_instructions_and_a_message_list_are_the_chat_conversation(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=DEFAULT_MODEL_NAME,
        instructions="Answer in one short sentence.",
        input=[
            {"role": "user", "content": [{"type": "input_text", "text": "Hello!"}]},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Hi.", "annotations": []}]},
            {"type": "message", "role": "developer", "content": "Be kind."},
            {"role": "user", "content": "What is gravity?"},
        ],
        max_output_tokens=24,
        temperature=0,
    )
    chat = chat_text(
        client,
        [
            {"role": "system", "content": "Answer in one short sentence."},
            {"role": "user", "content": "Hello!"},
            {"role": "assistant", "content": "Hi."},
            {"role": "system", "content": "Be kind."},
            {"role": "user", "content": "What is gravity?"},
        ],
        24,
    )
    assert response.instructions == "Answer in one short sentence."
    assert response.output_text == chat.choices[0].message.content
    assert response.usage is not None and chat.usage is not None
    assert response.usage.input_tokens == chat.usage.prompt_tokens


def test_max_output_tokens_cuts_the_answer_short_as_incomplete(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=DEFAULT_MODEL_NAME, input="Tell me a long story.", max_output_tokens=3, temperature=0
    )
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None and response.usage.output_tokens == 3
    assert response.output[0].status == "incomplete"  # type: ignore[union-attr]


def test_top_p_acts_and_both_sampling_parameters_are_repeated(client: openai.OpenAI) -> None:
    greedy = client.responses.create(
        model=DEFAULT_MODEL_NAME, input="Name a fruit.", max_output_tokens=12, temperature=0
    )
    # At the hottest temperature, a top_p this small keeps only the likeliest token: greedy again.
    narrow = client.responses.create(
        model=DEFAULT_MODEL_NAME, input="Name a fruit.", max_output_tokens=12, temperature=2, top_p=1e-6
    )
    assert narrow.output_text == greedy.output_text
    assert (narrow.temperature, narrow.top_p) == (2, 1e-6)


def test_a_stream_says_openais_events_in_order_and_ends_with_the_whole_response(
    client: openai.OpenAI,
) -> None:
    arguments = {
        "model": DEFAULT_MODEL_NAME,
        "input": "Say hello.",
        "max_output_tokens": 64,
        "temperature": 0,
    }
    events = list(client.responses.create(**arguments, stream=True))
    unary = client.responses.create(**arguments)
    kinds = [event.type for event in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 2
    assert kinds == [*TEXT_EVENTS[:4], *["response.output_text.delta"] * deltas, *TEXT_EVENTS[5:], kinds[-1]]
    assert kinds[-1] == "response.completed" and unary.status == "completed"  # ended by itself
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    [done] = [event for event in events if event.type == "response.output_text.done"]
    final = events[-1].response  # type: ignore[union-attr]
    assert text == done.text == final.output_text == unary.output_text
    assert final.usage is not None and final.usage.output_tokens == unary.usage.output_tokens  # type: ignore[union-attr]
    assert events[0].response.status == "in_progress"  # type: ignore[union-attr]


def test_a_function_tool_round_trip(client: openai.OpenAI) -> None:
    called = client.responses.create(**FORCED)
    assert called.status == "completed"
    [call] = called.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and call.id is not None and call.id.startswith("fc_")
    assert set(json.loads(call.arguments)) == {"city"}
    answer = client.responses.create(
        model=DEFAULT_MODEL_NAME,
        input=[
            {"role": "user", "content": QUESTION},
            call.model_dump(exclude_none=True),  # type: ignore[list-item]
            {"type": "function_call_output", "call_id": call.call_id, "output": WEATHER_RESULT},
        ],
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="none",
        max_output_tokens=48,
        temperature=0,
    )
    assert [item.type for item in answer.output] == ["message"]
    assert answer.output_text.strip()
    # The call and its result reached the model as chat's assistant call and tool turn do.
    chat = chat_text(
        client,
        [
            {"role": "user", "content": QUESTION},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.call_id, "content": WEATHER_RESULT},
        ],
        48,
        tools=[WEATHER_TOOL],
        tool_choice="none",
    )
    assert answer.output_text == chat.choices[0].message.content


def test_a_forced_call_streams_its_arguments_in_pieces(client: openai.OpenAI) -> None:
    events = list(client.responses.create(**FORCED, stream=True))
    kinds = [event.type for event in events]
    pieces = [event.delta for event in events if event.type == "response.function_call_arguments.delta"]
    assert len(pieces) >= 3, "the arguments stream as they are generated"
    assert kinds[2] == "response.output_item.added" and kinds[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    [done] = [event for event in events if event.type == "response.function_call_arguments.done"]
    assert done.name == "get_weather" and done.arguments == "".join(pieces)
    [call] = events[-1].response.output  # type: ignore[union-attr]
    assert call.arguments == done.arguments  # type: ignore[union-attr]


def test_text_format_json_schema_gives_output_that_validates(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=DEFAULT_MODEL_NAME,
        input="Describe Ada, aged 36, as JSON.",
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}},
        max_output_tokens=48,
        temperature=0,
    )
    jsonschema.validate(json.loads(response.output_text), PERSON)
    parsed = client.responses.parse(
        model=DEFAULT_MODEL_NAME,
        input="Describe Ada, aged 36.",
        text_format=Person,
        max_output_tokens=48,
        temperature=0,
    )
    assert isinstance(parsed.output_parsed, Person)


@pytest.mark.parametrize(
    "body",
    [
        {"input": QUESTION, "tools": [WEATHER], "tool_choice": FORCE_WEATHER, "max_output_tokens": 48},
        {"input": QUESTION, "tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False},
        {"input": QUESTION, "tools": [WEATHER], "max_output_tokens": 32},
        {"input": "Say hello.", "max_output_tokens": 64},
    ],
    ids=["named", "required", "auto", "text"],
)
async def test_every_response_and_stream_event_with_tools_follows_the_schema(
    default_model_api: str, body: dict[str, Any]
) -> None:
    response = json.loads(await raw(default_model_api, body))
    validate(RESPONSE, response)
    events = sse_events(await raw(default_model_api, {**body, "stream": True}))
    for event in events:
        validate_response_event(event)
    assert events[-1]["response"]["output"] == [
        {**item, "id": streamed["id"], **({"call_id": streamed["call_id"]} if "call_id" in item else {})}
        for item, streamed in zip(response["output"], events[-1]["response"]["output"], strict=True)
    ]


def test_log_probabilities_are_chats_and_their_bytes_rebuild_the_text(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=DEFAULT_MODEL_NAME,
        input="Name a colour.",
        max_output_tokens=12,
        temperature=0,
        include=["message.output_text.logprobs"],
        top_logprobs=2,
    )
    chat = chat_text(
        client, [{"role": "user", "content": "Name a colour."}], 12, logprobs=True, top_logprobs=2
    )
    [part] = response.output[0].content  # type: ignore[union-attr]
    assert part.logprobs is not None and len(part.logprobs) == response.usage.output_tokens  # type: ignore[union-attr]
    expected = chat.choices[0].logprobs.content
    assert [entry.token for entry in part.logprobs] == [entry.token for entry in expected]
    assert [entry.logprob for entry in part.logprobs] == pytest.approx([entry.logprob for entry in expected])
    assert [[top.token for top in entry.top_logprobs] for entry in part.logprobs] == [
        [top.token for top in entry.top_logprobs] for entry in expected
    ]
    assert bytes(b for entry in part.logprobs for b in entry.bytes).decode() == response.output_text

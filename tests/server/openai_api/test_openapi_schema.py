"""Every response shape of the HTTP API validates against OpenAI's published OpenAPI document
(vendored in tests/support/openapi): chat and completions, unary and each stream chunk, with
logprobs, n > 1 and usage, tool calls (unary and streamed), errors, the models list,
embeddings (float lists, and base64 as the SDKs ask for them by default); the Responses API's
response objects and every event of its streams (text, structured output, an answer cut short),
each against the schema its `type` names (function calls, which need the default model's context,
in test_responses_api.py).

Plain HTTP, so what is checked is the bytes the server sent, not what an SDK made of them.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.server.openai_api.raw_http import request
from tests.support.openapi_schema import (
    CHAT_CHUNK,
    CHAT_COMPLETION,
    COMPLETION,
    COMPLETION_CHUNK,
    EMBEDDINGS,
    EMBEDDINGS_BASE64,
    ERROR,
    MODEL,
    MODELS,
    RESPONSE,
    sse_events,
    validate,
    validate_response_event,
)
from tokenwire.server.app import TokenwireServer

CHAT = [{"role": "user", "content": "Name a colour"}]


async def post(server: TokenwireServer, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
    assert server.http_port is not None
    reply = await request(server.http_port, "POST", path, body)
    return reply.status, reply.body


def test_the_vendored_document_is_openais_and_checks_what_it_should() -> None:
    validate(ERROR, {"error": {"message": "m", "type": "t", "param": None, "code": None}})
    with pytest.raises(AssertionError, match="system_fingerprint"):
        validate(
            CHAT_COMPLETION,
            {
                "id": "x",
                "object": "chat.completion",
                "created": 1,
                "model": "m",
                "choices": [],
                "system_fingerprint": None,
            },
        )
    # Only the completions stream's chunks may leave finish_reason null.
    choice = {"index": 0, "text": "a", "logprobs": None, "finish_reason": None}
    chunk = {"id": "x", "object": "text_completion", "created": 1, "model": "m", "choices": [choice]}
    validate(COMPLETION_CHUNK, chunk)
    with pytest.raises(AssertionError, match="finish_reason"):
        validate(COMPLETION, chunk)


@pytest.mark.parametrize(
    "body",
    [
        {"max_tokens": 6, "temperature": 0},
        {"max_tokens": 4, "temperature": 0, "logprobs": True, "top_logprobs": 2},
        {"max_tokens": 4, "temperature": 1, "seed": 3, "n": 2},
    ],
    ids=["plain", "logprobs", "n=2"],
)
async def test_chat_completions_unary_and_streamed_follow_the_schema(
    http_server: TokenwireServer, body: dict[str, Any]
) -> None:
    status, unary = await post(
        http_server, "/v1/chat/completions", {"model": "tiny", "messages": CHAT, **body}
    )
    assert status == 200
    validate(CHAT_COMPLETION, json.loads(unary))
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    status, stream = await post(
        http_server, "/v1/chat/completions", {"model": "tiny", "messages": CHAT, **streamed}
    )
    assert status == 200
    chunks = sse_events(stream)
    assert len(chunks) >= 3
    for chunk in chunks:
        validate(CHAT_CHUNK, chunk)
    assert chunks[-1]["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize(
    "body",
    [{"max_tokens": 5, "temperature": 0}, {"max_tokens": 4, "temperature": 0, "logprobs": 2}],
    ids=["plain", "logprobs"],
)
async def test_completions_unary_and_streamed_follow_the_schema(
    http_server: TokenwireServer, body: dict[str, Any]
) -> None:
    request_body = {"model": "tiny", "prompt": "The capital of France is", **body}
    status, unary = await post(http_server, "/v1/completions", request_body)
    assert status == 200
    validate(COMPLETION, json.loads(unary))
    for options in ({"stream": True}, {"stream": True, "stream_options": {"include_usage": True}}):
        status, stream = await post(http_server, "/v1/completions", {**request_body, **options})
        assert status == 200
        chunks = sse_events(stream)
        *before, last = [chunk for chunk in chunks if chunk["choices"]]
        for chunk in before:
            validate(COMPLETION_CHUNK, chunk)
        validate(COMPLETION, last)  # the last chunk, with its finish reason, is a whole completion
        usage = [chunk for chunk in chunks if not chunk["choices"]]
        for chunk in usage:
            validate(COMPLETION, chunk)
        assert len(usage) == ("stream_options" in options)


async def test_errors_and_models_follow_the_schema(http_server: TokenwireServer) -> None:
    assert http_server.http_port is not None
    for path, body in (
        ("/v1/chat/completions", {"model": "tiny", "messages": CHAT, "temperature": 3}),
        ("/v1/chat/completions", {"model": "nope", "messages": CHAT}),
        ("/v1/chat/completions", {"model": "tiny", "messages": CHAT, "tools": [{"type": "function"}]}),
        ("/v1/completions", {"model": "tiny", "prompt": "x", "unknown_parameter": 1}),
        ("/v1/responses", {"model": "tiny", "input": [{"type": "input_image"}]}),
        ("/v1/responses", {"model": "tiny", "input": "x", "max_output_tokens": 100000}),
    ):
        status, error = await post(http_server, path, body)
        assert status in (400, 404)
        validate(ERROR, json.loads(error))
    models = await request(http_server.http_port, "GET", "/v1/models")
    validate(MODELS, json.loads(models.body))
    model = await request(http_server.http_port, "GET", "/v1/models/tiny")
    validate(MODEL, json.loads(model.body))


async def test_embeddings_follow_the_schema_as_floats_and_as_base64(http_server: TokenwireServer) -> None:
    texts = ["Name a colour", "red"]
    for encoding, component in (("float", EMBEDDINGS), ("base64", EMBEDDINGS_BASE64)):
        status, body = await post(
            http_server, "/v1/embeddings", {"model": "tiny", "input": texts, "encoding_format": encoding}
        )
        assert status == 200
        validate(component, json.loads(body))
    status, body = await post(http_server, "/v1/embeddings", {"model": "tiny", "input": []})
    assert status == 400
    validate(ERROR, json.loads(body))
    status, body = await post(
        http_server, "/v1/embeddings", {"model": "tiny", "input": "red", "encoding_format": "base64"}
    )
    with pytest.raises(AssertionError, match="embedding"):  # base64 is not the float schema
        validate(EMBEDDINGS, json.loads(body))


RESPONSE_BODIES: list[dict[str, Any]] = [
    {"input": "Name a colour", "max_output_tokens": 6},
    {"input": CHAT, "instructions": "Be brief.", "max_output_tokens": 200, "temperature": 0.5, "top_p": 0.9},
    {
        "input": "Name a colour",
        "max_output_tokens": 5,
        "include": ["message.output_text.logprobs"],
        "top_logprobs": 2,
    },
    {
        "input": "A person",
        "text": {
            "format": {"type": "json_schema", "name": "person", "schema": {"type": "object"}, "strict": True}
        },
        "max_output_tokens": 30,
    },
]


@pytest.mark.parametrize("body", RESPONSE_BODIES, ids=["cut-short", "instructions", "logprobs", "json"])
async def test_responses_unary_and_every_stream_event_follow_the_schema(
    http_server: TokenwireServer, body: dict[str, Any]
) -> None:
    status, unary = await post(http_server, "/v1/responses", {"model": "tiny", "temperature": 0, **body})
    assert status == 200, unary
    response = json.loads(unary)
    validate(RESPONSE, response)
    status, stream = await post(
        http_server, "/v1/responses", {"model": "tiny", "temperature": 0, **body, "stream": True}
    )
    assert status == 200
    blocks = [block for block in stream.decode().split("\n\n") if block]
    events = sse_events(stream)
    assert len(events) == len(blocks) >= 5
    for block, event in zip(blocks, events, strict=True):
        assert block.startswith(f"event: {event['type']}\n")  # the SSE event name is the type
        validate_response_event(event)
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    last = events[-1]["response"]
    assert events[-1]["type"] == f"response.{last['status']}"
    validate(RESPONSE, last)
    assert [item["type"] for item in last["output"]] == [item["type"] for item in response["output"]]
    if "include" in body:  # every token's log-probability, with its alternatives, on its text
        [part] = response["output"][0]["content"]
        assert len(part["logprobs"]) == response["usage"]["output_tokens"] == 5
        assert all(len(entry["top_logprobs"]) == 2 for entry in part["logprobs"])
        streamed = [
            entry
            for event in events
            if event["type"] == "response.output_text.delta"
            for entry in event["logprobs"]
        ]
        assert [entry["token"] for entry in streamed] == [entry["token"] for entry in part["logprobs"]]

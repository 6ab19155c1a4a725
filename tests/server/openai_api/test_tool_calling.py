"""Tool calling over HTTP with the default model, checked against OpenAI's OpenAPI document: a
forced call (a named tool) unary and streamed as argument deltas that join to the same call,
`auto` (what the model chose, call or text, never an error), and the round trip back to an answer.
SmolLM2's template does not render tools, so tokenwire's own instructions carry them (the JSON
format)."""

from __future__ import annotations

import json
import urllib.parse
from typing import Any

import pytest

from tests.conftest import DEFAULT_MODEL_NAME
from tests.server.openai_api.raw_http import request
from tests.support.openapi_schema import CHAT_CHUNK, CHAT_COMPLETION, sse_events, validate
from tests.support.tools import FORCE_WEATHER, WEATHER_RESULT, WEATHER_TOOL

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
FORCED = {"tools": [WEATHER_TOOL], "tool_choice": FORCE_WEATHER}


async def chat(api: str, body: dict[str, Any]) -> Any:
    port = urllib.parse.urlsplit(api).port
    assert port is not None
    full = {"model": DEFAULT_MODEL_NAME, "messages": QUESTION, "temperature": 0, "max_tokens": 48, **body}
    reply = await request(port, "POST", "/v1/chat/completions", full)
    assert reply.status == 200, reply.body
    return reply.body


async def test_a_forced_call_unary_and_streamed_follows_openais_schema(default_model_api: str) -> None:
    unary = json.loads(await chat(default_model_api, FORCED))
    validate(CHAT_COMPLETION, unary)
    [choice] = unary["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and call["id"].startswith("call_")
    assert set(json.loads(call["function"]["arguments"])) == {"city"}

    chunks = sse_events(await chat(default_model_api, {**FORCED, "stream": True}))
    for chunk in chunks:
        validate(CHAT_CHUNK, chunk)
    deltas = [d for c in chunks for d in c["choices"][0]["delta"].get("tool_calls", [])]
    assert deltas[0]["function"]["name"] == "get_weather" and deltas[0]["id"].startswith("call_")
    assert all("id" not in d and "name" not in d["function"] for d in deltas[1:])
    assert len(deltas) >= 4, "the arguments stream in pieces"
    assert "".join(d["function"]["arguments"] for d in deltas) == call["function"]["arguments"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


async def test_auto_returns_what_the_model_chose_within_the_schema(default_model_api: str) -> None:
    for body in ({"tools": [WEATHER_TOOL]}, {"tools": [WEATHER_TOOL], "stream": True}):
        raw = await chat(default_model_api, body)
        for shape in sse_events(raw) if body.get("stream") else [json.loads(raw)]:
            validate(CHAT_CHUNK if body.get("stream") else CHAT_COMPLETION, shape)


async def test_a_tool_result_goes_back_and_the_model_answers(default_model_api: str) -> None:
    unary = json.loads(await chat(default_model_api, FORCED))
    message = unary["choices"][0]["message"]
    [call] = message["tool_calls"]
    conversation = [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": message["tool_calls"]},
        {"role": "tool", "tool_call_id": call["id"], "content": WEATHER_RESULT},
    ]
    answer = json.loads(
        await chat(
            default_model_api, {"messages": conversation, "tools": [WEATHER_TOOL], "tool_choice": "none"}
        )
    )
    validate(CHAT_COMPLETION, answer)
    assert answer["choices"][0]["message"]["content"].strip()
    assert "tool_calls" not in answer["choices"][0]["message"]

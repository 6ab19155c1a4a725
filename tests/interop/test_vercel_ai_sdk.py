"""The Vercel AI SDK (`ai` 6 with `@ai-sdk/openai-compatible`, pinned in package.json; Node 20)
against a real server with the default model: a chat, a stream, structured output in the SDK's
default (JSON) mode and a tool-calling round trip whose first step forces the tool, as
tests/interop/test_client_libraries.py explains."""

from __future__ import annotations

import json

import pytest

from tests.conftest import DEFAULT_MODEL_NAME
from tests.interop.conftest import require_node_module, require_tool, run_tool

pytestmark = pytest.mark.slow


async def test_the_vercel_ai_sdk_chats_streams_shapes_output_and_calls_a_tool(default_model_api: str) -> None:
    node = require_tool("node")
    require_node_module("ai")
    require_node_module("@ai-sdk/openai-compatible")
    finished = await run_tool(
        node, "tests/interop/vercel_ai_sdk.mjs", default_model_api, DEFAULT_MODEL_NAME, timeout=240
    )
    assert finished.code == 0, finished.stderr
    report = json.loads(finished.stdout)
    assert report["chat"]["text"].strip() and report["chat"]["outputTokens"] >= 1
    assert report["stream"]["text"] == report["chat"]["text"]  # greedy: the same answer
    assert report["stream"]["chunks"] >= 2
    assert set(report["object"]) == {"name", "age"} and isinstance(report["object"]["age"], int)
    called, answered = report["roundTrip"]["steps"]
    assert called["finishReason"] == "tool-calls"
    [call] = called["toolCalls"]
    assert call["name"] == "get_weather" and set(call["input"]) == {"city"}
    assert called["toolResults"] == ["18 degrees Celsius and sunny"]
    assert answered["toolCalls"] == [] and answered["text"].strip()

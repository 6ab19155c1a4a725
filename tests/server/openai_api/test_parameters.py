"""The parameters clients send: every one OpenAI's chat API defines (read from the vendored OpenAPI
document) is accepted, the ignored ones named in a response header; vLLM's top_k, min_p and
repetition_penalty act as on gRPC; a name OpenAI does not define, and temperature above 2, are
400s naming them; bad tools are 400s naming the field, with the bounds of response formats."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.server.openai_api.raw_http import request
from tests.support.openapi_schema import request_parameters
from tokenwire.client import AsyncClient, ChatMessage, GenerateOptions, Sampling, Stopping
from tokenwire.server.app import TokenwireServer
from tokenwire.server.openai_api.parsing import CHAT_IGNORED, CHAT_PARAMETERS, EXTENSIONS, IGNORED_HEADER

CHAT = [{"role": "user", "content": "Name a colour"}]
IGNORED_VALUES: dict[str, Any] = {
    "metadata": {"team": "search"},
    "store": False,
    "service_tier": "auto",
    "user": "someone",
    "safety_identifier": "user-1234",
    "prompt_cache_key": "conversation-7",
    "prompt_cache_retention": "24h",
    "reasoning_effort": "low",
    "verbosity": "low",
    "modalities": ["text"],
    "audio": {"voice": "alloy", "format": "mp3"},
    "prediction": {"type": "content", "content": "Blue"},
    "web_search_options": {},
    "functions": [{"name": "f", "parameters": {"type": "object"}}],
    "function_call": "auto",
}


def openai_chat_parameters() -> set[str]:
    return request_parameters("CreateChatCompletionRequest")


async def chat(server: TokenwireServer, body: dict[str, Any]) -> Any:
    assert server.http_port is not None
    return await request(
        server.http_port, "POST", "/v1/chat/completions", {"model": "tiny", "messages": CHAT, **body}
    )


def test_every_chat_parameter_openai_defines_is_served_or_ignored() -> None:
    assert openai_chat_parameters() == CHAT_PARAMETERS - EXTENSIONS
    assert set(IGNORED_VALUES) == CHAT_IGNORED


async def test_ignored_parameters_are_accepted_and_named_in_a_header(http_server: TokenwireServer) -> None:
    plain = await chat(http_server, {"max_tokens": 4, "temperature": 0})
    ignored = await chat(
        http_server,
        {"max_tokens": 4, "temperature": 0, "tools": [], "stream_options": None, **IGNORED_VALUES},
    )
    assert plain.status == ignored.status == 200
    assert IGNORED_HEADER not in plain.headers
    assert ignored.headers[IGNORED_HEADER] == ", ".join(sorted(IGNORED_VALUES))
    assert json.loads(ignored.body)["choices"] == json.loads(plain.body)["choices"]
    streamed = await chat(
        http_server,
        {
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True, "include_obfuscation": False},
            "reasoning_effort": "minimal",
        },
    )
    assert streamed.status == 200 and streamed.headers[IGNORED_HEADER] == "reasoning_effort"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"top_kk": 3}, "top_kk"),
        ({"best_of": 2}, "best_of"),  # a completions parameter, not a chat one
        ({"temperature": 2.5}, "temperature"),
        (
            {"stream": True, "stream_options": {"include_everything": True}},
            "stream_options.include_everything",
        ),
    ],
)
async def test_what_openai_does_not_define_or_allow_is_a_400_naming_it(
    http_server: TokenwireServer, body: dict[str, Any], param: str
) -> None:
    reply = await chat(http_server, body)
    assert reply.status == 400
    assert reply.error()["param"] == param


async def test_top_k_min_p_and_repetition_penalty_act_as_on_grpc(http_server: TokenwireServer) -> None:
    controls = {"top_k": 3, "min_p": 0.05, "repetition_penalty": 1.3}
    reply = await chat(http_server, {"max_tokens": 12, "temperature": 1.0, "seed": 11, **controls})
    async with AsyncClient(f"127.0.0.1:{http_server.port}", retries=False) as client:
        reference = await client.generate(
            [ChatMessage("user", "Name a colour")],
            GenerateOptions(
                sampling=Sampling(temperature=1.0, seed=11, top_k=3, min_p=0.05, repetition_penalty=1.3),
                stopping=Stopping(max_new_tokens=12),
            ),
        )
        unpenalised = await client.generate(
            [ChatMessage("user", "Name a colour")],
            GenerateOptions(
                sampling=Sampling(temperature=1.0, seed=11), stopping=Stopping(max_new_tokens=12)
            ),
        )
    assert json.loads(reply.body)["choices"][0]["message"]["content"] == reference.text
    assert reference.text != unpenalised.text, "the controls change the draws"
    for bad, param in (
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
    ):
        refused = await chat(http_server, bad)
        assert refused.status == 400 and refused.error()["param"] == param


def tool(name: str = "f", parameters: Any = None) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


LARGE_SCHEMA = {"type": "object", "description": "x" * 65_536}


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        (
            {"tools": [tool(parameters=LARGE_SCHEMA)]},
            "tools[0].function.parameters",
            "longer than 65536 characters",
        ),
        ({"tools": [tool("f"), tool("g"), tool("f")]}, "tools[2].function.name", "names another tool"),
        ({"tools": [tool("get weather")]}, "tools[0].function.name", "is not a tool name"),
        ({"tools": [tool("x" * 65)]}, "tools[0].function.name", "is not a tool name"),
        (
            {"tools": [tool(parameters={"type": "objekt"})]},
            "tools[0].function.parameters",
            "not a JSON Schema",
        ),
        ({"tools": [tool(parameters=[1])]}, "tools[0].function.parameters", "JSON Schema object"),
        ({"tools": [tool()] * 129}, "tools", "129 tools, more than 128"),
        (
            {"tools": [tool()], "tool_choice": {"type": "function", "function": {"name": "g"}}},
            "tool_choice",
            "not one of the tools",
        ),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": [tool()], "tool_choice": "sometimes"}, "tool_choice", "must be"),
        (
            {"tools": [tool()], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
            "forces a call",
        ),
        ({"tools": [{"type": "custom", "custom": {"name": "f"}}]}, "tools[0].type", "only function tools"),
    ],
)
async def test_bad_tools_are_400_naming_the_field(
    http_server: TokenwireServer, body: dict[str, Any], param: str, says: str
) -> None:
    reply = await chat(http_server, body)
    assert reply.status == 400, reply.body
    assert reply.error()["param"] == param
    assert says in reply.error()["message"]


async def test_a_tool_schema_is_bounded_as_a_response_format_is(http_server: TokenwireServer) -> None:
    too_large = {"type": "json_schema", "json_schema": {"name": "s", "schema": LARGE_SCHEMA}}
    as_format = (await chat(http_server, {"response_format": too_large})).error()
    as_tool = (await chat(http_server, {"tools": [tool(parameters=LARGE_SCHEMA)]})).error()
    assert as_format["message"].split(": ", 2)[-1] == as_tool["message"].split(": ", 2)[-1]

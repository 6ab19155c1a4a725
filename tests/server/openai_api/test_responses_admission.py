"""What /v1/responses refuses, ignores and shares with chat completions.

Bad input is a 400 naming the field: a parameter OpenAI's API does not define, an input item or
content part this server does not serve, what only a stored response could serve
(previous_response_id, conversation, a stored prompt, item references, background), and every
bound the validator checks, named by the Responses API's own paths (input[i], tools[i].name,
text.format, max_output_tokens). The parameters that change nothing are accepted and named in the
ignored-parameters header. The request takes the one admission: bearer tokens and their callers,
the access log, idempotency keys (the gateway's headers: tests/server/security/test_gateway_headers.py).
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest

from tests.server.openai_api.conftest import http_settings
from tests.server.openai_api.raw_http import request
from tests.support.openapi_schema import request_parameters
from tests.support.servers import serving
from tests.support.tools import WEATHER_TOOL
from tokenwire.server.app import TokenwireServer
from tokenwire.server.config import AuthSettings
from tokenwire.server.engine.types import Caller
from tokenwire.server.openai_api.parsing import EXTENSIONS, IGNORED_HEADER
from tokenwire.server.openai_api.responses_input import IGNORED, PARAMETERS

WEATHER = {"type": "function", **WEATHER_TOOL["function"]}
IGNORED_VALUES: dict[str, Any] = {
    "metadata": {"team": "search"},
    "store": True,
    "user": "someone",
    "safety_identifier": "user-1234",
    "prompt_cache_key": "conversation-7",
    "prompt_cache_retention": "24h",
    "service_tier": "auto",
    "reasoning": {"effort": "low"},
    "truncation": "auto",
    "max_tool_calls": 2,
    "context_management": [{"type": "compaction", "compact_threshold": 1000}],
}


def openai_responses_parameters() -> set[str]:
    return request_parameters("CreateResponse")


async def respond(server: TokenwireServer, body: dict[str, Any], **options: Any) -> Any:
    assert server.http_port is not None
    full = {"model": "tiny", "max_output_tokens": 4, "temperature": 0, **body}
    return await request(server.http_port, "POST", "/v1/responses", full, **options)


def test_every_responses_parameter_openai_defines_is_served_ignored_or_refused_by_name() -> None:
    assert openai_responses_parameters() == PARAMETERS - EXTENSIONS
    assert set(IGNORED_VALUES) == IGNORED


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x", "frobnicate": 1}, "frobnicate"),
        ({"input": "x", "seed": 1}, "seed"),  # a chat parameter the Responses API does not define
        ({}, "input"),
        ({"input": []}, "input"),
        ({"input": [{"type": "input_image", "image_url": "https://x"}]}, "input[0].type"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
        ({"input": ["x"]}, "input[0]"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x"}]}]},
            "input[0].content[0]",
        ),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": 3}]}, "input[0].output"),
        (
            {
                "input": [
                    {"role": "user", "content": "x"},
                    {"type": "function_call", "call_id": "c", "name": "no way", "arguments": "{}"},
                ]
            },
            "input[1].name",
        ),
        ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": "x", "conversation": "conv_1"}, "conversation"),
        ({"input": "x", "prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "include": ["everything"]}, "include[0]"),
        ({"input": "x", "include": [{}]}, "include[0]"),
        ({"input": "x", "include": "message.output_text.logprobs"}, "include"),
        ({"input": "x", "top_logprobs": 21}, "top_logprobs"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "x", "tools": [{**WEATHER, "name": "no way"}]}, "tools[0].name"),
        ({"input": "x", "tools": [WEATHER, WEATHER]}, "tools[1].name"),
        ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "temperature": 3}, "temperature"),
        ({"input": "x", "top_p": 0}, "top_p"),
        ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type"),
        (
            {"input": "x", "text": {"format": {"type": "json_schema", "name": "p", "schema": 3}}},
            "text.format.schema",
        ),
        ({"input": "x", "text": {"colour": "red"}}, "text.colour"),
        ({"input": "x", "stream_options": {"include_obfuscation": True}}, "stream_options"),
        ({"instructions": 7, "input": "x"}, "instructions"),
    ],
)
async def test_bad_input_is_a_400_naming_the_field(
    http_server: TokenwireServer, body: dict[str, Any], param: str
) -> None:
    reply = await respond(http_server, body)
    assert reply.status == 400, reply.body
    assert reply.error()["param"] == param
    assert reply.error()["type"] == "invalid_request_error"


async def test_ignored_parameters_are_accepted_and_named_in_a_header(http_server: TokenwireServer) -> None:
    plain = await respond(http_server, {"input": "Name a colour"})
    ignored = await respond(
        http_server,
        {
            "input": "Name a colour",
            "text": {"format": {"type": "text"}, "verbosity": "low"},
            **IGNORED_VALUES,
        },
    )
    assert plain.status == ignored.status == 200
    assert IGNORED_HEADER not in plain.headers
    assert ignored.headers[IGNORED_HEADER] == ", ".join(sorted([*IGNORED_VALUES, "text.verbosity"]))
    assert json.loads(ignored.body)["output"][0]["content"] == json.loads(plain.body)["output"][0]["content"]
    assert json.loads(ignored.body)["metadata"] == {"team": "search"}


async def test_nothing_is_stored_so_a_response_cannot_be_fetched(http_server: TokenwireServer) -> None:
    made = await respond(http_server, {"input": "Hi"})
    assert made.status == 200
    assert http_server.http_port is not None
    fetched = await request(http_server.http_port, "GET", f"/v1/responses/{json.loads(made.body)['id']}")
    assert fetched.status == 404


async def test_the_one_admission_authenticates_names_the_caller_and_keeps_idempotency(
    tiny_model_dir: Path, access_lines: io.StringIO
) -> None:
    auth = AuthSettings(tokens=("alpha-secret",), callers=(Caller("alpha"),))
    bearer = {"authorization": "Bearer alpha-secret"}
    async with serving(http_settings(tiny_model_dir, auth=auth)) as server:
        missing = await respond(server, {"input": "Hi"})
        body = {"input": "Hi", "temperature": 1.0, "max_output_tokens": 16}
        first = await respond(server, body, headers={**bearer, "idempotency-key": "key-1"})
        again = await respond(server, body, headers={**bearer, "idempotency-key": "key-1"})
        reused = await respond(
            server, {**body, "max_output_tokens": 8}, headers={**bearer, "idempotency-key": "key-1"}
        )
    assert missing.status == 401 and missing.error()["code"] == "token_missing"
    assert first.status == again.status == 200
    # Unseeded sampling: only the kept result repeats the first answer token for token.
    assert json.loads(again.body)["output"][0]["content"] == json.loads(first.body)["output"][0]["content"]
    assert reused.status == 409 and reused.error()["param"] == "idempotency-key"
    lines = [json.loads(text) for text in access_lines.getvalue().splitlines()]
    outcomes = [(line["method"], line["outcome"], line["caller"]) for line in lines]
    assert ("/v1/responses", "unauthenticated", "anonymous") in outcomes
    assert outcomes.count(("/v1/responses", "ok", "alpha")) == 2

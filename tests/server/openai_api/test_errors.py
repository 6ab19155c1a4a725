"""Bad input, unknown models and a full or draining server answer in OpenAI's error shape, with
the matching status and, for a 400, the parameter named; the SDK raises its own error classes."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.server.openai_api.conftest import base_url, http_settings
from tests.server.openai_api.raw_http import request
from tests.support.openapi_schema import sse_events, validate_response_event
from tests.support.polling import wait_until
from tests.support.servers import serving
from tests.support.stepping import StepGate
from tokenwire.server.app import TokenwireServer
from tokenwire.server.engine.validation import RequestLimits

CHAT = [{"role": "user", "content": "Hello"}]


def client_of(server: TokenwireServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url(server), api_key="unused", max_retries=0)


@pytest.mark.parametrize(
    ("parameters", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": 100_000}, "max_completion_tokens"),
        ({"max_tokens": 5, "max_completion_tokens": 5}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"extra_body": {"temperature": "hot"}}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"seed": -1}, "seed"),
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
        ({"extra_body": {"n": "two"}}, "n"),
        ({"logit_bias": {"17": 500}}, "logit_bias[17]"),
        ({"logit_bias": {"word": 5}}, "logit_bias[word]"),
        ({"logit_bias": {"99999999": 5}}, "logit_bias[99999999]"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"stop": ["x"] * 17}, "stop"),
        ({"stop": ["ok", ""]}, "stop[1]"),
        ({"extra_body": {"stop": 5}}, "stop"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
        ({"extra_body": {"tools_please": True}}, "tools_please"),
        ({"tools": [{"type": "function", "function": {"name": "a tool"}}]}, "tools[0].function.name"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        (
            {"extra_body": {"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}}},
            "response_format.json_schema.schema",
        ),
        ({"extra_headers": {"x-tokenwire-priority": "urgent"}}, "x-tokenwire-priority"),
        ({"extra_headers": {"x-tokenwire-timeout": "soon"}}, "x-tokenwire-timeout"),
        ({"extra_headers": {"x-tokenwire-timeout": "-1"}}, "x-tokenwire-timeout"),
    ],
)
async def test_bad_chat_parameters_are_400_naming_the_parameter(
    http_server: TokenwireServer, parameters: dict[str, Any], param: str
) -> None:
    arguments: dict[str, Any] = {"model": "tiny", "messages": CHAT, **parameters}
    async with client_of(http_server) as client:
        with pytest.raises(openai.BadRequestError) as raised:
            await client.chat.completions.create(**arguments)
    error = raised.value.body
    assert isinstance(error, dict)
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"
    assert param.split("[")[0].split(".")[0] in error["message"] or param in error["message"]


@pytest.mark.parametrize(
    ("parameters", "param"),
    [
        ({"prompt": ["one", "two"]}, "prompt"),
        ({"prompt": [1, 2, -4]}, "prompt[2]"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "echo": True}, "echo"),
        ({"prompt": "x", "best_of": 3}, "best_of"),
        ({"prompt": "x", "best_of": 1, "n": 2}, "best_of"),
        ({"prompt": "x", "suffix": "tail"}, "suffix"),
        ({"prompt": "x", "n": -1}, "n"),
        ({"prompt": "x", "n": 17}, "n"),
    ],
)
async def test_bad_completion_parameters_are_400_naming_the_parameter(
    http_server: TokenwireServer, parameters: dict[str, Any], param: str
) -> None:
    async with client_of(http_server) as client:
        with pytest.raises(openai.BadRequestError) as raised:
            await client.completions.create(model="tiny", **parameters)
    assert isinstance(raised.value.body, dict) and raised.value.body["param"] == param, raised.value.body


async def test_a_prompt_longer_than_the_bound_is_refused_untokenized(tiny_model_dir: Path) -> None:
    settings = http_settings(tiny_model_dir, limits=RequestLimits(max_prompt_chars=100, max_messages=3))
    async with serving(settings) as server, client_of(server) as client:
        with pytest.raises(openai.BadRequestError) as long_prompt:
            await client.completions.create(model="tiny", prompt="x" * 101)
        with pytest.raises(openai.BadRequestError) as many:
            await client.chat.completions.create(model="tiny", messages=CHAT * 4)
    assert long_prompt.value.body["param"] == "prompt"  # type: ignore[index]
    assert (
        "more than 100" in long_prompt.value.body["message"]
        or "longer than 100" in long_prompt.value.body["message"]
    )  # type: ignore[index]
    assert many.value.body["param"] == "messages"  # type: ignore[index]


async def test_malformed_json_a_non_object_and_nan_are_400_naming_the_body(
    http_server: TokenwireServer,
) -> None:
    port = http_server.http_port
    assert port is not None
    for body in (b'{"model": "tiny", "messages": [', b"[1, 2]", b'{"prompt": "x", "temperature": NaN}'):
        reply = await request(port, "POST", "/v1/completions", body)
        assert reply.status == 400, reply
        assert reply.error()["param"] == "body"


async def test_unknown_model_is_404_and_unknown_routes_and_methods_are_refused(
    http_server: TokenwireServer,
) -> None:
    async with client_of(http_server) as client:
        with pytest.raises(openai.NotFoundError) as raised:
            await client.chat.completions.create(model="absent", messages=CHAT)
        with pytest.raises(openai.NotFoundError):
            await client.models.retrieve("absent")
    assert raised.value.body["code"] == "model_not_found"  # type: ignore[index]
    port = http_server.http_port
    assert port is not None
    missing = await request(port, "POST", "/v1/audio/speech", {"input": "x"})
    assert missing.status == 404 and missing.error()["code"] == "not_found"
    wrong = await request(port, "GET", "/v1/chat/completions")
    assert wrong.status == 405 and wrong.headers["allow"] == "POST"


async def test_full_queue_is_429_with_retry_after(tiny_model_dir: Path) -> None:
    gate = StepGate()
    settings = http_settings(tiny_model_dir, max_batch_size=1, max_queue_size=0)
    async with serving(settings, gate=gate) as server, client_of(server) as client:
        engine = server.registry.default.engine
        busy = asyncio.create_task(
            client.completions.create(model="tiny", prompt="Hold the slot", max_tokens=50)
        )
        await wait_until(lambda: engine.live_count == 1, what="the first request to take the slot")
        with pytest.raises(openai.RateLimitError) as raised:
            await client.completions.create(model="tiny", prompt="No room", max_tokens=5)
        gate.open()
        await busy
    assert raised.value.body["code"] == "queue_full"  # type: ignore[index]
    assert raised.value.body["type"] == "rate_limit_error"  # type: ignore[index]
    assert int(raised.value.response.headers["retry-after"]) >= 1


async def test_a_draining_server_is_503_and_finishes_what_it_holds(tiny_model_dir: Path) -> None:
    gate = StepGate()
    async with serving(http_settings(tiny_model_dir), gate=gate) as server, client_of(server) as client:
        engine = server.registry.default.engine
        held = asyncio.create_task(client.completions.create(model="tiny", prompt="Finish me", max_tokens=8))
        await wait_until(lambda: engine.live_count == 1, what="the request to reach the engine")
        draining = asyncio.create_task(server.drain(10))
        await wait_until(lambda: server.lifecycle.phase.value == "draining", what="the drain to begin")
        with pytest.raises(openai.InternalServerError) as raised:
            await client.completions.create(model="tiny", prompt="Too late", max_tokens=5)
        gate.open()
        finished = await held
        assert await draining
    assert raised.value.status_code == 503
    assert raised.value.body["code"] == "draining"  # type: ignore[index]
    assert finished.usage is not None and finished.usage.completion_tokens >= 1


async def test_a_timeout_header_ends_the_generation_with_504(tiny_model_dir: Path) -> None:
    gate = StepGate()
    async with serving(http_settings(tiny_model_dir), gate=gate) as server, client_of(server) as client:
        engine = server.registry.default.engine
        timed = asyncio.create_task(
            client.completions.create(
                model="tiny",
                prompt="Slow",
                max_tokens=50,
                extra_headers={"x-tokenwire-timeout": "0.2"},
            )
        )
        await wait_until(lambda: engine.live_count == 1, what="the request to reach the engine")
        await asyncio.sleep(0.25)  # the deadline passes while every step is held
        gate.open()
        with pytest.raises(openai.APIStatusError) as raised:
            await timed
    assert raised.value.status_code == 504
    assert raised.value.body["type"] == "timeout_error"  # type: ignore[index]
    assert await engine.wait_idle(5)
    assert engine.stats.orphaned_steps == 0


async def test_a_responses_stream_that_fails_after_it_began_ends_with_response_failed(
    tiny_model_dir: Path,
) -> None:
    gate = StepGate()
    gate.allow(2)
    async with serving(http_settings(tiny_model_dir), gate=gate) as server:
        assert server.http_port is not None
        engine = server.registry.default.engine
        body = {"model": "tiny", "input": "Slow", "max_output_tokens": 50, "stream": True}
        streamed = asyncio.create_task(
            request(server.http_port, "POST", "/v1/responses", body, headers={"x-tokenwire-timeout": "0.3"})
        )
        await wait_until(lambda: engine.stats.decode_steps >= 2, what="the stream to begin")
        await asyncio.sleep(0.35)  # the deadline passes while every step is held
        gate.open()
        reply = await streamed
    assert reply.status == 200  # the stream had begun: its failure is its last event
    events = sse_events(reply.body)
    for event in events:
        validate_response_event(event)
    assert events[0]["type"] == "response.created"
    assert "response.output_text.delta" in [event["type"] for event in events]
    assert events[-1]["type"] == "response.failed"
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    assert failed["error"]["message"].startswith("deadline exceeded")

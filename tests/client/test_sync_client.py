"""The blocking client against a real server: typed results, streams, cancel, errors."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tokenwire.client import (
    Client,
    Completed,
    FinishReason,
    GenerateOptions,
    Sampling,
    Stopping,
    TokenwireError,
    service_config,
)
from tokenwire.client.types import Chunk
from tokenwire.server.app import TokenwireServer

OPTIONS = GenerateOptions(
    sampling=Sampling(temperature=0.0), stopping=Stopping(max_new_tokens=12, ignore_eos=True)
)


async def test_generate_and_stream_agree(server: TokenwireServer) -> None:
    def work() -> tuple[object, list[object]]:
        with Client(f"127.0.0.1:{server.port}") as client:
            return client.generate("Hello", OPTIONS), list(client.stream("Hello", OPTIONS))

    generation, events = await asyncio.to_thread(work)
    chunks = [e for e in events if isinstance(e, Chunk)]
    assert isinstance(events[-1], Completed)
    assert [t for c in chunks for t in c.token_ids] == list(generation.token_ids)  # type: ignore[attr-defined]
    assert "".join(c.text for c in chunks) == generation.text  # type: ignore[attr-defined]


async def test_cancel_one_generation_on_a_sync_stream(server: TokenwireServer) -> None:
    long = GenerateOptions(
        sampling=Sampling(temperature=0.0), stopping=Stopping(max_new_tokens=200, ignore_eos=True)
    )

    def work() -> dict[str, Completed]:
        finals: dict[str, Completed] = {}
        with Client(f"127.0.0.1:{server.port}") as client:
            stream = client.open_stream()
            stream.submit("keep", "Hello", OPTIONS)
            stream.submit("drop", "Hello", long)
            stream.cancel("drop")
            stream.close_requests()
            for event in stream.events():
                if isinstance(event, Completed):
                    finals[event.request_id] = event
        return finals

    finals = await asyncio.to_thread(work)
    assert finals["keep"].generation.finish_reason is FinishReason.LENGTH
    dropped = finals["drop"].generation
    assert dropped.finish_reason is FinishReason.CANCELLED
    assert dropped.completion_tokens < 200


async def test_errors_carry_code_and_field_violations(server: TokenwireServer) -> None:
    def work() -> TokenwireError:
        with Client(f"127.0.0.1:{server.port}") as client, pytest.raises(TokenwireError) as raised:
            client.generate("Hello", GenerateOptions(sampling=Sampling(top_p=7.0)))
        return raised.value

    error = await asyncio.to_thread(work)
    assert error.code is grpc.StatusCode.INVALID_ARGUMENT
    assert [v.field for v in error.field_violations] == ["sampling.top_p"]
    assert not error.retryable


def test_the_shipped_retry_policy_retries_only_safe_codes() -> None:
    import json

    config = json.loads(service_config())
    policies = [m["retryPolicy"] for m in config["methodConfig"]]
    inference = next(
        m for m in config["methodConfig"] if m["name"] == [{"service": "tokenwire.v1.InferenceService"}]
    )
    assert sorted(inference["retryPolicy"]["retryableStatusCodes"]) == ["RESOURCE_EXHAUSTED", "UNAVAILABLE"]
    for policy in policies:
        assert set(policy["retryableStatusCodes"]) <= {"UNAVAILABLE", "RESOURCE_EXHAUSTED"}
        assert policy["maxAttempts"] >= 2

"""Limits that protect the server: each violation ends in a clear status, and the server goes on."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from tests.conftest import tiny_settings
from tests.support.servers import serving
from tokenwire.client import AsyncClient, GenerateOptions, Stopping, TokenwireError
from tokenwire.server.config import KeepaliveSettings
from tokenwire.server.engine.validation import RequestLimits
from tokenwire.v1 import inference_service_pb2 as pb
from tokenwire.v1 import inference_service_pb2_grpc as pb_grpc

SHORT = GenerateOptions(stopping=Stopping(2, ignore_eos=True))
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]


async def test_a_message_over_the_receive_limit_is_resource_exhausted(tiny_model_dir: Path) -> None:
    async with (
        serving(tiny_settings(tiny_model_dir, max_receive_message_bytes=16 * 1024)) as server,
        AsyncClient(f"127.0.0.1:{server.port}", retries=False) as client,
    ):
        with pytest.raises(TokenwireError) as too_big:
            await client.generate("x" * 20_000, SHORT)
        after = await client.generate("small", SHORT)
    assert too_big.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert after.completion_tokens == 2


async def test_prompt_length_and_stop_string_limits_name_the_field(tiny_model_dir: Path) -> None:
    limits = RequestLimits(max_prompt_chars=100, max_stop_strings=2)
    async with (
        serving(tiny_settings(tiny_model_dir, limits=limits)) as server,
        AsyncClient(f"127.0.0.1:{server.port}", retries=False) as client,
    ):
        with pytest.raises(TokenwireError) as long_prompt:
            await client.generate("y" * 101, SHORT)
        with pytest.raises(TokenwireError) as many_stops:
            await client.generate("Hi", GenerateOptions(stopping=Stopping(2, stop=("a", "b", "c"))))
        at_the_limits = await client.generate(
            "y" * 100, GenerateOptions(stopping=Stopping(2, stop=("a", "b")))
        )
    assert long_prompt.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert [v.field for v in long_prompt.value.field_violations] == ["prompt"]
    assert many_stops.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert [v.field for v in many_stops.value.field_violations] == ["stopping.stop"]
    assert at_the_limits.completion_tokens <= 2


async def test_calls_beyond_the_stream_limit_wait_for_a_free_stream_on_their_connection(
    tiny_model_dir: Path,
) -> None:
    async with (
        serving(tiny_settings(tiny_model_dir, max_concurrent_streams=1)) as server,
        grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel,
        # Its own subchannel pool, or gRPC would share the first channel's connection.
        grpc.aio.insecure_channel(f"127.0.0.1:{server.port}", options=OWN_CONNECTION) as other_channel,
    ):
        stub = pb_grpc.InferenceServiceStub(channel)
        holding = stub.StreamGenerate()
        await holding.wait_for_connection()
        waiting = asyncio.ensure_future(stub.ListModels(pb.ListModelsRequest()))
        # Another connection has its own streams: its call goes through at once.
        elsewhere = await pb_grpc.InferenceServiceStub(other_channel).ListModels(pb.ListModelsRequest())
        done, _ = await asyncio.wait({waiting}, timeout=0.5)
        assert not done, "a second stream was opened on a connection limited to one"
        await holding.done_writing()
        assert await holding.read() is grpc.aio.EOF
        listed = await asyncio.wait_for(waiting, timeout=10)
    assert [m.name for m in elsewhere.models] == [m.name for m in listed.models] == ["tiny"]


async def test_a_client_pinging_too_often_is_sent_away_and_others_are_served(tiny_model_dir: Path) -> None:
    keepalive = KeepaliveSettings(min_ping_interval=5.0, max_ping_strikes=1)
    eager_pings = [
        ("grpc.keepalive_time_ms", 100),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]
    async with serving(tiny_settings(tiny_model_dir, keepalive=keepalive)) as server:
        options = [*eager_pings, *OWN_CONNECTION]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}", options=options) as channel:
            idle_call = pb_grpc.InferenceServiceStub(channel).StreamGenerate(timeout=30)
            with pytest.raises(grpc.aio.AioRpcError) as sent_away:
                await idle_call.read()
        async with AsyncClient(f"127.0.0.1:{server.port}", retries=False) as client:
            models = await client.list_models()
    assert sent_away.value.code() is grpc.StatusCode.UNAVAILABLE
    assert "too many pings" in (sent_away.value.details() or "").lower()
    assert [m.name for m in models] == ["tiny"]

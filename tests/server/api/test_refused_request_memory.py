"""A refused call lets go of its decoded request when it ends, without the cyclic collector.

An abort's exception is kept on the call's state, and its traceback would keep every frame the
refusal passed, the decoded request with them, until the cyclic collector ran: a run of refused
requests of many tiny entries (decoded, tens of times their wire size) piled up hundreds of
megabytes. Here the collector is off while refused requests go through each kind of call that takes a
GenerateRequest, and every decoded request must be gone when the calls have ended. (A call
refused for its token never decodes its request: the refusal reads only the headers.)
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tests.conftest import tiny_settings
from tests.support.servers import serving
from tokenwire.v1 import inference_service_pb2 as pb

SERVICE = "/tokenwire.v1.InferenceService/"
TURNS = pb.GenerateRequest(messages=[pb.ChatMessage()] * 5000).SerializeToString()
"""5,000 empty chat turns: over the server's bound on messages, so validation refuses it."""


def _raw(data: bytes) -> bytes:
    return data


def live_requests() -> int:
    """Decoded requests alive in this process, which is also the server's."""
    kinds = {pb.GenerateRequest, pb.StreamGenerateRequest}
    # type(), not isinstance(): some objects of other libraries warn when asked for __class__.
    return sum(1 for found in gc.get_objects() if type(found) in kinds)


@pytest.fixture
def no_cyclic_collector() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.collect()


async def refuse_each_kind(channel: grpc.aio.Channel) -> set[grpc.StatusCode]:
    """One refused request on each call kind that takes a GenerateRequest; their status codes."""
    codes: set[grpc.StatusCode] = set()
    unary = channel.unary_unary(SERVICE + "Generate", request_serializer=_raw, response_deserializer=_raw)
    server_streaming = channel.unary_stream(
        SERVICE + "GenerateStream", request_serializer=_raw, response_deserializer=_raw
    )
    for _ in range(3):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await unary(TURNS)
        codes.add(refused.value.code())
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _ in server_streaming(TURNS):
                pass
        codes.add(refused.value.code())
    return codes


async def until_freed() -> int:
    """Live requests once the server's handlers have finished (they end just after the client
    hears the status): polled, at most 10 s."""
    for _ in range(1000):
        if live_requests() == 0:
            return 0
        await asyncio.sleep(0.01)
    return live_requests()


@pytest.mark.usefixtures("no_cyclic_collector")
async def test_requests_refused_by_validation_are_freed_when_their_calls_end(tiny_model_dir: Path) -> None:
    async with (
        serving(tiny_settings(tiny_model_dir)) as server,
        grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel,
    ):
        assert await refuse_each_kind(channel) == {grpc.StatusCode.INVALID_ARGUMENT}
        stream = channel.stream_stream(
            SERVICE + "StreamGenerate", request_serializer=_raw, response_deserializer=_raw
        )
        call = stream()
        for n in range(3):
            await call.write(
                pb.StreamGenerateRequest(generate=pb.GenerateRequest.FromString(TURNS)).SerializeToString()
            )
            answer = pb.StreamGenerateResponse.FromString(await call.read())
            assert answer.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0], n
        await call.done_writing()
        assert await call.read() is grpc.aio.EOF
        assert await until_freed() == 0

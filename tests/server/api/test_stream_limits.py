"""What one StreamGenerate call may hold: live generations, queue places, unsent output; and the
request bounds every call meets before any work (request_id's characters)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tests.conftest import ServerFactory
from tests.support.events import Transcript, read_until
from tests.support.options import greedy
from tests.support.stepping import StepGate, gated
from tokenwire.client import AsyncClient, Failed, Started, TokenwireError
from tokenwire.server.api.outbox import Outbox
from tokenwire.server.api.stream_limits import StreamLimits
from tokenwire.v1 import inference_service_pb2 as pb
from tokenwire.v1 import inference_service_pb2_grpc as pb_grpc


def started(transcript: Transcript, request_id: str) -> bool:
    return any(isinstance(event, Started) for event in transcript.events.get(request_id, []))


def failure(transcript: Transcript, request_id: str) -> TokenwireError:
    final = transcript.final(request_id)
    assert isinstance(final, Failed), final
    assert isinstance(final.error, TokenwireError)
    return final.error


async def test_generations_past_the_per_call_limits_are_refused_naming_the_limit(
    start_server: ServerFactory,
) -> None:
    gate = StepGate()  # nothing finishes while the test fills the call
    server = await start_server(
        wrap_model=gated(gate),
        max_batch_size=2,
        max_queue_size=8,
        stream=StreamLimits(max_generations_per_stream=8, max_queued_per_stream=2),
    )
    transcript = Transcript()
    try:
        async with (
            AsyncClient(f"127.0.0.1:{server.port}", retries=False) as client,
            client.open_stream() as stream,
        ):
            events = stream.events()
            for index in range(2):  # both slots
                await stream.submit(f"run{index}", "Running", greedy(100))
            # The gate holds the engine thread at each decode step: a step at a time lets the
            # second one in, and every step gives the first one a token to read.
            while not all(started(transcript, f"run{i}") for i in range(2)):
                gate.allow(1)
                transcript.add(await anext(events))
            for index in range(3):  # two queue places, then the queue limit
                await stream.submit(f"wait{index}", "Waiting", greedy(5))
            await read_until(events, transcript, lambda t: t.finished("wait2"))
            queue_refusal = failure(transcript, "wait2")
            # Another call still gets its queue place: the limit is the call's, not the server's.
            other = asyncio.create_task(client.generate("Another caller", greedy(3)))
            await asyncio.sleep(0)
            gate.open()
            assert (await other).completion_tokens == 3
    finally:
        gate.open()
    assert queue_refusal.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert queue_refusal.reason == "STREAM_QUEUE_LIMIT"
    assert "--max-queued-per-stream 2" in queue_refusal.message


async def test_the_live_generation_limit_counts_running_and_queued(start_server: ServerFactory) -> None:
    gate = StepGate()
    server = await start_server(
        wrap_model=gated(gate), max_batch_size=2, stream=StreamLimits(max_generations_per_stream=2)
    )
    transcript = Transcript()
    try:
        async with (
            AsyncClient(f"127.0.0.1:{server.port}", retries=False) as client,
            client.open_stream() as stream,
        ):
            events = stream.events()
            for index in range(3):
                await stream.submit(f"g{index}", "Hello", greedy(5))
            await read_until(events, transcript, lambda t: t.finished("g2"))
            refusal = failure(transcript, "g2")
    finally:
        gate.open()
    assert refusal.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert refusal.reason == "STREAM_GENERATIONS_LIMIT"


@pytest.mark.parametrize("request_id", ["has space", "tab\there", "line\u2028sep", "é", "x" * 129])
async def test_a_request_id_outside_its_charset_or_length_is_invalid(
    start_server: ServerFactory, request_id: str
) -> None:
    server = await start_server()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await pb_grpc.InferenceServiceStub(channel).Generate(
                pb.GenerateRequest(request_id=request_id, prompt="hi"), timeout=30
            )
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "request_id" in (refused.value.details() or "")
    assert len(refused.value.details() or "") < 300


def chunk(text: str) -> pb.StreamGenerateResponse:
    return pb.StreamGenerateResponse(request_id="r", chunk=pb.TokenChunk(text=text))


async def test_the_outbox_counts_unsent_bytes_until_they_are_sent() -> None:
    outbox = Outbox(max_bytes=100)
    assert outbox.put(chunk("x" * 40))
    assert outbox.put(chunk("y" * 40))
    taken = await outbox.take_all()
    assert len(taken) == 2 and outbox.unsent_bytes > 80  # taken, not yet sent: still counted
    assert not outbox.put(chunk("z" * 40))  # past the bound
    outbox.sent()
    assert 0 < outbox.unsent_bytes <= 50
    outbox.discard()
    assert outbox.unsent_bytes == 0

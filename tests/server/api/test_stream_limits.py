"""What one StreamGenerate call may hold: live generations, queue places, unsent output, how long
output may wait unread; and the request bounds every call meets before any work (request_id's
characters)."""

from __future__ import annotations

import asyncio
import io
import json
from dataclasses import replace

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from tests.conftest import ServerFactory
from tests.support.events import Transcript, read_until
from tests.support.fake_runner import ManualClock
from tests.support.options import greedy
from tests.support.polling import wait_until
from tests.support.stepping import StepGate, gated
from tokenwire.client import AsyncClient, Failed, Started, TokenwireError
from tokenwire.server.api.outbox import Outbox
from tokenwire.server.api.stream_limits import MIB, StreamLimits
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


async def test_the_live_generation_limit_counts_each_completion_of_a_request(
    start_server: ServerFactory,
) -> None:
    gate = StepGate()  # nothing finishes while the call fills up
    server = await start_server(
        wrap_model=gated(gate), max_batch_size=4, stream=StreamLimits(max_generations_per_stream=4)
    )
    transcript = Transcript()
    try:
        async with (
            AsyncClient(f"127.0.0.1:{server.port}", retries=False) as client,
            client.open_stream() as stream,
        ):
            events = stream.events()
            await stream.submit("three", "Hello", replace(greedy(5), n=3))
            await stream.submit("two", "Hello", replace(greedy(5), n=2))  # 3 + 2 > 4
            await stream.submit("one", "Hello", greedy(5))  # 3 + 1 fits
            # Its first event is its refusal (a wrong admission would show `queued` instead).
            await read_until(events, transcript, lambda t: "two" in t.events)
            refusal = failure(transcript, "two")
            gate.open()
            await read_until(events, transcript, lambda t: t.finished("three") and t.finished("one"))
    finally:
        gate.open()
    assert refusal.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert refusal.reason == "STREAM_GENERATIONS_LIMIT"
    assert "asks for 2" in refusal.message and "already has 3 live generations" in refusal.message
    assert not isinstance(transcript.final("three"), Failed)
    assert not isinstance(transcript.final("one"), Failed)


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


def unread_generation(request_id: str, tokens: int) -> pb.StreamGenerateRequest:
    """A generation with plenty of output per token (20 alternatives each)."""
    return pb.StreamGenerateRequest(
        generate=pb.GenerateRequest(
            request_id=request_id,
            prompt="Write forever",
            stopping=pb.StoppingCriteria(max_new_tokens=tokens, ignore_eos=True),
            logprobs=True,
            top_logprobs=20,
        )
    )


def error_reason(status: status_pb2.Status) -> str:
    for detail in status.details:
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            return info.reason
    return ""


async def test_generations_whose_output_waits_unread_past_the_timeout_are_stopped_and_free_their_slots(
    start_server: ServerFactory, every_log_line: io.StringIO
) -> None:
    gate = StepGate()
    # The byte bound is far away: only the unread-output timeout can stop these generations.
    server = await start_server(
        wrap_model=gated(gate),
        max_batch_size=4,
        stream=StreamLimits(unread_output_timeout=0.2, max_unsent_bytes_per_stream=64 * MIB),
    )
    engine = server.registry.default.engine
    # Without BDP probing the client's receive window stays at HTTP/2's 64 KiB, so output it does
    # not read stays in the server, as on a real network.
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}", options=[("grpc.http2.bdp_probe", 0)])
    try:
        call = pb_grpc.InferenceServiceStub(channel).StreamGenerate()
        names = [f"unread-{i}" for i in range(4)]
        for name in names:
            await call.write(unread_generation(name, 240))
        # 150 steps of four generations, about 180 KiB of output: far more than the window. Then the
        # gate holds the engine, so none can end by itself: only the stop can end them.
        gate.allow(150)
        await wait_until(lambda: engine.stats.abort_requests == 4, timeout=30, what="the four to be stopped")
        # A generation asked for while the output still waits is refused without a slot.
        await call.write(unread_generation("late", 4))

        def refused_late() -> bool:
            lines = [json.loads(line) for line in every_log_line.getvalue().splitlines()]
            # Refused before its id is bounded, the line does not quote the id: the reason tells.
            return any(line.get("reason") == "STREAM_OUTPUT_UNREAD" for line in lines)

        await wait_until(refused_late, what="the late generation's refusal")
        gate.open()
        await wait_until(lambda: engine.live_count == 0, what="the stopped generations to leave their slots")
        # Now read: each generation's output so far, then its error; the call is still open.
        finals: dict[str, pb.StreamGenerateResponse] = {}
        tokens = dict.fromkeys([*names, "late"], 0)
        while len(finals) < 5:
            response = await call.read()
            assert response is not grpc.aio.EOF
            if response.WhichOneof("event") == "chunk":
                tokens[response.request_id] += len(response.chunk.token_ids)
            elif response.WhichOneof("event") in ("completed", "error"):
                finals[response.request_id] = response
        # Read again, a generation runs to its end on the same call.
        await call.write(unread_generation("after", 4))
        await call.done_writing()
        after: list[pb.StreamGenerateResponse] = []
        while (response := await call.read()) is not grpc.aio.EOF:
            after.append(response)
        status = await call.code()
    finally:
        gate.open()
        await channel.close()
    for name in [*names, "late"]:
        final = finals[name]
        assert final.WhichOneof("event") == "error", final
        assert final.error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        assert error_reason(final.error) == "STREAM_OUTPUT_UNREAD"
        assert "--unread-output-timeout" in final.error.message
    assert all(0 < tokens[name] < 240 for name in names)
    assert tokens["late"] == 0
    # The four ended by the stop, "after" by itself; "late" never reached the engine.
    stats = engine.stats
    assert (stats.aborted, stats.finished, stats.prefill_chunks) == (4, 5, 5)
    assert after[-1].WhichOneof("event") == "completed" and after[-1].request_id == "after"
    assert status is grpc.StatusCode.OK


def chunk(text: str) -> pb.StreamGenerateResponse:
    return pb.StreamGenerateResponse(request_id="r", chunk=pb.TokenChunk(text=text))


async def test_the_outbox_counts_unsent_bytes_until_they_are_sent() -> None:
    outbox = Outbox(max_bytes=100, clock=ManualClock())
    assert outbox.put(chunk("x" * 40))
    assert outbox.put(chunk("y" * 40))
    taken = await outbox.take_all()
    assert len(taken) == 2 and outbox.unsent_bytes > 80  # taken, not yet sent: still counted
    assert not outbox.put(chunk("z" * 40))  # past the bound
    outbox.sent()
    assert 0 < outbox.unsent_bytes <= 50
    outbox.discard()
    assert outbox.unsent_bytes == 0


async def test_the_outbox_knows_since_when_its_oldest_response_waits_unsent() -> None:
    clock = ManualClock()
    outbox = Outbox(max_bytes=1000, clock=clock)
    assert outbox.unsent_since() is None
    outbox.put(chunk("a"))
    clock.advance(1.0)
    outbox.put(chunk("b"))
    assert outbox.unsent_since() == 100.0
    await outbox.take_all()
    clock.advance(1.0)
    outbox.put(chunk("c"))
    assert outbox.unsent_since() == 100.0  # the batch being sent is older than what waits behind it
    outbox.sent()
    assert outbox.unsent_since() == 102.0
    await outbox.take_all()
    outbox.sent()
    outbox.put(None)  # a wake-up is not a response
    assert outbox.unsent_since() is None

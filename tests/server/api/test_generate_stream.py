"""GenerateStream: one generation per call, with StreamGenerate's events and Generate's errors.

Real servers on free ports, real ONNX Runtime and tokenizers, the raw generated stub (so what the
wire carries is what is checked) and the client library's `stream`, which runs on this call. A
step gate holds decode steps where a test needs to know exactly when the call ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from tests.conftest import ServerFactory
from tests.support.options import greedy
from tests.support.polling import wait_until
from tests.support.stepping import StepGate, gated
from tokenwire.client import AsyncClient, Chunk, Client, Completed, Failed, FinishReason, Queued, Started
from tokenwire.server.api.stream_limits import StreamLimits
from tokenwire.server.app import TokenwireServer
from tokenwire.v1 import inference_service_pb2 as pb
from tokenwire.v1 import inference_service_pb2_grpc as pb_grpc


def request(prompt: str, max_new_tokens: int, **fields: object) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt=prompt,
        sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingCriteria(max_new_tokens=max_new_tokens, ignore_eos=True),
        **fields,  # type: ignore[arg-type]
    )


@pytest.fixture
async def stub(server: TokenwireServer) -> AsyncIterator[pb_grpc.InferenceServiceStub]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield pb_grpc.InferenceServiceStub(channel)


@pytest.fixture
async def one_slot(start_server: ServerFactory, gate: StepGate) -> AsyncIterator[TokenwireServer]:
    server = await start_server(wrap_model=gated(gate), max_batch_size=1)
    yield server
    gate.open()


def kinds(messages: list[pb.StreamGenerateResponse]) -> list[str]:
    return [str(m.WhichOneof("event")) for m in messages]


async def test_events_come_in_order_and_carry_the_same_tokens_as_generate(
    stub: pb_grpc.InferenceServiceStub,
) -> None:
    messages = [m async for m in stub.GenerateStream(request("The sky is", 8, request_id="mine"))]
    unary = await stub.Generate(request("The sky is", 8))
    events = kinds(messages)
    assert events[:2] == ["queued", "started"]
    assert events[-1] == "completed" and set(events[2:-1]) == {"chunk"}
    assert {m.request_id for m in messages} == {"mine"}
    tokens = [t for m in messages if m.HasField("chunk") for t in m.chunk.token_ids]
    assert tokens == list(unary.token_ids)
    assert "".join(m.chunk.text for m in messages if m.HasField("chunk")) == unary.text
    completed = messages[-1].completed
    assert completed.finish_reason == pb.FINISH_REASON_LENGTH
    assert completed.usage.completion_tokens == 8
    assert messages[1].started.prompt_tokens == completed.usage.prompt_tokens > 0
    # The timing of the whole generation, measured from receipt, as on the other two calls.
    timing = completed.timing
    first = timing.time_to_first_token.ToNanoseconds()
    assert 0 < first <= timing.total.ToNanoseconds()
    assert timing.prefill.ToNanoseconds() > 0


async def test_an_empty_request_id_gets_one_assigned(stub: pb_grpc.InferenceServiceStub) -> None:
    messages = [m async for m in stub.GenerateStream(request("Hi", 2))]
    (assigned,) = {m.request_id for m in messages}
    assert assigned.startswith("gen-")


async def test_bad_input_ends_the_call_with_generates_status_naming_the_field(
    stub: pb_grpc.InferenceServiceStub,
) -> None:
    bad = request("Hi", 4)
    bad.sampling.top_p = 1.5
    call = stub.GenerateStream(bad)
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        [m async for m in call]
    assert raised.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    status = rpc_status.from_call(raised.value)
    assert status is not None
    bad_request = error_details_pb2.BadRequest()
    assert any(detail.Unpack(bad_request) for detail in status.details)
    assert [v.field for v in bad_request.field_violations] == ["sampling.top_p"]
    with pytest.raises(grpc.aio.AioRpcError) as unary:
        await stub.Generate(bad)
    assert unary.value.details() == raised.value.details()


async def test_an_unknown_model_is_not_found_before_any_event(stub: pb_grpc.InferenceServiceStub) -> None:
    received: list[pb.StreamGenerateResponse] = []

    async def read_all() -> None:
        async for message in stub.GenerateStream(request("Hi", 2, model="no-such-model")):
            received.append(message)

    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await read_all()
    assert raised.value.code() is grpc.StatusCode.NOT_FOUND
    assert received == []


async def test_cancelling_the_call_stops_the_generation_within_one_step(
    one_slot: TokenwireServer, gate: StepGate
) -> None:
    engine = one_slot.registry.default.engine
    async with grpc.aio.insecure_channel(f"127.0.0.1:{one_slot.port}") as channel:
        call = pb_grpc.InferenceServiceStub(channel).GenerateStream(request("Abandoned", 150))
        seen: list[pb.StreamGenerateResponse] = []
        gate.allow(2)
        while sum(len(m.chunk.token_ids) for m in seen) < 2:
            seen.append(await call.read())  # type: ignore[attr-defined]
        call.cancel()
    await wait_until(lambda: engine.stats.abort_requests == 1, what="the server to notice the cancel")
    steps_at_cancel = engine.stats.decode_steps
    gate.open()
    assert await engine.wait_idle(5)
    assert engine.stats.aborted == 1
    assert engine.stats.max_abort_latency_steps <= 1
    assert engine.stats.orphaned_steps == 0
    # The step held at the gate when the abort arrived may finish; no other step runs.
    assert engine.stats.decode_steps - steps_at_cancel <= 1


async def test_leaving_the_client_stream_early_stops_the_generation(
    one_slot: TokenwireServer, gate: StepGate
) -> None:
    engine = one_slot.registry.default.engine
    async with AsyncClient(f"127.0.0.1:{one_slot.port}", retries=False) as client:
        gate.allow(1)
        async for event in client.stream("Left early", greedy(150)):
            if isinstance(event, Chunk):
                break
        await wait_until(lambda: engine.stats.abort_requests == 1, what="the server to notice the cancel")
        gate.open()
        assert await engine.wait_idle(5)
        after = await client.generate("Next", greedy(3))  # the slot is free again
    assert after.completion_tokens == 3
    assert engine.stats.aborted == 1
    assert engine.stats.max_abort_latency_steps <= 1


async def test_the_call_deadline_mid_generation_is_deadline_exceeded_and_stops_it(
    one_slot: TokenwireServer, gate: StepGate
) -> None:
    engine = one_slot.registry.default.engine
    async with AsyncClient(f"127.0.0.1:{one_slot.port}", retries=False) as client:
        gate.allow(2)
        events = [event async for event in client.stream("Slow", greedy(150), deadline=0.5)]
    assert isinstance(events[0], Queued)
    assert isinstance(events[-1], Failed)
    assert events[-1].error.code is grpc.StatusCode.DEADLINE_EXCEEDED  # type: ignore[attr-defined]
    await wait_until(lambda: engine.stats.abort_requests == 1, what="the deadline to reach the engine")
    gate.open()
    assert await engine.wait_idle(5)
    assert engine.stats.max_abort_latency_steps <= 1
    assert engine.stats.orphaned_steps == 0


async def test_a_request_timeout_passing_in_the_queue_fails_the_call_after_queued(
    one_slot: TokenwireServer, gate: StepGate
) -> None:
    engine = one_slot.registry.default.engine
    async with AsyncClient(f"127.0.0.1:{one_slot.port}", retries=False) as client:
        busy = asyncio.create_task(client.generate("Occupy the only slot", greedy(20)))
        await wait_until(lambda: engine.live_count == 1, what="the slot to be taken")
        late = client.stream("Waits in the queue", greedy(20, timeout=0.2))
        first = await anext(late)
        await asyncio.sleep(0.25)  # the per-request deadline passes while the request is queued
        gate.allow(1)  # the engine reaches a step boundary, where deadlines are checked
        rest = [event async for event in late]
        gate.open()
        assert (await busy).completion_tokens == 20
    assert isinstance(first, Queued)
    assert not any(isinstance(event, Started) for event in rest)
    (failed,) = rest
    assert isinstance(failed, Failed) and failed.request_id == first.request_id
    assert failed.error.code is grpc.StatusCode.DEADLINE_EXCEEDED  # type: ignore[attr-defined]


async def test_the_same_idempotency_key_again_joins_the_running_generation(
    one_slot: TokenwireServer, gate: StepGate
) -> None:
    engine = one_slot.registry.default.engine
    async with AsyncClient(f"127.0.0.1:{one_slot.port}", retries=False) as client:
        first = client.stream("Once", greedy(12), request_id="a", idempotency_key="job-1")
        assert isinstance(await anext(first), Queued)
        gate.allow(3)
        second = client.stream("Once", greedy(12), request_id="b", idempotency_key="job-1")
        assert isinstance(await anext(second), Queued)
        gate.open()
        first_events = [event async for event in first]
        second_events = [event async for event in second]
    assert engine.stats.finished == 1  # one generation, heard by both calls

    def tokens(events: list[object]) -> list[int]:
        return [t for e in events if isinstance(e, Chunk) for t in e.token_ids]

    assert len(tokens(first_events)) == 12
    assert tokens(second_events) == tokens(first_events)
    assert isinstance(second_events[-1], Completed)
    assert second_events[-1].generation.finish_reason is FinishReason.LENGTH


async def test_the_blocking_client_streams_over_the_same_call(server: TokenwireServer) -> None:
    def run() -> list[object]:
        with Client(f"127.0.0.1:{server.port}", retries=False) as client:
            return list(client.stream("Hello", greedy(5)))

    events = await asyncio.to_thread(run)
    assert isinstance(events[0], Queued) and isinstance(events[1], Started)
    assert sum(len(e.token_ids) for e in events if isinstance(e, Chunk)) == 5
    assert isinstance(events[-1], Completed)


async def test_a_client_that_stops_reading_has_its_generation_stopped(start_server: ServerFactory) -> None:
    # A tiny unsent-bytes bound, and a reader that takes only the first event: the output that
    # HTTP/2 flow control holds back piles up in the call's outbox until the bound stops it.
    server = await start_server(stream=StreamLimits(max_unsent_bytes_per_stream=2048), max_batch_size=1)
    engine = server.registry.default.engine
    async with grpc.aio.insecure_channel(
        f"127.0.0.1:{server.port}",
        # A small receive window that never grows, so flow control holds responses back at once.
        options=[("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)],
    ) as channel:
        call = pb_grpc.InferenceServiceStub(channel).GenerateStream(
            request("Unread", 240, logprobs=True, top_logprobs=20)
        )
        assert (await call.read()).HasField("queued")  # type: ignore[attr-defined]
        assert await engine.wait_idle(60)

        async def read_to_the_end() -> None:
            while await call.read() is not grpc.aio.EOF:  # type: ignore[attr-defined]
                pass

        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await read_to_the_end()
    assert raised.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max-unsent-bytes-per-stream" in (raised.value.details() or "")
    assert engine.stats.aborted == 1

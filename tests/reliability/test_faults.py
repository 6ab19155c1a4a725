"""Faults: killed clients, cancel storms, deadlines in the queue and mid-decode, failing model steps.

After each fault the same guarantees are checked (tests/reliability/recovery.py): nothing live
or queued, no decode step ran for aborted work beyond the one an abort may take to land
(EngineStats.orphaned_steps == 0, max_abort_latency_steps <= 1), health SERVING, and a full batch
still completes. Where the exact sequence matters, a step gate (tests/support/stepping.py) holds
the real decode steps so the fault lands at a known point; the storm runs at real speed.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2

from tests.conftest import ServerFactory
from tests.reliability.recovery import assert_recovered, health_status
from tests.reliability.stream_client import ClientProcess
from tests.reliability.workload import Outcome, build_mix, run_load
from tests.support.events import Transcript, read_until
from tests.support.options import greedy
from tests.support.polling import wait_until
from tests.support.stepping import StepGate, gated
from tokenwire.client import (
    AsyncClient,
    Completed,
    Failed,
    FinishReason,
    Queued,
    Started,
    StreamEvent,
    TokenwireError,
)
from tokenwire.server.api.stream_limits import StreamLimits
from tokenwire.server.app import TokenwireServer
from tokenwire.server.models.loader import LoadedModel
from tokenwire.server.models.runner import ModelInfo, ModelRunner

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def gate() -> Iterator[StepGate]:
    """A closed gate; opened at teardown (before the server stops) even when the test failed."""
    held = StepGate()
    yield held
    held.open()


async def drain_stream(
    events: AsyncIterator[StreamEvent], transcript: Transcript, timeout: float = 30.0
) -> None:
    async def read_all() -> None:
        async for event in events:
            transcript.add(event)

    await asyncio.wait_for(read_all(), timeout)


async def reading(
    events: AsyncIterator[StreamEvent],
    transcript: Transcript,
    condition: Callable[[Transcript], bool],
    timeout: float = 30.0,
) -> None:
    """read_until with a bound: fails the test instead of waiting forever for an event."""
    await asyncio.wait_for(read_until(events, transcript, condition), timeout)


def all_heard_of(request_ids: list[str]) -> Callable[[Transcript], bool]:
    return lambda transcript: all(transcript.events[r] for r in request_ids)


def final(transcript: Transcript, request_id: str) -> StreamEvent:
    return transcript.final(request_id)


def error_code(event: StreamEvent) -> grpc.StatusCode:
    assert isinstance(event, Failed), event
    assert isinstance(event.error, TokenwireError), event.error
    return event.error.code


# -- a client process killed mid-stream -----------------------------------------------------------


async def test_client_process_killed_mid_stream_frees_its_running_and_queued_generations(
    start_server: ServerFactory, gate: StepGate
) -> None:
    server = await start_server(wrap_model=gated(gate), max_batch_size=2)
    engine = server.registry.default.engine
    client = ClientProcess(server.port, generations=3, max_new_tokens=200)
    try:
        # g0 runs alone (its first token comes from the prompt pass) while a decode step is held;
        # one allowed step lets the engine admit g1 into the second slot; g2 keeps waiting.
        await wait_until(
            lambda: client.seen("g0", "Chunk") and client.seen("g2", "Queued"),
            timeout=30,
            what="the client process to stream",
        )
        gate.allow(1)
        await wait_until(lambda: client.seen("g1", "Chunk"), timeout=10, what="g1 to start")
        assert engine.live_count == 3 and engine.queue_depth == 1
        client.kill()
        await wait_until(lambda: engine.stats.abort_requests == 3, timeout=10, what="the server to notice")
    finally:
        if client.process.poll() is None:
            client.kill()
        gate.open()
    stats = await assert_recovered(server)
    assert stats.aborted == 3
    assert stats.step_failures == 0


# -- cancels ---------------------------------------------------------------------------------------


async def test_cancel_wave_on_held_steps_stops_exactly_the_cancelled_work(
    start_server: ServerFactory, gate: StepGate
) -> None:
    """12 live requests (a full batch and queue) on three streams and three unary calls, most of
    them queued behind a held decode step; seven are cancelled in every way a client can (cancel
    message, cancelled stream call, cancelled unary call). Exactly those seven stop, within one
    step; the rest finish."""
    server = await start_server(wrap_model=gated(gate), max_batch_size=4, max_queue_size=8)
    engine = server.registry.default.engine
    target = f"127.0.0.1:{server.port}"
    transcripts = {name: Transcript() for name in ("a", "b", "c")}
    async with AsyncClient(target, retries=False) as client:
        streams = {name: client.open_stream() for name in transcripts}
        readers = {name: stream.events() for name, stream in streams.items()}
        for name, stream in streams.items():
            for index in range(3):
                await stream.submit(f"{name}{index}", f"Stream {name}, generation {index}", greedy(20))
        for name, events in readers.items():
            await reading(events, transcripts[name], all_heard_of([f"{name}{i}" for i in range(3)]))
        unary = [asyncio.create_task(client.generate(f"Unary {i}", greedy(20))) for i in range(3)]
        await wait_until(lambda: engine.live_count == 12, what="12 accepted requests")

        await streams["a"].cancel("a0")
        await streams["a"].cancel("a1")
        await streams["a"].cancel("not-a-live-id")
        await streams["b"].cancel("b2")
        streams["c"].cancel_all()
        unary[0].cancel()
        await wait_until(lambda: engine.stats.abort_requests == 7, what="seven aborts to reach the engine")

        gate.open()
        await reading(readers["a"], transcripts["a"], lambda t: t.finished("a0"))
        await streams["a"].cancel("a0")  # no longer live: does nothing
        for name in ("a", "b"):
            await streams[name].close_requests()
            await drain_stream(readers[name], transcripts[name])
        with pytest.raises(asyncio.CancelledError):  # grpc.aio's word for "you cancelled this call"
            await drain_stream(readers["c"], transcripts["c"])
        with pytest.raises(asyncio.CancelledError):
            await unary[0]
        finished_unary = await asyncio.wait_for(asyncio.gather(*unary[1:]), 30)
        # The same requests alone: the cancels around them did not change their tokens.
        alone = {
            request_id: await client.generate(
                f"Stream {request_id[0]}, generation {request_id[1]}", greedy(20)
            )
            for request_id in ("a2", "b0", "b1")
        }
        alone_unary = [await client.generate(f"Unary {i}", greedy(20)) for i in (1, 2)]

    for request_id in ("a0", "a1", "b2"):
        last = final(transcripts[request_id[0]], request_id)
        assert isinstance(last, Completed) and last.generation.finish_reason is FinishReason.CANCELLED
        # Running ones had one token when the step was held; the held step may add one more.
        assert len(transcripts[request_id[0]].tokens(request_id)) <= 2
    for request_id in ("a2", "b0", "b1"):
        last = final(transcripts[request_id[0]], request_id)
        assert isinstance(last, Completed) and last.generation.finish_reason is FinishReason.LENGTH
        assert transcripts[request_id[0]].tokens(request_id) == list(alone[request_id].token_ids)
    assert [g.token_ids for g in finished_unary] == [g.token_ids for g in alone_unary]
    assert [g.completion_tokens for g in finished_unary] == [20, 20]
    stats = await assert_recovered(server)
    assert stats.abort_requests == 7  # the cancel of a finished id and of an unknown id did nothing


async def cancel_storm(server: TokenwireServer, requests: int) -> None:
    run = await run_load(
        f"127.0.0.1:{server.port}",
        build_mix(requests, seed=7, cancel_fraction=0.7),
        concurrency=24,
        hang_timeout=30,
    )
    assert not run.problems(), "\n".join(run.problems()[:20])
    assert {o.outcome for o in run.outcomes} <= {
        Outcome.COMPLETED,
        Outcome.CANCELLED,
        Outcome.REJECTED,
        Outcome.DEADLINE,
    }
    assert run.count(Outcome.CANCELLED) > 0, run.by_outcome()
    stats = await assert_recovered(server)
    assert stats.abort_requests >= run.count(Outcome.CANCELLED)


async def test_cancel_storm_at_real_speed_leaves_nothing_behind(start_server: ServerFactory) -> None:
    """Streams whose generations are cancelled at random points (right after `queued` or after a
    few chunks), mixed with unary calls and deadlines, at full speed and over capacity."""
    await cancel_storm(await start_server(max_batch_size=4, max_queue_size=8), 150)


@pytest.mark.heavy
@pytest.mark.timeout(1200)
async def test_heavy_cancel_storm_at_real_speed_leaves_nothing_behind(start_server: ServerFactory) -> None:
    await cancel_storm(await start_server(max_batch_size=4, max_queue_size=8), 3000)


# -- deadlines -------------------------------------------------------------------------------------


async def test_deadlines_passing_in_the_queue_and_mid_decode_stop_the_work(
    start_server: ServerFactory, gate: StepGate
) -> None:
    """Three running (one without deadline, one stream with a 0.5 s per-request timeout, one unary
    call with a 1 s gRPC deadline) and two queued (a stream with a 0.5 s timeout, a unary call
    with a 1 s gRPC deadline). All four deadlines pass while a decode step is held."""
    server = await start_server(wrap_model=gated(gate), max_batch_size=3, max_queue_size=8)
    engine = server.registry.default.engine
    transcript = Transcript()
    async with (
        AsyncClient(f"127.0.0.1:{server.port}", retries=False) as client,
        client.open_stream() as stream,
    ):
        events = stream.events()
        # Each newcomer waits while the engine is held in a step; one allowed step admits it.
        await stream.submit("long", "No deadline", greedy(30))
        await reading(events, transcript, lambda t: len(t.tokens("long")) == 1)
        await stream.submit("mid", "Runs out of time mid-decode", greedy(30, timeout=0.5))
        await wait_until(lambda: engine.queue_depth == 1, what="mid to wait")
        gate.allow(1)
        await reading(events, transcript, lambda t: len(t.tokens("mid")) == 1)
        running = asyncio.create_task(client.generate("Unary, running", greedy(30), deadline=1.0))
        await wait_until(lambda: engine.queue_depth == 1, what="the unary call to wait")
        gate.allow(1)
        await wait_until(lambda: engine.live_count == 3 and engine.queue_depth == 0, what="three running")
        await reading(events, transcript, lambda t: len(t.tokens("mid")) == 2)
        await stream.submit("queued", "Runs out of time in the queue", greedy(30, timeout=0.5))
        await reading(events, transcript, lambda t: bool(t.events["queued"]))
        waiting = asyncio.create_task(client.generate("Unary, queued", greedy(30), deadline=1.0))
        await wait_until(lambda: engine.queue_depth == 2, what="two queued requests")

        # The unary calls end on the client at their gRPC deadline, 1 s after they were sent: by
        # then every deadline above has passed, while the engine is still held in a step.
        for call in (running, waiting):
            with pytest.raises(TokenwireError) as raised:
                await asyncio.wait_for(call, 10)
            assert raised.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
        steps_before = engine.stats.decode_steps
        gate.allow(1)  # the held step ends; the next boundary applies every deadline
        await reading(events, transcript, lambda t: t.finished("mid") and t.finished("queued"))
        gate.open()
        await stream.close_requests()
        await drain_stream(events, transcript)

    assert error_code(final(transcript, "mid")) is grpc.StatusCode.DEADLINE_EXCEEDED
    # Two tokens when its deadline passed; the step held at that moment may add one more.
    assert len(transcript.tokens("mid")) <= 3
    queued = transcript.events["queued"]
    assert isinstance(queued[0], Queued) and not any(isinstance(e, Started) for e in queued)
    assert error_code(final(transcript, "queued")) is grpc.StatusCode.DEADLINE_EXCEEDED
    long = final(transcript, "long")
    assert isinstance(long, Completed) and long.generation.completion_tokens == 30
    assert engine.stats.decode_steps > steps_before
    await assert_recovered(server)


# -- a model step that raises ----------------------------------------------------------------------


class FaultyRunner:
    """The real runner, except that chosen prompt passes and decode steps raise (1-based call counts)."""

    def __init__(self, inner: ModelRunner, *, failing_prefills: set[int], failing_decodes: set[int]) -> None:
        self._inner = inner
        self._failing_prefills = failing_prefills
        self._failing_decodes = failing_decodes
        self.prefills = 0
        self.decodes = 0

    @property
    def info(self) -> ModelInfo:
        return self._inner.info

    def capacity(self) -> int:
        return self._inner.capacity()

    def prefill(self, seq_id: int, token_ids: Sequence[int], *, start: int) -> np.ndarray:
        self.prefills += 1
        if self.prefills in self._failing_prefills:
            raise RuntimeError(f"injected failure in prompt pass {self.prefills}")
        return self._inner.prefill(seq_id, token_ids, start=start)

    def decode(self, seq_ids: Sequence[int], token_ids: Sequence[int]) -> np.ndarray:
        self.decodes += 1
        if self.decodes in self._failing_decodes:
            raise RuntimeError(f"injected failure in decode step {self.decodes}")
        return self._inner.decode(seq_ids, token_ids)

    def release(self, seq_id: int) -> None:
        self._inner.release(seq_id)


async def test_failing_model_steps_fail_only_their_requests_and_the_stream_stays_open(
    start_server: ServerFactory, gate: StepGate
) -> None:
    """s0 runs alone while the others queue behind a held step. Then s1, s2, s3 are admitted: the
    prompt pass of s2 (the third prompt pass) raises, and the next decode step (the second: s0, s1,
    s3) raises.
    s4 and s5, admitted afterwards, finish; so does s6, sent on the same stream after the failures."""

    def faulty(model: LoadedModel) -> LoadedModel:
        runner = FaultyRunner(model.runner, failing_prefills={3}, failing_decodes={2})
        return gated(gate)(replace(model, runner=runner))  # type: ignore[no-any-return]

    # One stream queues six behind the held step on purpose.
    server = await start_server(
        wrap_model=faulty, max_batch_size=4, max_queue_size=8, stream=StreamLimits(max_queued_per_stream=8)
    )
    engine = server.registry.default.engine
    transcript = Transcript()
    async with (
        AsyncClient(f"127.0.0.1:{server.port}", retries=False) as client,
        client.open_stream() as stream,
    ):
        events = stream.events()
        await stream.submit("s0", "Alone first", greedy(20))
        await reading(events, transcript, lambda t: len(t.tokens("s0")) == 1)
        for index in range(1, 6):
            await stream.submit(f"s{index}", f"Behind the held step {index}", greedy(20))
        await wait_until(lambda: engine.live_count == 6, what="six live requests")
        gate.open()
        await reading(events, transcript, lambda t: all(t.finished(f"s{i}") for i in range(6)))
        await stream.submit("s6", "After the failures, same stream", greedy(20))
        await stream.close_requests()
        await drain_stream(events, transcript)

    for request_id in ("s0", "s1", "s2", "s3"):
        last = final(transcript, request_id)
        assert error_code(last) is grpc.StatusCode.INTERNAL, request_id
        assert isinstance(last, Failed) and isinstance(last.error, TokenwireError)
        assert last.error.reason == "MODEL_FAILURE"
    assert transcript.tokens("s2") == []
    for request_id in ("s4", "s5", "s6"):
        last = final(transcript, request_id)
        assert isinstance(last, Completed) and last.generation.completion_tokens == 20, request_id
    stats = await assert_recovered(server)
    assert stats.step_failures == 2


# -- drain -----------------------------------------------------------------------------------------


async def test_drain_under_load_finishes_accepted_work_and_refuses_the_rest_as_retryable(
    start_server: ServerFactory,
) -> None:
    server = await start_server(max_batch_size=4, max_queue_size=8)
    engine = server.registry.default.engine
    load = asyncio.create_task(
        run_load(f"127.0.0.1:{server.port}", build_mix(300, seed=5), concurrency=24, hang_timeout=30)
    )
    await wait_until(lambda: engine.live_count >= engine.slots, what="the load to fill the batch")
    drained = await server.drain(timeout=30)
    run = await asyncio.wait_for(load, 60)

    assert drained
    assert not run.problems(), "\n".join(run.problems()[:20])  # includes "accepted, then UNAVAILABLE"
    assert {o.outcome for o in run.outcomes} <= {
        Outcome.COMPLETED,
        Outcome.REJECTED,
        Outcome.DEADLINE,
        Outcome.UNAVAILABLE,
    }
    assert run.count(Outcome.UNAVAILABLE) > 0, run.by_outcome()
    assert engine.live_count == 0 and engine.queue_depth == 0
    assert engine.stats.orphaned_steps == 0
    assert await health_status(server.port) == health_pb2.HealthCheckResponse.NOT_SERVING

"""Deadlines in the queue and mid-generation, and callers that go away, all stop the work.

A step gate holds decode steps, so "the deadline passes while the request waits" and "the
client vanishes mid-generation" happen at exactly known points. The engine counts, for every
aborted sequence, how many decode steps it took part in after the abort reached the engine:
never more than one.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from tests.conftest import ServerFactory
from tests.support.events import Transcript, read_until
from tests.support.options import greedy
from tests.support.polling import wait_until
from tests.support.stepping import StepGate, gated
from tokenwire.client import (
    AsyncClient,
    Completed,
    Failed,
    Queued,
    Started,
    TokenwireError,
)
from tokenwire.server.app import TokenwireServer


@pytest.fixture
async def one_slot(start_server: ServerFactory, gate: StepGate) -> AsyncIterator[TokenwireServer]:
    server = await start_server(wrap_model=gated(gate), max_batch_size=1)
    yield server
    gate.open()


@pytest.fixture
async def two_slots(start_server: ServerFactory, gate: StepGate) -> AsyncIterator[TokenwireServer]:
    server = await start_server(wrap_model=gated(gate), max_batch_size=2)
    yield server
    gate.open()


async def test_deadline_passing_in_the_queue_fails_without_ever_starting(
    one_slot: TokenwireServer, gate: StepGate
) -> None:
    transcript = Transcript()
    async with (
        AsyncClient(f"127.0.0.1:{one_slot.port}", retries=False) as client,
        client.open_stream() as stream,
    ):
        events = stream.events()
        await stream.submit("busy", "Occupy the only slot", greedy(20))
        await read_until(events, transcript, lambda t: len(t.tokens("busy")) >= 1)
        await stream.submit("late", "Waits in the queue", greedy(20, timeout=0.2))
        await read_until(events, transcript, lambda t: bool(t.events["late"]))
        await asyncio.sleep(0.25)  # the per-request deadline passes while the request is queued
        gate.allow(1)  # the engine reaches a step boundary, where deadlines are checked
        await read_until(events, transcript, lambda t: t.finished("late"))
        gate.open()
        await stream.close_requests()
        async for event in events:
            transcript.add(event)
    late = transcript.events["late"]
    assert isinstance(late[0], Queued)
    assert not any(isinstance(e, Started) for e in late)
    assert isinstance(late[-1], Failed)
    assert late[-1].error.code is grpc.StatusCode.DEADLINE_EXCEEDED  # type: ignore[attr-defined]
    busy = transcript.final("busy")
    assert isinstance(busy, Completed) and busy.generation.completion_tokens == 20


async def test_deadline_passing_mid_generation_stops_it(one_slot: TokenwireServer, gate: StepGate) -> None:
    engine = one_slot.registry.default.engine
    transcript = Transcript()
    async with (
        AsyncClient(f"127.0.0.1:{one_slot.port}", retries=False) as client,
        client.open_stream() as stream,
    ):
        events = stream.events()
        await stream.submit("r", "Runs out of time", greedy(100, timeout=0.3))
        await read_until(events, transcript, lambda t: len(t.tokens("r")) >= 1)
        gate.allow(3)
        await read_until(events, transcript, lambda t: len(t.tokens("r")) >= 4)
        await asyncio.sleep(0.35)  # the deadline passes while a step is held
        gate.allow(2)
        await read_until(events, transcript, lambda t: t.finished("r"))
        gate.open()
    final = transcript.final("r")
    assert isinstance(final, Failed) and final.error.code is grpc.StatusCode.DEADLINE_EXCEEDED  # type: ignore[attr-defined]
    # One held step could still finish after the deadline; the next boundary ends it.
    assert 4 <= len(transcript.tokens("r")) <= 5
    assert await engine.wait_idle(5)
    assert engine.stats.orphaned_steps == 0


async def test_grpc_deadline_on_unary_call_stops_the_generation(
    one_slot: TokenwireServer, gate: StepGate
) -> None:
    engine = one_slot.registry.default.engine
    async with AsyncClient(f"127.0.0.1:{one_slot.port}", retries=False) as client:
        with pytest.raises(TokenwireError) as raised:
            await client.generate("Slow", greedy(100), deadline=0.3)
    assert raised.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
    gate.open()
    assert await engine.wait_idle(5)
    assert engine.stats.max_abort_latency_steps <= 1
    assert engine.stats.orphaned_steps == 0


async def test_client_cancelling_the_stream_stops_all_its_generations(
    two_slots: TokenwireServer, gate: StepGate
) -> None:
    engine = two_slots.registry.default.engine
    transcript = Transcript()
    async with (
        AsyncClient(f"127.0.0.1:{two_slots.port}", retries=False) as client,
        client.open_stream() as stream,
    ):
        events = stream.events()
        await stream.submit("x", "First of two", greedy(150))
        await stream.submit("y", "Second of two", greedy(150))
        await read_until(events, transcript, lambda t: bool(t.events["x"]) and bool(t.events["y"]))
        gate.allow(2)
        await read_until(events, transcript, lambda t: len(t.tokens("x")) >= 2 and len(t.tokens("y")) >= 2)
        stream.cancel_all()
    await wait_until(lambda: engine.stats.abort_requests == 2, what="the server to notice the cancelled call")
    steps_at_cancel = engine.stats.decode_steps
    gate.open()
    assert await engine.wait_idle(5)
    assert engine.stats.aborted == 2
    assert engine.stats.max_abort_latency_steps <= 1
    assert engine.stats.orphaned_steps == 0
    # The step held at the gate when the abort arrived may finish; no other step runs.
    assert engine.stats.decode_steps - steps_at_cancel <= 1


async def test_client_cancelling_a_unary_call_frees_the_slot(
    one_slot: TokenwireServer, gate: StepGate
) -> None:
    engine = one_slot.registry.default.engine
    async with AsyncClient(f"127.0.0.1:{one_slot.port}", retries=False) as client:
        call = asyncio.create_task(client.generate("Abandoned", greedy(150)))
        await wait_until(lambda: engine.live_count == 1, what="the request to reach the engine")
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        gate.open()
        assert await engine.wait_idle(5)
        # The freed slot serves the next request at once.
        after = await client.generate("Next", greedy(5))
    assert after.completion_tokens == 5
    assert engine.stats.aborted == 1
    assert engine.stats.max_abort_latency_steps <= 1

"""--max-connection-age: an aged connection is replaced by a new one while its calls finish.

The server and the client share this process, so the client's connections are read from the
kernel's own table (/proc/net/tcp): the established sockets whose remote port is the server's.
A step gate holds a generation's decode steps past the connection's age, so "a stream spans the
age" happens for certain, not by timing.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from tests.conftest import ServerFactory
from tests.support.options import greedy
from tests.support.polling import wait_until
from tests.support.stepping import StepGate, gated
from tokenwire.client import AsyncClient, Chunk, Completed, Failed, FinishReason, Queued
from tokenwire.server.app import server_options
from tokenwire.server.config import ServerSettings

ESTABLISHED = "01"
AGE = 1.0
"""Seconds: short enough for a test, and gRPC's jitter keeps it within 0.9 to 1.1."""

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads Linux's /proc/net/tcp")


def client_ports(server_port: int) -> set[int]:
    """Local ports of this machine's established TCP connections to `server_port` (gRPC's
    sockets are dual-stack, so IPv4 connections may be listed as IPv6 ones)."""
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, remote, state = line.split()[1:4]
            if state == ESTABLISHED and int(remote.rsplit(":", 1)[1], 16) == server_port:
                ports.add(int(local.rsplit(":", 1)[1], 16))
    return ports


def test_the_age_and_grace_become_grpc_options_and_zero_turns_aging_off() -> None:
    options = dict(server_options(ServerSettings(max_connection_age=120, max_connection_age_grace=900)))
    assert options["grpc.max_connection_age_ms"] == 120_000
    assert options["grpc.max_connection_age_grace_ms"] == 900_000
    assert "grpc.max_connection_age_ms" not in dict(server_options(ServerSettings(max_connection_age=0)))
    # The default grace outlasts the longest generation a request may ask for at 0.5 s a step.
    defaults = ServerSettings()
    assert defaults.max_connection_age_grace > defaults.limits.max_new_tokens_cap * 0.5


@pytest.fixture
async def gate() -> AsyncIterator[StepGate]:
    held = StepGate()
    yield held
    held.open()  # before the servers stop: their engines may be waiting at the gate


async def test_a_connection_past_its_age_is_replaced_while_its_stream_finishes_in_full(
    start_server: ServerFactory, gate: StepGate
) -> None:
    server = await start_server(wrap_model=gated(gate), max_connection_age=AGE)
    async with AsyncClient(f"127.0.0.1:{server.port}", retries=False) as client:
        stream = client.stream("Spans the age", greedy(30))
        assert isinstance(await anext(stream), Queued)
        (first_connection,) = client_ports(server.port)
        # Keep making calls: once the age passes, the server's GOAWAY sends them to a new connection.
        loop = asyncio.get_running_loop()
        give_up = loop.time() + 30
        while client_ports(server.port) == {first_connection}:
            assert loop.time() < give_up, "no new connection was made after the age passed"
            # (ListModels: the engine thread is held at the gate, so no generation could run.)
            assert [model.name for model in await client.list_models(deadline=10)] == ["tiny"]
            await asyncio.sleep(0.05)
        # The held stream still runs on the old connection, which stays open for it.
        assert first_connection in client_ports(server.port)
        gate.open()
        rest = [event async for event in stream]
        await wait_until(
            lambda: first_connection not in client_ports(server.port),
            timeout=30,
            what="the aged connection to close once its last call ended",
        )
    assert not any(isinstance(event, Failed) for event in rest)
    assert sum(len(event.token_ids) for event in rest if isinstance(event, Chunk)) == 30
    final = rest[-1]
    assert isinstance(final, Completed) and final.generation.finish_reason is FinishReason.LENGTH


async def test_a_call_still_running_when_the_grace_ends_is_cut(
    start_server: ServerFactory, gate: StepGate
) -> None:
    # What the long default grace is for: past it the connection closes under its calls.
    server = await start_server(wrap_model=gated(gate), max_connection_age=AGE, max_connection_age_grace=AGE)
    engine = server.registry.default.engine
    try:
        async with AsyncClient(f"127.0.0.1:{server.port}", retries=False) as client:
            events = [event async for event in client.stream("Held past the grace", greedy(30), deadline=60)]
        assert isinstance(events[0], Queued)
        assert isinstance(events[-1], Failed)
        assert events[-1].error.code is grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
        # The server lost the call with its connection: the generation is stopped, not run on.
        await wait_until(
            lambda: engine.stats.abort_requests == 1, what="the server to notice the closed call"
        )
    finally:
        gate.open()
    assert await engine.wait_idle(5)
    assert engine.stats.max_abort_latency_steps <= 1

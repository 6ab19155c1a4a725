"""The bundled retry policy makes a request refused for capacity succeed once capacity frees up, for
Generate and for a generation streamed on a GenerateStream call of its own: both are refused
with a status before any response, which gRPC's retry policy sends again."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import grpc

from tests.conftest import ServerFactory
from tests.support.polling import wait_until
from tests.support.stepping import StepGate, gated
from tokenwire.client import (
    AsyncClient,
    Chunk,
    Client,
    Failed,
    GenerateOptions,
    Generation,
    Sampling,
    Stopping,
    TokenwireError,
    collect,
)
from tokenwire.server.app import TokenwireServer

OPTIONS = GenerateOptions(
    sampling=Sampling(temperature=0.0), stopping=Stopping(max_new_tokens=4, ignore_eos=True)
)


@dataclass
class FullServer:
    """A server with one slot, no queue and decode steps held at a gate, its one slot taken."""

    server: TokenwireServer
    gate: StepGate
    plain: AsyncClient
    occupying: asyncio.Task[Generation]

    def rejected(self) -> int:
        """Rejections seen so far (each one a RESOURCE_EXHAUSTED attempt by a retrying client)."""
        return self.server.registry.default.engine.stats.rejected


@asynccontextmanager
async def full_server(start_server: ServerFactory) -> AsyncIterator[FullServer]:
    gate = StepGate()
    server = await start_server(wrap_model=gated(gate), max_batch_size=1, max_queue_size=0)
    engine = server.registry.default.engine
    async with AsyncClient(f"127.0.0.1:{server.port}", retries=False) as plain:
        occupying = asyncio.create_task(plain.generate("occupy", OPTIONS))
        await wait_until(lambda: engine.live_count == 1, what="the slot to be taken")
        yield FullServer(server, gate, plain, occupying)


async def test_rejected_request_is_retried_after_the_pushback_and_succeeds(
    start_server: ServerFactory,
) -> None:
    async with full_server(start_server) as full, AsyncClient(f"127.0.0.1:{full.server.port}") as retrying:
        retried = asyncio.create_task(retrying.generate("retried", OPTIONS))
        engine = full.server.registry.default.engine
        await wait_until(lambda: engine.stats.finished == 0 and full.rejected() >= 1, what="a rejection")
        full.gate.open()
        assert (await full.occupying).completion_tokens == 4
        assert (await retried).completion_tokens == 4


async def test_a_streamed_generation_refused_at_admission_is_sent_again_unseen(
    start_server: ServerFactory,
) -> None:
    # The generation is refused (queue full) before its call sent anything: gRPC sends the call
    # again after the server's pushback, and the caller sees only the generation that ran.
    async with full_server(start_server) as full, AsyncClient(f"127.0.0.1:{full.server.port}") as retrying:
        retried = asyncio.create_task(collect(retrying.stream("retried", OPTIONS)))
        await wait_until(lambda: full.rejected() >= 1, what="a rejection")
        full.gate.open()
        assert (await full.occupying).completion_tokens == 4
        assert (await retried).completion_tokens == 4


async def test_without_retries_the_refusal_reaches_the_caller(start_server: ServerFactory) -> None:
    async with full_server(start_server) as full:
        events = [event async for event in full.plain.stream("refused", OPTIONS)]
        full.gate.open()
        await full.occupying
    assert len(events) == 1
    assert isinstance(events[0], Failed)
    assert isinstance(events[0].error, TokenwireError)
    assert events[0].error.code == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_a_retrying_client_gives_each_generation_an_idempotency_key(
    start_server: ServerFactory,
) -> None:
    # What makes gRPC's retries (and the client's own, for a stream) safe to send: each attempt
    # carries the first's key, so the server joins or returns the first attempt's generation.
    gate = StepGate()
    server = await start_server(wrap_model=gated(gate))
    engine = server.registry.default.engine
    target = f"127.0.0.1:{server.port}"
    async with AsyncClient(target) as retrying, AsyncClient(target, retries=False) as plain:
        keyed = asyncio.gather(
            retrying.generate("keyed", OPTIONS), collect(retrying.stream("keyed stream", OPTIONS))
        )
        unkeyed = asyncio.create_task(plain.generate("plain", OPTIONS, request_id="1"))
        await wait_until(lambda: engine.live_count == 3, what="three generations to be admitted")
        registered = server.generations.live_count
        gate.open()
        await keyed
        await unkeyed
    with Client(target) as blocking:
        await asyncio.to_thread(blocking.generate, "blocking", OPTIONS)
    assert registered == 2  # the two of the retrying client; a request_id alone is no key
    assert server.generations.kept_count == 3


async def test_the_blocking_client_sends_a_refused_streamed_generation_again_too(
    start_server: ServerFactory,
) -> None:
    async with full_server(start_server) as full:
        with Client(f"127.0.0.1:{full.server.port}") as blocking:
            streamed = asyncio.create_task(
                asyncio.to_thread(lambda: list(blocking.stream("retried", OPTIONS)))
            )
            await wait_until(lambda: full.rejected() >= 1, what="a rejection")
            full.gate.open()
            events = await streamed
        await full.occupying
    assert not any(isinstance(event, Failed) for event in events)
    assert sum(len(event.token_ids) for event in events if isinstance(event, Chunk)) == 4

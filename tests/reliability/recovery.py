"""What must hold after every fault: the engine is empty, no decode step ran for aborted work
beyond the one an abort may take to land, health says SERVING, and a full batch still completes
(so no slot or KV cache was leaked by the fault)."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.options import greedy
from tests.support.polling import wait_until
from tokenwire.client import AsyncClient, FinishReason
from tokenwire.server.app import SERVICE_NAME, TokenwireServer
from tokenwire.server.engine.engine import EngineStats


async def health_status(port: int) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        response = await stub.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5)
    return int(response.status)


async def assert_recovered(server: TokenwireServer, *, timeout: float = 10.0) -> EngineStats:
    """Check every after-fault guarantee; returns the engine's counters for further checks."""
    engine = server.registry.default.engine
    assert await engine.wait_idle(timeout), f"engine still busy: {engine.live_count} live"
    await wait_until(
        lambda: engine.live_count == 0 and engine.queue_depth == 0,
        timeout=timeout,
        what="no live and no queued request",
    )
    stats = engine.stats
    assert stats.orphaned_steps == 0, stats
    assert stats.max_abort_latency_steps <= 1, stats
    assert await health_status(server.port) == health_pb2.HealthCheckResponse.SERVING
    async with AsyncClient(f"127.0.0.1:{server.port}", retries=False) as client:
        batch = await asyncio.wait_for(
            asyncio.gather(
                *(client.generate(f"after the fault {i}", greedy(6)) for i in range(engine.slots))
            ),
            timeout,
        )
    assert [g.completion_tokens for g in batch] == [6] * engine.slots
    assert all(g.finish_reason is FinishReason.LENGTH for g in batch)
    assert await engine.wait_idle(timeout)
    assert engine.live_count == 0 and engine.queue_depth == 0
    return engine.stats

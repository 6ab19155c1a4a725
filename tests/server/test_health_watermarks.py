"""Health turns NOT_SERVING when a queue reaches the high watermark, and SERVING only once it is
back down to the low one, so load balancers shift traffic without the status flapping."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from tests.conftest import tiny_settings
from tests.support.events import Transcript, read_until
from tests.support.polling import wait_until
from tests.support.servers import serving
from tests.support.stepping import StepGate
from tokenwire.client import AsyncClient, Completed, GenerateOptions, Queued, Sampling, Stopping
from tokenwire.server.api.stream_limits import StreamLimits
from tokenwire.server.app import SERVICE_NAME
from tokenwire.server.config import HealthSettings
from tokenwire.server.health import HealthReporter
from tokenwire.server.lifecycle import ServingPhase

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
LONG = GenerateOptions(sampling=Sampling(temperature=0.0), stopping=Stopping(200, ignore_eos=True))


async def check(servicer: HealthServicer, service: str) -> int:
    response = await servicer.Check(health_pb2.HealthCheckRequest(service=service), None)
    return int(response.status)


async def test_watermarks_have_hysteresis_and_never_override_the_lifecycle() -> None:
    servicer = HealthServicer()
    reporter = HealthReporter(servicer, ("", SERVICE_NAME), HealthSettings(queue_high_watermark=4))
    reporter.bind(asyncio.get_running_loop())
    reporter.phase_changed(ServingPhase.SERVING)

    async def after_round(queued: int, model: str = "m") -> tuple[int, int]:
        # Reported from a thread of its own, as an engine thread would.
        reporter_thread = threading.Thread(
            target=reporter.occupancy,
            kwargs={
                "model": model,
                "queued": queued,
                "running": 1,
                "slots": 1,
                "kv_positions_used": 1,
                "kv_positions": 1,
            },
        )
        reporter_thread.start()
        # The join's result comes back through the loop after the reporter's own hop to it.
        await asyncio.to_thread(reporter_thread.join)
        await reporter.settled()
        return await check(servicer, ""), await check(servicer, SERVICE_NAME)

    assert await after_round(3) == (SERVING, SERVING)
    assert await after_round(4) == (NOT_SERVING, NOT_SERVING)  # at the high watermark
    assert await after_round(3) == (NOT_SERVING, NOT_SERVING)  # between: still overloaded
    assert await after_round(2) == (SERVING, SERVING)  # the low watermark defaults to half
    assert await after_round(3) == (SERVING, SERVING)  # between again: still fine
    # Two models: health is SERVING only while neither is overloaded.
    assert await after_round(5, "m") == (NOT_SERVING, NOT_SERVING)
    assert await after_round(9, "other") == (NOT_SERVING, NOT_SERVING)
    assert await after_round(0, "m") == (NOT_SERVING, NOT_SERVING)
    assert await after_round(0, "other") == (SERVING, SERVING)
    # Draining is NOT_SERVING whatever the queues say.
    reporter.phase_changed(ServingPhase.DRAINING)
    assert await after_round(0) == (NOT_SERVING, NOT_SERVING)
    assert await after_round(7) == (NOT_SERVING, NOT_SERVING)
    assert await after_round(0) == (NOT_SERVING, NOT_SERVING)


async def test_a_real_queue_turns_health_off_and_back_on_through_watch(tiny_model_dir: Path) -> None:
    gate = StepGate()
    settings = tiny_settings(
        tiny_model_dir,
        max_batch_size=1,
        health=HealthSettings(queue_high_watermark=3, queue_low_watermark=1),
        stream=StreamLimits(max_queued_per_stream=8),  # this one stream fills the queue on purpose
    )
    async with (
        serving(settings, gate=gate) as server,
        grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel,
        AsyncClient(f"127.0.0.1:{server.port}", retries=False) as client,
        client.open_stream() as stream,
    ):
        health = health_pb2_grpc.HealthStub(channel)
        watch = health.Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
        assert (await watch.read()).status == SERVING

        async def status_now() -> int:
            return int((await health.Check(health_pb2.HealthCheckRequest())).status)

        transcript = Transcript()
        events = stream.events()
        await stream.submit("r0", "Holds the only slot", LONG)
        await read_until(events, transcript, lambda t: len(t.tokens("r0")) >= 1)
        for request_id in ("r1", "r2", "r3", "r4"):
            await stream.submit(request_id, "Queued", LONG)
        await read_until(events, transcript, lambda t: all(t.events[r] for r in ("r1", "r2", "r3", "r4")))

        engine = server.registry.default.engine

        async def cancels_reached_engine(count: int) -> None:
            # A cancel travels the stream to the server first; the round must start after it lands.
            await wait_until(
                lambda: engine.stats.abort_requests == count, what="the cancels to reach the engine"
            )

        # Each allowed step ends a scheduling round, which reports the queue; the chunk it
        # produces arrives after that report's health update.
        async def one_round() -> None:
            before = len(transcript.tokens("r0"))
            gate.allow(1)
            await read_until(events, transcript, lambda t: len(t.tokens("r0")) > before)

        await one_round()  # 4 queued, at or over the high watermark
        assert (await watch.read()).status == NOT_SERVING
        assert await status_now() == NOT_SERVING
        # Health only steers new traffic: a request sent here anyway is still accepted.
        await stream.submit("r5", "Still welcome", LONG)
        await read_until(events, transcript, lambda t: bool(t.events["r5"]))
        assert isinstance(transcript.events["r5"][0], Queued)

        for request_id in ("r5", "r4", "r3"):
            await stream.cancel(request_id)
        await cancels_reached_engine(3)
        await one_round()  # the cancels are applied at the start of the next round
        await read_until(events, transcript, lambda t: all(t.finished(r) for r in ("r3", "r4", "r5")))
        await one_round()  # 2 queued: between the watermarks
        assert await status_now() == NOT_SERVING

        await stream.cancel("r2")
        await cancels_reached_engine(4)
        await one_round()
        await read_until(events, transcript, lambda t: t.finished("r2"))
        await one_round()  # 1 queued: down to the low watermark
        assert (await watch.read()).status == SERVING
        assert await status_now() == SERVING

        for request_id in ("r0", "r1"):
            await stream.cancel(request_id)
        gate.open()
        await stream.close_requests()
        async for event in events:
            transcript.add(event)
        watch.cancel()
    assert all(isinstance(transcript.final(f"r{i}"), Completed) for i in range(6))

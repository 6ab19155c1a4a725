"""A client that closes its stream or connection stops its generation within one decode step,
and the request is recorded as cancelled, exactly as a cancelled gRPC call.

A step gate holds decode steps, so the close always arrives while the generation still has
most of its tokens to go; the engine counts, for every aborted sequence, the decode steps it
took part in after its abort arrived.
"""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path

import openai
import pytest

from tests.server.openai_api.conftest import base_url, http_settings
from tests.support.polling import wait_until
from tests.support.prometheus import scrape
from tests.support.servers import serving
from tests.support.stepping import StepGate
from tokenwire.server.config import TelemetrySettings
from tokenwire.server.engine.engine import Engine


async def stopped_within_one_step(engine: Engine, gate: StepGate) -> None:
    """Once the server has noticed the close, the held generation takes at most one more step."""
    await wait_until(lambda: engine.stats.abort_requests == 1, what="the server to notice the close")
    steps_at_close = engine.stats.decode_steps
    gate.open()
    assert await engine.wait_idle(5)
    assert engine.stats.aborted == 1
    assert engine.stats.max_abort_latency_steps <= 1
    assert engine.stats.orphaned_steps == 0
    assert engine.stats.decode_steps - steps_at_close <= 1


async def test_closing_an_sdk_stream_stops_the_generation_within_one_step_and_records_a_cancel(
    tiny_model_dir: Path, access_lines: io.StringIO
) -> None:
    gate = StepGate()
    gate.allow(3)
    telemetry = TelemetrySettings(metrics_port=0, metrics_cache_seconds=0)
    settings = http_settings(tiny_model_dir, max_batch_size=1, telemetry=telemetry)
    async with serving(settings, gate=gate) as server:
        engine = server.registry.default.engine
        client = openai.AsyncOpenAI(base_url=base_url(server), api_key="unused", max_retries=0)
        stream = await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Go on and on"}],
            max_tokens=150,
            temperature=0,
            stream=True,
        )
        # Greedy output of the deterministic tiny model: the same chunks every run. The first
        # chunk names the role, the second carries text.
        chunks = 0
        async for _ in stream:
            chunks += 1
            if chunks == 2:
                break
        await stream.close()
        await stopped_within_one_step(engine, gate)
        assert server.metrics_port is not None
        metrics = await scrape(server.metrics_port)
        await client.close()
    cancelled = {"gen_ai_request_model": "tiny", "outcome": "cancelled", "caller": "anonymous"}
    assert metrics.value("tokenwire_server_requests_total", **cancelled) == 1
    (line,) = [json.loads(text) for text in access_lines.getvalue().splitlines()]
    assert line["method"] == "/v1/chat/completions"
    assert line["outcome"] == "cancelled" and line["finish_reason"] == "cancelled"
    assert 1 <= line["completion_tokens"] < 150


async def test_a_client_dropping_a_whole_response_request_frees_its_slot(tiny_model_dir: Path) -> None:
    gate = StepGate()
    async with serving(http_settings(tiny_model_dir, max_batch_size=1), gate=gate) as server:
        engine = server.registry.default.engine
        async with openai.AsyncOpenAI(base_url=base_url(server), api_key="unused", max_retries=0) as client:
            call = asyncio.create_task(
                client.completions.create(model="tiny", prompt="Abandoned", max_tokens=150)
            )
            await wait_until(lambda: engine.live_count == 1, what="the request to reach the engine")
            call.cancel()  # the SDK closes the connection under the request
            with pytest.raises(asyncio.CancelledError):
                await call
            await wait_until(lambda: engine.stats.abort_requests == 1, what="the server to notice")
            gate.open()
            assert await engine.wait_idle(5)
            after = await client.completions.create(model="tiny", prompt="Next", max_tokens=5)
    assert after.usage is not None and after.usage.completion_tokens >= 1
    assert engine.stats.aborted == 1
    assert engine.stats.max_abort_latency_steps <= 1
    assert engine.stats.orphaned_steps == 0


async def test_a_sync_sdk_stream_left_early_stops_its_generation(tiny_model_dir: Path) -> None:
    gate = StepGate()
    gate.allow(2)
    async with serving(http_settings(tiny_model_dir, max_batch_size=1), gate=gate) as server:
        engine = server.registry.default.engine

        def read_two_chunks_and_leave() -> int:
            with openai.OpenAI(base_url=base_url(server), api_key="unused", max_retries=0) as client:
                stream = client.completions.create(
                    model="tiny", prompt="Long", max_tokens=150, temperature=0, stream=True
                )
                with stream:
                    for count, _ in enumerate(stream, start=1):
                        if count == 2:
                            return count
            return 0

        assert await asyncio.to_thread(read_two_chunks_and_leave) == 2
        await wait_until(lambda: engine.stats.abort_requests == 1, what="the server to notice the close")
        gate.open()
        assert await engine.wait_idle(5)
    assert engine.stats.aborted == 1
    assert engine.stats.max_abort_latency_steps <= 1
    assert engine.stats.orphaned_steps == 0


async def test_closing_a_responses_stream_stops_the_generation_within_one_step_and_records_a_cancel(
    tiny_model_dir: Path, access_lines: io.StringIO
) -> None:
    gate = StepGate()
    gate.allow(3)
    async with serving(http_settings(tiny_model_dir, max_batch_size=1), gate=gate) as server:
        engine = server.registry.default.engine
        client = openai.AsyncOpenAI(base_url=base_url(server), api_key="unused", max_retries=0)
        stream = await client.responses.create(
            model="tiny", input="Go on and on", max_output_tokens=150, temperature=0, stream=True
        )
        kinds = []
        async for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                break
        await stream.close()
        await stopped_within_one_step(engine, gate)
        await client.close()
    assert kinds[:2] == ["response.created", "response.in_progress"]
    (line,) = [json.loads(text) for text in access_lines.getvalue().splitlines()]
    assert line["method"] == "/v1/responses"
    assert line["outcome"] == "cancelled" and line["finish_reason"] == "cancelled"
    assert 1 <= line["completion_tokens"] < 150

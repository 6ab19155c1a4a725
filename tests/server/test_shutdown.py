"""SIGTERM drains a real server process: live work finishes, new work is refused, exit 0."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.events import Transcript, read_until
from tests.support.serve_process import ServeProcess, start_serve
from tokenwire.client import (
    AsyncClient,
    Completed,
    Failed,
    GenerateOptions,
    Sampling,
    Stopping,
    TokenwireError,
)
from tokenwire.server.model_tools.tiny_gpt import TinyGptConfig, create_tiny_gpt

LONG = GenerateOptions(
    sampling=Sampling(temperature=0.0), stopping=Stopping(max_new_tokens=1000, ignore_eos=True)
)


@pytest.fixture(scope="module")
def long_context_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = TinyGptConfig(layers=2, hidden=128, heads=4, context_length=1100, seed=5)
    return create_tiny_gpt(tmp_path_factory.mktemp("models") / "long", config)


def start_process(model_dir: Path, *extra: str, into: list[ServeProcess]) -> ServeProcess:
    served = start_serve("--model", str(model_dir), "--metrics-port", "0", *extra)
    into.append(served)
    return served


async def wait_not_serving(port: int) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        watch = stub.Watch(health_pb2.HealthCheckRequest())
        async for update in watch:
            if update.status == health_pb2.HealthCheckResponse.NOT_SERVING:
                watch.cancel()
                return


async def drain_into(events: AsyncIterator[object], transcript: Transcript) -> None:
    async for event in events:
        transcript.add(event)  # type: ignore[arg-type]


async def start_long_generation(client: AsyncClient) -> tuple[AsyncIterator[object], Transcript, object]:
    stream = client.open_stream()
    await stream.submit("long", "A long answer", LONG)
    await stream.close_requests()
    events = stream.events()
    transcript = Transcript()
    await read_until(events, transcript, lambda t: len(t.tokens("long")) >= 1)
    return events, transcript, stream  # type: ignore[return-value]


async def test_sigterm_finishes_live_work_refuses_new_work_and_exits_zero(
    long_context_model: Path, serve_processes: list[ServeProcess]
) -> None:
    served = start_process(long_context_model, "--drain-timeout", "60", into=serve_processes)
    process, port = served.process, served.port
    async with AsyncClient(f"127.0.0.1:{port}", retries=False) as client:
        events, transcript, _stream = await start_long_generation(client)
        process.send_signal(signal.SIGTERM)
        await wait_not_serving(port)
        with pytest.raises(TokenwireError) as refused:
            await client.generate("new work", LONG)
        async for event in events:
            transcript.add(event)  # type: ignore[arg-type]
    assert refused.value.code is grpc.StatusCode.UNAVAILABLE
    assert refused.value.reason == "DRAINING"
    final = transcript.final("long")
    assert isinstance(final, Completed) and final.generation.completion_tokens == 1000
    assert len(transcript.tokens("long")) == 1000
    assert await asyncio.to_thread(process.wait, 30) == 0


async def test_drain_timeout_fails_what_is_left_with_unavailable_and_exits_zero(
    long_context_model: Path, serve_processes: list[ServeProcess]
) -> None:
    served = start_process(long_context_model, "--drain-timeout", "0.2", into=serve_processes)
    process, port = served.process, served.port
    async with AsyncClient(f"127.0.0.1:{port}", retries=False) as client:
        events, transcript, _stream = await start_long_generation(client)
        process.send_signal(signal.SIGTERM)
        async for event in events:
            transcript.add(event)  # type: ignore[arg-type]
    final = transcript.final("long")
    assert isinstance(final, Failed)
    assert final.error.code is grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
    assert len(transcript.tokens("long")) < 1000
    assert await asyncio.to_thread(process.wait, 30) == 0


async def test_second_signal_exits_at_once(
    long_context_model: Path, serve_processes: list[ServeProcess]
) -> None:
    served = start_process(long_context_model, "--drain-timeout", "60", into=serve_processes)
    process, port = served.process, served.port
    async with AsyncClient(f"127.0.0.1:{port}", retries=False) as client:
        events, transcript, _stream = await start_long_generation(client)
        process.send_signal(signal.SIGTERM)
        await wait_not_serving(port)
        process.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(process.wait, 10)
        with pytest.raises(TokenwireError):
            await drain_into(events, transcript)
    assert code == 128 + signal.SIGTERM
    assert not transcript.finished("long")

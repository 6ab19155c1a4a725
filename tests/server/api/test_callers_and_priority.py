"""Named callers and priorities on a real server with bearer tokens.

A step gate holds the engine's decode steps so the queue fills deterministically: nothing
finishes until the test lets it.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
from pathlib import Path

import grpc
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tests.conftest import tiny_settings
from tests.support.polling import wait_until
from tests.support.prometheus import scrape
from tests.support.servers import serving
from tests.support.stepping import StepGate
from tests.support.tiny_models import TinyModel
from tokenwire.client import (
    AsyncClient,
    Chunk,
    GenerateOptions,
    Generation,
    Priority,
    Stopping,
    TokenwireError,
)
from tokenwire.server.config import AuthSettings, TelemetrySettings
from tokenwire.server.security.auth import load_token_callers
from tokenwire.v1 import inference_service_pb2 as pb
from tokenwire.v1 import inference_service_pb2_grpc as pb_grpc

FLOOD_TOKEN = "flood-Qk2v-secret"
QUIET_TOKEN = "quiet-Zr8n-secret"
PLAIN_TOKEN = "plain-Hx4m-secret"
SHORT = GenerateOptions(stopping=Stopping(4, ignore_eos=True))


@pytest.fixture
def tokens_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokens"
    path.write_text(
        f"# callers\nflood {FLOOD_TOKEN} weight=1\n"
        f"quiet {QUIET_TOKEN} weight=3 max_queued=20\n{PLAIN_TOKEN}\n",
        encoding="utf-8",
    )
    return path


def auth(tokens_file: Path) -> AuthSettings:
    pairs = load_token_callers(tokens_file, {})
    return AuthSettings(tokens=tuple(t for t, _ in pairs), callers=tuple(c for _, c in pairs))


async def test_the_token_file_names_callers_in_logs_spans_and_metrics_and_no_token_appears(
    tiny_model_dir: Path, tokens_file: Path, every_log_line: io.StringIO
) -> None:
    spans = InMemorySpanExporter()
    settings = tiny_settings(
        tiny_model_dir, auth=auth(tokens_file), telemetry=TelemetrySettings(metrics_port=0)
    )
    async with serving(settings, span_exporter=spans) as server:
        for token in (FLOOD_TOKEN, QUIET_TOKEN, PLAIN_TOKEN):
            async with AsyncClient(f"127.0.0.1:{server.port}", token=token, retries=False) as client:
                await client.generate("Hi", SHORT)
        assert server.metrics_port
        metrics = await scrape(server.metrics_port)
    access = [
        json.loads(line) for line in every_log_line.getvalue().splitlines() if "tokenwire.access" in line
    ]
    plain_name = "token-" + hashlib.sha256(PLAIN_TOKEN.encode()).hexdigest()[:8]
    assert sorted(entry["caller"] for entry in access) == sorted(["flood", "quiet", plain_name])
    requests = [s for s in spans.get_finished_spans() if s.attributes and "rpc.method" in s.attributes]
    span_callers = sorted(str(span.attributes["tokenwire.caller"]) for span in requests if span.attributes)
    assert span_callers == sorted(["flood", "quiet", plain_name])
    for name in ("flood", "quiet", plain_name):
        assert (
            metrics.value(
                "tokenwire_server_requests_total", gen_ai_request_model="tiny", outcome="ok", caller=name
            )
            == 1
        )
    everything = (
        every_log_line.getvalue() + metrics.text + repr([s.attributes for s in spans.get_finished_spans()])
    )
    for token in (FLOOD_TOKEN, QUIET_TOKEN, PLAIN_TOKEN):
        assert token not in everything


async def test_a_flooding_caller_is_refused_over_its_share_while_another_caller_still_gets_in(
    tiny_model_dir: Path, tokens_file: Path
) -> None:
    gate = StepGate()
    settings = tiny_settings(tiny_model_dir, auth=auth(tokens_file), max_batch_size=2, max_queue_size=8)
    async with serving(settings, gate=gate) as server:
        engine = server.registry.default.engine
        target = f"127.0.0.1:{server.port}"
        async with (
            AsyncClient(target, token=FLOOD_TOKEN, retries=False) as flood,
            AsyncClient(target, token=QUIET_TOKEN, retries=False) as quiet,
        ):
            flooding = [asyncio.ensure_future(flood.generate("Hi", SHORT)) for _ in range(10)]
            await wait_until(lambda: engine.live_count == 10, what="the flood to fill slots and queue")
            with pytest.raises(TokenwireError) as full:
                await flood.generate("Hi", SHORT)
            assert full.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED and full.value.reason == "QUEUE_FULL"

            quiet_ones = [asyncio.ensure_future(quiet.generate("Hi", SHORT)) for _ in range(3)]
            await wait_until(lambda: engine.live_count == 13, what="the quiet caller's requests to queue")
            with pytest.raises(TokenwireError) as over:
                await flood.generate("Hi", SHORT)
            assert over.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert over.value.reason == "CALLER_OVER_SHARE"
            assert over.value.retry_after is not None and over.value.retry_after > 0
            gate.open()
            results: list[Generation] = await asyncio.gather(*flooding, *quiet_ones)
    assert all(r.completion_tokens == 4 for r in results)


async def test_a_caller_holding_every_slot_gives_one_up_to_another_and_its_swapped_stream_loses_nothing(
    each_runner: TinyModel, tokens_file: Path
) -> None:
    gate = StepGate()
    settings = tiny_settings(
        each_runner.path,
        auth=auth(tokens_file),
        max_batch_size=2,
        telemetry=TelemetrySettings(metrics_port=0),
        kv_cache=each_runner.kv_cache,
    )
    long = GenerateOptions(stopping=Stopping(24, ignore_eos=True))
    prompts = ["Once upon a time", "The quick brown fox"]
    async with serving(settings, gate=gate) as server:
        engine = server.registry.default.engine
        target = f"127.0.0.1:{server.port}"
        async with (
            AsyncClient(target, token=FLOOD_TOKEN, retries=False) as flood,
            AsyncClient(target, token=QUIET_TOKEN, retries=False) as quiet,
        ):
            gate.open()
            alone = [(await flood.generate(p, long)).token_ids for p in prompts]
            gate.close()

            streams = [flood.stream(p, long) for p in prompts]
            streamed: list[list[int]] = [[], []]

            async def read(index: int) -> None:
                async for event in streams[index]:
                    if isinstance(event, Chunk):
                        streamed[index].extend(event.token_ids)

            # One at a time, so both hold a slot and decode (first tokens out, steps at the gate):
            # the first's decode step holds the engine until the gate lets one step through.
            reading = [asyncio.ensure_future(read(0))]
            await wait_until(lambda: bool(streamed[0]), what="the first flood stream to start")
            reading.append(asyncio.ensure_future(read(1)))
            await wait_until(lambda: engine.queue_depth == 1, what="the second flood stream to queue")
            gate.allow(1)
            await wait_until(lambda: bool(streamed[1]), what="the second flood stream to start")
            asking = asyncio.ensure_future(quiet.generate("Hi", SHORT))
            await wait_until(lambda: engine.queue_depth == 1, what="the quiet request to queue")
            gate.allow(1)  # the step in progress ends; the next round swaps one flood stream out
            await wait_until(lambda: engine.stats.preemptions == 1, what="a flood stream to be swapped out")
            gate.open()
            answer = await asking
            await asyncio.gather(*reading)
        body = await scrape(server.metrics_port)
    assert answer.completion_tokens == 4
    assert engine.stats.resumptions == 1
    # Swapped out and back in, each stream still has every token once, the ones it had alone.
    assert [tuple(tokens) for tokens in streamed] == alone
    assert body.value("tokenwire_engine_preemptions_total", caller="flood", gen_ai_request_model="tiny") == 1


async def test_priority_is_accepted_and_an_unknown_value_is_invalid_argument(tiny_model_dir: Path) -> None:
    async with serving(tiny_settings(tiny_model_dir)) as server:
        async with AsyncClient(f"127.0.0.1:{server.port}", retries=False) as client:
            for priority in Priority:
                options = GenerateOptions(stopping=Stopping(2, ignore_eos=True), priority=priority)
                assert (await client.generate("Hi", options)).completion_tokens == 2
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.InferenceServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Generate(pb.GenerateRequest(prompt="Hi", priority=9))  # type: ignore[arg-type]
    error = TokenwireError.from_rpc_error(refused.value)
    assert error.code is grpc.StatusCode.INVALID_ARGUMENT
    assert [v.field for v in error.field_violations] == ["priority"]

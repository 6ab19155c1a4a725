"""Every request writes exactly one access-log line and one span, however it ends.

Each test ends requests one way on a real server (finished; cancelled unary call; StreamGenerate
call cancelled; `cancel` message; client process killed; deadline; drain refusal; refusals;
output left unread), then stops the server, so that anything still owed is written, and counts
the lines and root spans per request: none or two fail the test. Decode steps are held by a step
gate where a request must still be generating when its call ends.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tests.conftest import tiny_settings
from tests.reliability.stream_client import ClientProcess
from tests.support.options import greedy
from tests.support.polling import wait_until
from tests.support.prometheus import Scrape, scrape
from tests.support.servers import serving
from tests.support.stepping import StepGate
from tokenwire.client import AsyncClient, Chunk, Completed, Failed, TokenwireError
from tokenwire.server.api.stream_limits import MIB, StreamLimits
from tokenwire.server.app import TokenwireServer
from tokenwire.server.telemetry.access_log import ACCESS_LOGGER
from tokenwire.server.telemetry.logs import JsonFormatter
from tokenwire.server.telemetry.settings import TelemetrySettings
from tokenwire.v1 import inference_service_pb2 as pb
from tokenwire.v1 import inference_service_pb2_grpc as pb_grpc

LONG = greedy(200)
"""Far more tokens than any test lets the gate through: the request is still generating."""


@dataclass
class Records:
    """What the server wrote: access-log lines (JSON) and finished spans."""

    lines: io.StringIO
    spans: InMemorySpanExporter

    def entries(self) -> list[dict[str, object]]:
        return [json.loads(line) for line in self.lines.getvalue().splitlines()]

    def lines_of(self, request_id: str) -> list[dict[str, object]]:
        return [entry for entry in self.entries() if entry["request_id"] == request_id]

    def one(self, request_id: str) -> dict[str, object]:
        """The request's only line; fails unless it wrote exactly one line and one root span that
        agree on the outcome."""
        lines = self.lines_of(request_id)
        roots = [
            span
            for span in self.spans.get_finished_spans()
            if span.parent is None and (span.attributes or {}).get("tokenwire.request_id") == request_id
        ]
        assert len(lines) == 1, f"{request_id}: {len(lines)} access-log lines: {lines}"
        assert len(roots) == 1, f"{request_id}: {len(roots)} spans"
        assert (roots[0].attributes or {})["tokenwire.outcome"] == lines[0]["outcome"]
        return lines[0]


@pytest.fixture
def records() -> Iterator[Records]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger(ACCESS_LOGGER)
    previous = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield Records(stream, InMemorySpanExporter())
    logger.removeHandler(handler)
    logger.setLevel(previous)


@pytest.fixture
def gate() -> StepGate:
    return StepGate()


@asynccontextmanager
async def recorded_server(
    model_dir: Path, records: Records, gate: StepGate | None = None, **overrides: object
) -> AsyncIterator[tuple[TokenwireServer, AsyncClient]]:
    async with (
        serving(tiny_settings(model_dir, **overrides), gate=gate, span_exporter=records.spans) as server,
        AsyncClient(f"127.0.0.1:{server.port}", retries=False) as client,
    ):
        yield server, client


async def test_finished_requests_write_one_line_each(tiny_model_dir: Path, records: Records) -> None:
    async with recorded_server(tiny_model_dir, records) as (_, client):
        await client.generate("Hello", greedy(4), request_id="unary-done")
        await client.generate("Hello", greedy(4))  # an id made up by the server
        async with client.open_stream() as stream:
            await stream.submit("stream-done", "Hello", greedy(4))
            await stream.close_requests()
            assert isinstance([event async for event in stream.events()][-1], Completed)

    assert records.one("unary-done")["outcome"] == "ok"
    assert records.one("stream-done")["outcome"] == "ok"
    made_up = [entry for entry in records.entries() if str(entry["request_id"]).startswith("gen-")]
    assert len(made_up) == 1 and records.one(str(made_up[0]["request_id"]))["outcome"] == "ok"


@pytest.mark.parametrize("request_id", ["unary-cancelled", ""], ids=["own-id", "no-id"])
async def test_a_unary_call_cancelled_mid_generation_writes_one_cancelled_line(
    tiny_model_dir: Path, records: Records, gate: StepGate, request_id: str
) -> None:
    async with recorded_server(tiny_model_dir, records, gate) as (server, client):
        engine = server.registry.default.engine
        call = asyncio.create_task(client.generate("Cancel me", LONG, request_id=request_id))
        gate.allow(2)
        await wait_until(lambda: engine.stats.decode_steps == 2, what="two decode steps")
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        await wait_until(lambda: engine.stats.abort_requests == 1, what="the server to hear the cancel")
        gate.open()
        await wait_until(lambda: engine.live_count == 0, what="the generation to stop")

    generate_lines = [entry for entry in records.entries() if entry["method"] == "Generate"]
    assert len(generate_lines) == 1, generate_lines
    line = records.one(str(generate_lines[0]["request_id"]))
    assert line["outcome"] == "cancelled" and line["finish_reason"] == "cancelled"
    assert line["code"] == "OK"
    assert float(str(line["total_ms"])) > 0


async def test_a_stream_call_cancelled_after_three_chunks_writes_one_cancelled_line_per_generation(
    tiny_model_dir: Path, records: Records, gate: StepGate
) -> None:
    async with recorded_server(tiny_model_dir, records, gate) as (server, client):
        engine = server.registry.default.engine
        stream = client.open_stream()
        await stream.submit("reading", "Cancel the call", LONG)
        await stream.submit("also-running", "Also on the call", LONG)
        gate.allow(2)
        tokens = 0
        async for event in stream.events():
            if isinstance(event, Chunk) and event.request_id == "reading":
                tokens += len(event.token_ids)
                if tokens == 3:  # the prompt pass's token and the two decode steps' tokens
                    break
        stream.cancel_all()
        await wait_until(lambda: engine.stats.abort_requests == 2, what="the server to hear the cancel")
        gate.open()
        await wait_until(lambda: engine.live_count == 0, what="the call's generations to stop")

    for request_id in ("reading", "also-running"):
        line = records.one(request_id)
        assert line["outcome"] == "cancelled", line
        assert line["method"] == "StreamGenerate"
    assert 3 <= int(str(records.one("reading")["completion_tokens"])) < 200


async def test_a_cancel_message_writes_one_cancelled_line_and_the_rest_of_the_stream_goes_on(
    tiny_model_dir: Path, records: Records, gate: StepGate
) -> None:
    async with recorded_server(tiny_model_dir, records, gate) as (_, client):
        async with client.open_stream() as stream:
            await stream.submit("to-cancel", "Cancel me", LONG)
            await stream.submit("to-finish", "Finish me", greedy(3))
            events = stream.events()
            async for event in events:
                if isinstance(event, Chunk) and event.request_id == "to-cancel":
                    break
            await stream.cancel("to-cancel")
            await stream.close_requests()
            gate.open()
            finals = [event async for event in events if isinstance(event, Completed)]
        assert {event.request_id for event in finals} == {"to-cancel", "to-finish"}

    assert records.one("to-cancel")["outcome"] == "cancelled"
    assert records.one("to-finish")["outcome"] == "ok"


async def test_a_killed_client_process_writes_one_cancelled_line_per_generation(
    tiny_model_dir: Path, records: Records, gate: StepGate
) -> None:
    async with recorded_server(tiny_model_dir, records, gate, max_batch_size=2) as (server, _):
        engine = server.registry.default.engine
        client = ClientProcess(server.port, generations=3, max_new_tokens=200)
        try:
            # g0 is running (its first token comes from the prompt pass, before the held decode
            # step); g1 and g2 are in the engine, waiting for the step to end.
            await wait_until(lambda: client.seen("g0", "Chunk"), timeout=60, what="the client's first token")
            await wait_until(lambda: engine.live_count == 3, what="all three generations in the engine")
        finally:
            client.kill()
        await wait_until(lambda: engine.stats.abort_requests == 3, timeout=30, what="the server to notice")
        gate.open()
        await wait_until(lambda: engine.live_count == 0, what="the generations to stop")

    for request_id in ("g0", "g1", "g2"):
        assert records.one(request_id)["outcome"] == "cancelled"


async def test_deadlines_write_one_deadline_line_each(
    tiny_model_dir: Path, records: Records, gate: StepGate
) -> None:
    async with recorded_server(tiny_model_dir, records, gate) as (server, client):
        engine = server.registry.default.engine
        # The gate holds every decode step until each deadline has passed: every request is
        # still generating (or queued) when its deadline ends it.
        stream = client.open_stream()
        await stream.submit("stream-deadline", "Too slow", greedy(200, timeout=0.5))
        with pytest.raises(TokenwireError) as unary:
            await client.generate("Too slow", LONG, request_id="unary-deadline", deadline=0.5)
        assert unary.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
        with pytest.raises(TokenwireError) as anonymous:
            await client.generate("Too slow", LONG, deadline=0.5)
        assert anonymous.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
        gate.open()
        await stream.close_requests()
        last = [event async for event in stream.events()][-1]
        assert isinstance(last, Failed) and isinstance(last.error, TokenwireError)
        assert last.error.code is grpc.StatusCode.DEADLINE_EXCEEDED
        await wait_until(lambda: engine.live_count == 0, what="the generations to stop")

    assert records.one("unary-deadline")["outcome"] == "deadline"
    assert records.one("stream-deadline")["outcome"] == "deadline"
    generate_lines = [entry for entry in records.entries() if entry["method"] == "Generate"]
    assert [entry["outcome"] for entry in generate_lines] == ["deadline", "deadline"]
    made_up = next(entry for entry in generate_lines if entry["request_id"] != "unary-deadline")
    records.one(str(made_up["request_id"]))


async def test_drain_refusals_write_one_rejected_line_each(tiny_model_dir: Path, records: Records) -> None:
    async with recorded_server(tiny_model_dir, records) as (server, client):
        await server.drain(timeout=5)
        with pytest.raises(TokenwireError):
            await client.generate("Too late", greedy(4), request_id="unary-draining")
        async with client.open_stream() as stream:
            await stream.submit("stream-draining", "Too late", greedy(4))
            await stream.close_requests()
            assert len([event async for event in stream.events()]) == 1

    for request_id in ("unary-draining", "stream-draining"):
        line = records.one(request_id)
        assert line["outcome"] == "rejected" and line["reason"] == "DRAINING", line


async def test_refused_requests_write_one_line_each(
    tiny_model_dir: Path, records: Records, gate: StepGate
) -> None:
    async with recorded_server(tiny_model_dir, records, gate, max_batch_size=1, max_queue_size=1) as (
        server,
        client,
    ):
        engine = server.registry.default.engine
        with pytest.raises(TokenwireError):
            await client.generate("", greedy(4), request_id="empty-prompt")
        # One call holds the only slot and another the only queue place (a call's own queue
        # share is the server's queue size, so the two need calls of their own).
        async with client.open_stream() as stream, client.open_stream() as behind:
            # "running" must hold the slot (its decode step held at the gate) before "waiting" is
            # sent, and before its id is sent again: only then is the second "running" a live
            # duplicate, not a second request of its stream queued.
            await stream.submit("running", "Hold the slot", LONG)
            await wait_until(lambda: gate.waiting == 1, what="the first generation to hold the slot")
            await behind.submit("waiting", "Hold the queue", greedy(4))
            await wait_until(lambda: engine.live_count == 2, what="a full slot and queue")
            with pytest.raises(TokenwireError) as full:
                await client.generate("No room", greedy(4), request_id="queue-full")
            assert full.value.reason == "QUEUE_FULL"
            await stream.submit("running", "The same id again", greedy(4))
            # A second request waiting on one call passes that call's own queue limit.
            await behind.submit("behind-too", "Over the call's queue limit", greedy(4))
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                raw = pb_grpc.InferenceServiceStub(channel).StreamGenerate()
                await raw.write(pb.StreamGenerateRequest())  # neither generate nor cancel
                await raw.done_writing()
                assert [message.request_id async for message in raw] == [""]
            await stream.close_requests()
            await behind.close_requests()
            gate.open()
            for call in (stream, behind):
                assert isinstance([event async for event in call.events()][-1], Completed)

    assert records.one("empty-prompt")["outcome"] == "invalid"
    assert records.one("queue-full")["outcome"] == "rejected"
    assert records.one("queue-full")["reason"] == "QUEUE_FULL"
    assert records.one("waiting")["outcome"] == "ok"
    # The duplicate id is refused with its own line; the running generation keeps its own.
    running = records.lines_of("running")
    assert sorted(str(entry["outcome"]) for entry in running) == ["invalid", "ok"]
    over_call_limit = records.one("behind-too")
    assert (over_call_limit["outcome"], over_call_limit["reason"]) == ("rejected", "STREAM_QUEUE_LIMIT")
    unnamed = records.lines_of("")
    assert len(unnamed) == 1 and unnamed[0]["outcome"] == "invalid"


def endless_stream_request(request_id: str) -> pb.GenerateRequest:
    """A generation with plenty of output per token (20 alternatives each), far past any test's
    steps."""
    return pb.GenerateRequest(
        request_id=request_id,
        prompt="Write forever",
        stopping=pb.StoppingCriteria(max_new_tokens=240, ignore_eos=True),
        logprobs=True,
        top_logprobs=20,
    )


def unread_channel(port: int) -> grpc.aio.Channel:
    # Without BDP probing and with a small lookahead, the client's receive window stays small, so
    # output it does not read stays in the server, as on a real network.
    return grpc.aio.insecure_channel(
        f"127.0.0.1:{port}", options=[("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]
    )


async def test_generations_stopped_for_output_left_unread_write_one_stopped_line_each(
    tiny_model_dir: Path, records: Records, gate: StepGate
) -> None:
    telemetry = TelemetrySettings(metrics_port=0, metrics_cache_seconds=0)
    # The byte bound is far away: only the unread-output timeout stops these generations.
    limits = StreamLimits(unread_output_timeout=0.2, max_unsent_bytes_per_stream=64 * MIB)
    async with recorded_server(tiny_model_dir, records, gate, stream=limits, telemetry=telemetry) as (
        server,
        _,
    ):
        engine = server.registry.default.engine
        async with unread_channel(server.port) as channel:
            call = pb_grpc.InferenceServiceStub(channel).StreamGenerate()
            for name in ("unread-0", "unread-1"):
                await call.write(pb.StreamGenerateRequest(generate=endless_stream_request(name)))
            gate.allow(150)
            await wait_until(lambda: engine.stats.abort_requests == 2, timeout=30, what="both to be stopped")
            gate.open()
            await wait_until(lambda: engine.live_count == 0, what="the stopped generations to leave")
            call.cancel()
        assert server.metrics_port
        # The engine has let go of them; each call's record ends on the event loop after it
        # hears its generation's end, so the count is read once both records are in.
        by_outcome: dict[str, float] = {}
        for _ in range(500):
            by_outcome = outcomes(await scrape(server.metrics_port))
            if sum(by_outcome.values()) >= 2:
                break
            await asyncio.sleep(0.02)

    for request_id in ("unread-0", "unread-1"):
        line = records.one(request_id)
        assert (line["outcome"], line["code"], line["reason"]) == (
            "stopped",
            "RESOURCE_EXHAUSTED",
            "STREAM_OUTPUT_UNREAD",
        ), line
        assert 0 < int(str(line["completion_tokens"])) < 240
    # They are counted as they are recorded: stopped, not cancelled.
    assert by_outcome == {"stopped": 2}, by_outcome


def outcomes(metrics: Scrape) -> dict[str, float]:
    """tokenwire_server_requests_total by outcome (outcomes never counted are left out)."""
    by_outcome: dict[str, float] = {}
    for (name, labels), value in metrics.samples.items():
        if name == "tokenwire_server_requests_total" and value:
            outcome = dict(labels)["outcome"]
            by_outcome[outcome] = by_outcome.get(outcome, 0.0) + value
    return by_outcome


@pytest.mark.parametrize("method", ["StreamGenerate", "GenerateStream"])
async def test_a_generation_stopped_for_its_call_s_backlog_writes_one_stopped_line(
    tiny_model_dir: Path, records: Records, method: str
) -> None:
    limits = StreamLimits(max_unsent_bytes_per_stream=2048, unread_output_timeout=0)
    async with recorded_server(tiny_model_dir, records, stream=limits, max_batch_size=1) as (server, _):
        engine = server.registry.default.engine
        async with unread_channel(server.port) as channel:
            stub = pb_grpc.InferenceServiceStub(channel)
            request = endless_stream_request("backlogged")
            if method == "StreamGenerate":
                call: grpc.aio.StreamStreamCall | grpc.aio.UnaryStreamCall = stub.StreamGenerate(
                    iter([pb.StreamGenerateRequest(generate=request)])
                )
            else:
                call = stub.GenerateStream(request)
            assert (await call.read()).HasField("queued")  # type: ignore[attr-defined]
            assert await engine.wait_idle(60)

            async def read_to_the_end() -> None:
                while await call.read() is not grpc.aio.EOF:  # type: ignore[attr-defined]
                    pass

            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await read_to_the_end()
        assert raised.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED

    line = records.one("backlogged")
    assert (line["method"], line["outcome"], line["reason"]) == (method, "stopped", "STREAM_BACKLOG"), line

"""One span per request, with queue, prefill and decode children timed like the response says."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import grpc
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from tests.conftest import tiny_settings
from tests.support.servers import serving
from tokenwire.server.app import TokenwireServer
from tokenwire.v1 import inference_service_pb2 as pb
from tokenwire.v1 import inference_service_pb2_grpc as pb_grpc

CALLER_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = (("traceparent", f"00-{CALLER_TRACE_ID}-{CALLER_SPAN_ID}-01"),)


def request(request_id: str = "", max_new_tokens: int = 6, **fields: object) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id,
        prompt="Tell me a story",
        sampling=pb.SamplingParams(temperature=0.0, seed=7),
        stopping=pb.StoppingCriteria(max_new_tokens=max_new_tokens, ignore_eos=True),
        **fields,  # type: ignore[arg-type]
    )


@pytest.fixture
def spans() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
async def traced(tiny_model_dir: Path, spans: InMemorySpanExporter) -> AsyncIterator[TokenwireServer]:
    async with serving(tiny_settings(tiny_model_dir), span_exporter=spans) as server:
        yield server


async def call_generate(
    server: TokenwireServer, message: pb.GenerateRequest, metadata: Sequence[tuple[str, str]] = ()
) -> pb.GenerateResponse:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        response: pb.GenerateResponse = await pb_grpc.InferenceServiceStub(channel).Generate(
            message, metadata=tuple(metadata)
        )
    return response


def seconds(duration: object) -> float:
    return duration.seconds + duration.nanos / 1e9  # type: ignore[attr-defined,no-any-return]


def span_seconds(span: ReadableSpan) -> float:
    assert span.start_time is not None and span.end_time is not None
    return (span.end_time - span.start_time) / 1e9


def children_of(root: ReadableSpan, finished: Sequence[ReadableSpan]) -> dict[str, ReadableSpan]:
    return {s.name: s for s in finished if s.parent is not None and s.parent.span_id == root.context.span_id}


async def test_a_generation_continues_the_callers_trace_with_timed_stage_spans(
    traced: TokenwireServer, spans: InMemorySpanExporter
) -> None:
    response = await call_generate(traced, request("story-1"), TRACEPARENT)

    finished = spans.get_finished_spans()
    roots = [s for s in finished if s.kind is SpanKind.SERVER]
    assert len(roots) == 1
    root = roots[0]
    assert root.name == "text_completion tiny"
    assert format(root.context.trace_id, "032x") == CALLER_TRACE_ID
    assert root.parent is not None and format(root.parent.span_id, "016x") == CALLER_SPAN_ID
    attributes = dict(root.attributes or {})
    assert attributes["tokenwire.request_id"] == "story-1"
    assert attributes["gen_ai.request.model"] == "tiny"
    assert attributes["gen_ai.response.model"] == "tiny"
    assert attributes["gen_ai.operation.name"] == "text_completion"
    assert attributes["gen_ai.usage.input_tokens"] == response.usage.prompt_tokens
    assert attributes["gen_ai.usage.output_tokens"] == response.usage.completion_tokens == 6
    assert attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert attributes["gen_ai.request.max_tokens"] == 6
    assert attributes["gen_ai.request.seed"] == 7
    assert attributes["tokenwire.outcome"] == "ok"
    assert root.status.status_code is StatusCode.UNSET

    stages = children_of(root, finished)
    assert set(stages) == {"queue", "prefill", "decode"}
    timing = response.timing
    assert span_seconds(root) == pytest.approx(seconds(timing.total), abs=2e-9)
    assert span_seconds(stages["queue"]) == pytest.approx(seconds(timing.queued), abs=2e-9)
    # The prefill stage spans the prompt's own work and any time it waited on other requests.
    prompt_stage = seconds(timing.prefill) + seconds(timing.paced)
    assert span_seconds(stages["prefill"]) == pytest.approx(prompt_stage, abs=3e-9)
    assert stages["prefill"].attributes["tokenwire.prefill.paced_seconds"] == pytest.approx(
        seconds(timing.paced), abs=2e-9
    )
    decode = seconds(timing.total) - seconds(timing.time_to_first_token)
    assert span_seconds(stages["decode"]) == pytest.approx(decode, abs=2e-9)
    # The stages tile the request: each begins where the previous one ended.
    assert root.start_time == stages["queue"].start_time
    assert stages["queue"].end_time == stages["prefill"].start_time
    assert stages["prefill"].end_time == stages["decode"].start_time
    assert stages["decode"].end_time == root.end_time
    assert all(s.context.trace_id == root.context.trace_id for s in stages.values())


async def test_without_a_traceparent_each_request_starts_its_own_trace(
    traced: TokenwireServer, spans: InMemorySpanExporter
) -> None:
    await call_generate(traced, request())
    await call_generate(traced, request())
    roots = [s for s in spans.get_finished_spans() if s.kind is SpanKind.SERVER]
    assert len(roots) == 2
    assert all(root.parent is None for root in roots)
    assert roots[0].context.trace_id != roots[1].context.trace_id
    # Generated request ids are recorded too.
    assert all(str((r.attributes or {})["tokenwire.request_id"]).startswith("gen-") for r in roots)


async def test_each_generation_on_a_stream_gets_its_own_span_in_the_streams_trace(
    traced: TokenwireServer, spans: InMemorySpanExporter
) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{traced.port}") as channel:
        call = pb_grpc.InferenceServiceStub(channel).StreamGenerate(metadata=TRACEPARENT)
        chat = pb.GenerateRequest(
            request_id="chat-1",
            messages=[pb.ChatMessage(role="user", content="Hello")],
            stopping=pb.StoppingCriteria(max_new_tokens=3, ignore_eos=True),
        )
        await call.write(pb.StreamGenerateRequest(generate=request("plain-1", max_new_tokens=4)))
        await call.write(pb.StreamGenerateRequest(generate=chat))
        await call.done_writing()
        completed = {m.request_id: m.completed async for m in call if m.HasField("completed")}

    roots = {
        (s.attributes or {})["tokenwire.request_id"]: s
        for s in spans.get_finished_spans()
        if s.kind is SpanKind.SERVER
    }
    assert set(roots) == set(completed) == {"plain-1", "chat-1"}
    assert roots["chat-1"].name == "chat tiny"
    for request_id, root in roots.items():
        assert format(root.context.trace_id, "032x") == CALLER_TRACE_ID
        assert (root.attributes or {})["rpc.method"] == "StreamGenerate"
        assert (root.attributes or {})["gen_ai.usage.output_tokens"] == completed[
            request_id
        ].usage.completion_tokens
        assert span_seconds(root) == pytest.approx(seconds(completed[request_id].timing.total), abs=2e-9)


async def test_a_refused_request_gets_an_error_span_without_stages(
    traced: TokenwireServer, spans: InMemorySpanExporter
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await call_generate(traced, request("bad-1", max_new_tokens=0, top_logprobs=99), TRACEPARENT)
    assert raised.value.code() is grpc.StatusCode.INVALID_ARGUMENT

    finished = spans.get_finished_spans()
    assert len(finished) == 1
    root = finished[0]
    attributes = dict(root.attributes or {})
    assert root.status.status_code is StatusCode.ERROR
    assert attributes["error.type"] == "INVALID_ARGUMENT"
    assert attributes["tokenwire.outcome"] == "invalid"
    assert attributes["tokenwire.request_id"] == "bad-1"
    assert format(root.context.trace_id, "032x") == CALLER_TRACE_ID


async def test_tracing_is_off_without_an_exporter(tiny_model_dir: Path) -> None:
    async with serving(tiny_settings(tiny_model_dir)) as server:
        assert server.telemetry.requests.tracer is None


async def test_a_request_for_n_completions_counts_them_in_its_span(
    traced: TokenwireServer, spans: InMemorySpanExporter
) -> None:
    response = await call_generate(traced, request("three", max_new_tokens=6, n=3))
    assert len(response.choices) == 3

    (root,) = [s for s in spans.get_finished_spans() if s.kind is SpanKind.SERVER]
    attributes = root.attributes or {}
    assert attributes["gen_ai.request.choice.count"] == 3
    assert attributes["gen_ai.usage.output_tokens"] == response.usage.completion_tokens == 18
    decode = children_of(root, spans.get_finished_spans())["decode"]
    # Each completion's first token came from the one prefill; the other five of each were decoded.
    assert (decode.attributes or {})["tokenwire.decode.tokens"] == 15

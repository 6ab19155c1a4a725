"""SIGTERM to a real process: /metrics stays up through the drain, and the last spans and metrics
reach the OTLP collector before the process exits; then the metrics port is closed."""

from __future__ import annotations

import asyncio
import signal
import urllib.error
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from tests.support.events import Transcript, read_until
from tests.support.prometheus import scrape, scrape_now
from tests.support.serve_process import ServeProcess, start_serve
from tokenwire.client import AsyncClient, Completed, GenerateOptions, Sampling, Stopping
from tokenwire.server.model_tools.tiny_gpt import TinyGptConfig, create_tiny_gpt

LONG = GenerateOptions(sampling=Sampling(temperature=0.0), stopping=Stopping(1000, ignore_eos=True))


class Collector(trace_service_pb2_grpc.TraceServiceServicer, metrics_service_pb2_grpc.MetricsServiceServicer):  # type: ignore[misc]
    """An OTLP/gRPC receiver that keeps what it is sent."""

    def __init__(self) -> None:
        self.spans: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self.metrics: list[metrics_service_pb2.ExportMetricsServiceRequest] = []

    async def Export(self, request: object, context: object) -> object:  # noqa: N802
        if isinstance(request, trace_service_pb2.ExportTraceServiceRequest):
            self.spans.append(request)
            return trace_service_pb2.ExportTraceServiceResponse()
        assert isinstance(request, metrics_service_pb2.ExportMetricsServiceRequest)
        self.metrics.append(request)
        return metrics_service_pb2.ExportMetricsServiceResponse()

    def span_attributes(self) -> list[dict[str, object]]:
        found = []
        for export in self.spans:
            for resource in export.resource_spans:
                for scope in resource.scope_spans:
                    for span in scope.spans:
                        values = {
                            a.key: getattr(a.value, a.value.WhichOneof("value")) for a in span.attributes
                        }
                        found.append({"name": span.name, **values})
        return found

    def metric_names(self) -> set[str]:
        return {
            metric.name
            for export in self.metrics
            for resource in export.resource_metrics
            for scope in resource.scope_metrics
            for metric in scope.metrics
        }


@pytest.fixture
async def collector() -> AsyncIterator[tuple[Collector, int]]:
    received = Collector()
    server = grpc.aio.server()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(received, server)
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(received, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield received, port
    await server.stop(0)


@pytest.fixture(scope="module")
def long_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = TinyGptConfig(layers=2, hidden=128, heads=4, context_length=1100, seed=5)
    return create_tiny_gpt(tmp_path_factory.mktemp("models") / "long", config)


def start_process(model: Path, collector_port: int) -> ServeProcess:
    """`tokenwire serve` exporting to the collector, with a Prometheus endpoint too."""
    return start_serve(
        "--model",
        f"tiny={model}",
        "--metrics-port",
        "0",
        "--otlp-endpoint",
        f"http://127.0.0.1:{collector_port}",
        "--otlp-metrics",
        "--drain-timeout",
        "60",
    )


async def test_drain_keeps_metrics_up_and_flushes_spans_and_metrics_before_exit(
    long_model: Path,
    collector: tuple[Collector, int],
    serve_processes: list[ServeProcess],
) -> None:
    received, collector_port = collector
    served = start_process(long_model, collector_port)
    serve_processes.append(served)
    process, port, metrics_port = served.process, served.port, served.metrics_port
    assert metrics_port, "the process did not announce its metrics endpoint"

    transcript = Transcript()
    async with (
        AsyncClient(f"127.0.0.1:{port}", retries=False) as client,
        client.open_stream() as stream,
        grpc.aio.insecure_channel(f"127.0.0.1:{port}") as health_channel,
    ):
        events = stream.events()
        await stream.submit("drained", "A long answer", LONG)
        await stream.close_requests()
        # The second token comes from a decode step, which the step counter saw before it was sent.
        await read_until(events, transcript, lambda t: len(t.tokens("drained")) >= 2)
        watch = health_pb2_grpc.HealthStub(health_channel).Watch(health_pb2.HealthCheckRequest())
        process.send_signal(signal.SIGTERM)
        async for update in watch:
            if update.status == health_pb2.HealthCheckResponse.NOT_SERVING:
                break
        during = await scrape(metrics_port)  # the generation is still running: the drain is on
        async for event in events:
            transcript.add(event)
    assert await asyncio.to_thread(process.wait, 30) == 0

    final = transcript.final("drained")
    assert isinstance(final, Completed) and final.generation.completion_tokens == 1000
    assert "tokenwire_server_requests_total" not in during.names()  # nothing had finished yet
    assert "tokenwire_engine_decode_steps_total" in during.names()
    spans = [s for s in received.span_attributes() if s.get("tokenwire.request_id") == "drained"]
    assert len(spans) == 1
    assert spans[0]["tokenwire.outcome"] == "ok"
    assert spans[0]["gen_ai.usage.output_tokens"] == 1000
    assert {"queue", "prefill", "decode"} <= {str(s["name"]) for s in received.span_attributes()}
    assert {"tokenwire.server.requests", "gen_ai.server.request.duration"} <= received.metric_names()
    with pytest.raises(urllib.error.URLError):
        scrape_now(metrics_port)

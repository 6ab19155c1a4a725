"""Where one server's telemetry goes: the Prometheus /metrics endpoint, OTLP, the access log.

Each server owns its providers (none is installed globally), so several servers in one process
keep separate numbers. With no metrics port, no OTLP endpoint and no test exporter, no
provider exists at all and requests pay only for the access log.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricExporter, MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from prometheus_client import CollectorRegistry

from tokenwire.server.telemetry.access_log import AccessLog
from tokenwire.server.telemetry.metrics import QueueSource, ServerMetrics
from tokenwire.server.telemetry.metrics_endpoint import (
    METRICS_PATH,
    MetricsEndpoint,
    RenderedPage,
    TokenCheck,
    tls_context,
)
from tokenwire.server.telemetry.requests import RequestTelemetry
from tokenwire.server.telemetry.settings import TelemetrySettings
from tokenwire.server.telemetry.tracing import RequestTracer

log = logging.getLogger(__name__)

INSTRUMENTATION_SCOPE = "tokenwire.server"
OTLP_EXPORTER_MODULE = "opentelemetry.exporter.otlp.proto.grpc"


def otlp_exporter_installed() -> bool:
    return importlib.util.find_spec(OTLP_EXPORTER_MODULE) is not None


@dataclass(frozen=True)
class MetricsTls:
    """The TLS files the metrics endpoint serves with (the gRPC port's)."""

    cert: str
    key: str
    client_ca: str | None = None


class Telemetry:
    """Build with the settings, start() with the server, shutdown() when it has stopped."""

    def __init__(
        self,
        settings: TelemetrySettings,
        *,
        metrics_address: str,
        engines: Callable[[], Sequence[QueueSource]],
        tokens: Sequence[str] = (),
        tls: MetricsTls | None = None,
        span_exporter: SpanExporter | None = None,
    ) -> None:
        """`tokens` and `tls` are the gRPC port's, for an endpoint that asks for them too."""
        self._settings = settings
        self._host = metrics_address
        self._tokens = tuple(tokens)
        self._tls = tls
        self._registry: CollectorRegistry | None = None
        self._endpoint: MetricsEndpoint | None = None
        self.metrics_page: RenderedPage | None = None
        self.metrics_port: int | None = None
        """The port /metrics is served on once started; None when there is no endpoint."""
        resource = Resource.create({"service.name": settings.service_name})

        readers: list[MetricReader] = []
        if settings.metrics_port is not None:
            self._registry = CollectorRegistry()
            readers.append(PrometheusMetricReader(scope_info_enabled=False, registry=self._registry))
        if settings.otlp_metrics and settings.otlp_endpoint:
            readers.append(PeriodicExportingMetricReader(_otlp_metric_exporter(settings.otlp_endpoint)))
        self._meter_provider = (
            MeterProvider(metric_readers=readers, resource=resource, shutdown_on_exit=False)
            if readers
            else None
        )
        self.metrics = (
            ServerMetrics(self._meter_provider.get_meter(INSTRUMENTATION_SCOPE), engines)
            if self._meter_provider is not None
            else None
        )

        processors: list[SpanProcessor] = []
        if span_exporter is not None:
            processors.append(SimpleSpanProcessor(span_exporter))
        if settings.otlp_endpoint:
            processors.append(BatchSpanProcessor(_otlp_span_exporter(settings.otlp_endpoint)))
        self._tracer_provider: TracerProvider | None = None
        tracer: RequestTracer | None = None
        if processors:
            self._tracer_provider = TracerProvider(resource=resource, shutdown_on_exit=False)
            for processor in processors:
                self._tracer_provider.add_span_processor(processor)
            tracer = RequestTracer(self._tracer_provider.get_tracer(INSTRUMENTATION_SCOPE))

        self.requests = RequestTelemetry(
            metrics=self.metrics, tracer=tracer, access_log=AccessLog() if settings.access_log else None
        )

    def start(self) -> None:
        """Open the /metrics endpoint. Raises OSError naming the setting if the port is taken."""
        port = self._settings.metrics_port
        if self._registry is None or port is None:
            return
        self.metrics_page = RenderedPage(self._registry, self._settings.metrics_cache_seconds)
        tokens = TokenCheck(self._tokens) if self._settings.metrics_auth else None
        tls = None
        if self._settings.metrics_tls:
            assert self._tls is not None, "--metrics-tls needs the gRPC port's TLS files"
            tls = tls_context(self._tls.cert, self._tls.key, self._tls.client_ca)
        try:
            endpoint = MetricsEndpoint(self.metrics_page, self._host, port, tokens=tokens, tls=tls)
        except OSError as error:
            raise OSError(
                f"--metrics-port: cannot listen on {self._host}:{port}: {error.strerror or error}"
            ) from error
        endpoint.start()
        self._endpoint = endpoint
        self.metrics_port = endpoint.port
        scheme = "https" if tls is not None else "http"
        log.info(
            "metrics on %s://%s:%d%s%s",
            scheme,
            self._host,
            self.metrics_port,
            METRICS_PATH,
            " (bearer token required)" if tokens is not None else "",
        )

    def shutdown(self) -> None:
        """Close the endpoint and flush every exporter; blocking (call it off the event loop)."""
        if self._endpoint is not None:
            endpoint, self._endpoint = self._endpoint, None
            endpoint.stop()
        if self._meter_provider is not None:
            self._meter_provider.shutdown()
            self._meter_provider = None
        if self._tracer_provider is not None:
            self._tracer_provider.shutdown()
            self._tracer_provider = None


def _otlp_span_exporter(endpoint: str) -> SpanExporter:
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=endpoint)


def _otlp_metric_exporter(endpoint: str) -> MetricExporter:
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

    return OTLPMetricExporter(endpoint=endpoint)

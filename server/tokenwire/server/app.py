"""Assemble the gRPC server: services, models, engines, and the order things start and stop in."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from opentelemetry.sdk.trace.export import SpanExporter

from tokenwire.server.adapter_loading import RuntimeAdapters, load_adapters
from tokenwire.server.api import errors
from tokenwire.server.api.aborts import AbortsReleaseTheirFrames
from tokenwire.server.api.adapter_admin import (
    ADAPTER_ADMIN_SERVICE,
    AdapterAdminServicer,
    add_adapter_admin_service,
)
from tokenwire.server.api.admission import Admission
from tokenwire.server.api.chat import chat_prompts
from tokenwire.server.api.handlers import SERVICE_NAME, add_inference_service
from tokenwire.server.api.orca import ORCA_SERVICE, LoadReportTrailers, OrcaService, add_orca_service
from tokenwire.server.api.reflection import enable_reflection
from tokenwire.server.api.registry import AdapterCatalog, ModelRegistry, ServedModel
from tokenwire.server.api.request_ids import GenerationRegistry
from tokenwire.server.api.servicer import InferenceServicer
from tokenwire.server.api.stream import StreamCaps
from tokenwire.server.config import ServerSettings
from tokenwire.server.engine.engine import Engine
from tokenwire.server.engine.errors import GenerationError
from tokenwire.server.engine.format_cache import FormatCache
from tokenwire.server.engine.observer import EngineObserver
from tokenwire.server.engine.validation import RequestValidator
from tokenwire.server.health import HealthReporter, start_health_listener
from tokenwire.server.lifecycle import Lifecycle, ServingPhase
from tokenwire.server.load import LoadTracker
from tokenwire.server.metadata import Metadata
from tokenwire.server.models.loader import LoadedModel, LoadSettings, load_model
from tokenwire.server.models.session import SessionSettings
from tokenwire.server.models.warmup import warm_up
from tokenwire.server.observers import ObserverFanOut
from tokenwire.server.openai_api.app import OpenAIApp
from tokenwire.server.openai_api.listener import HttpListener
from tokenwire.server.sampling.constraint import FormatCompiler
from tokenwire.server.security import tls
from tokenwire.server.security.auth import BearerTokenInterceptor
from tokenwire.server.security.callers import CallerDirectory
from tokenwire.server.security.gateway_headers import GatewayHeaders
from tokenwire.server.telemetry.exporters import MetricsTls, Telemetry
from tokenwire.server.text.tools import ToolCallFormat

log = logging.getLogger(__name__)

LOAD_REPORTED_METHODS = frozenset(
    f"/{SERVICE_NAME}/{method}" for method in ("Generate", "StreamGenerate", "GenerateStream")
)

ModelWrapper = Callable[[LoadedModel], LoadedModel]
"""Hook applied to each loaded model before serving it (tests use it to inject faults)."""


class TokenwireServer:
    """A running tokenwire: call start(), then load(); drain() and stop() to shut down."""

    def __init__(
        self,
        settings: ServerSettings,
        *,
        observer: EngineObserver | None = None,
        wrap_model: ModelWrapper | None = None,
        span_exporter: SpanExporter | None = None,
    ) -> None:
        """`observer` hears the engines besides telemetry; `span_exporter` receives request spans."""
        self.settings = settings
        self.lifecycle = Lifecycle()
        self.registry = ModelRegistry()
        self.generations = GenerationRegistry(
            retention=settings.result_retention,
            max_bytes=settings.result_retention_mb * 2**20,
            clock=time.monotonic,
        )
        self._wrap_model = wrap_model
        self._server: grpc.aio.Server | None = None
        self._servicer: InferenceServicer | None = None
        self._health_server: grpc.aio.Server | None = None
        self.health_port: int | None = None
        """Port of the plaintext health listener once started; None without --health-port."""
        self._http: HttpListener | None = None
        self.http_port: int | None = None
        """Port of the OpenAI-compatible HTTP API once started; None without --http-port."""
        self.health = HealthReporter(health_aio.HealthServicer(), ("", SERVICE_NAME), settings.health)
        tls = settings.tls
        self.telemetry = Telemetry(
            settings.telemetry,
            metrics_address=settings.metrics_address,
            engines=self._engines,
            tokens=settings.auth.tokens,
            tls=None
            if tls.cert is None or tls.key is None
            else MetricsTls(
                str(tls.cert), str(tls.key), None if tls.client_ca is None else str(tls.client_ca)
            ),
            span_exporter=span_exporter,
        )
        self.callers = CallerDirectory(settings.auth.token_callers())
        self.admission = Admission(
            self.registry,
            self.lifecycle,
            self.telemetry.requests,
            self.callers,
            settings.limits,
            self.generations,
            GatewayHeaders(settings.gateway, (caller for _, caller in settings.auth.token_callers())),
        )
        """The one admission of both edges: the same callers, gateway headers, idempotency keys,
        limits and validation for a gRPC call and an HTTP request."""
        self.adapter_admin = RuntimeAdapters(self.registry)
        """LoRA adapters loaded and unloaded while serving, through either edge."""
        self.load_tracker = LoadTracker()
        watermarks = self.health if settings.health.queue_high_watermark is not None else None
        observers: list[EngineObserver | None] = [
            self.telemetry.metrics,
            watermarks,
            self.load_tracker,
            observer,
        ]
        self._observer = ObserverFanOut(o for o in observers if o is not None)
        self.port = 0

    @property
    def metrics_port(self) -> int | None:
        """The port of the /metrics endpoint once started; None when metrics are off."""
        return self.telemetry.metrics_port

    async def start(self) -> int:
        """Listen on the configured port (NOT_SERVING until load() finishes); return the port."""
        settings = self.settings
        self.telemetry.start()
        try:
            self.port = self._listen(settings)
        except BaseException:
            await asyncio.to_thread(self.telemetry.shutdown)
            raise
        self.health.bind(asyncio.get_running_loop())
        self.lifecycle.subscribe(self.health.phase_changed)
        assert self._server is not None
        await self._server.start()
        if settings.health.port is not None:
            try:
                self._health_server, self.health_port = await start_health_listener(
                    self.health.servicer, settings.host, settings.health.port
                )
            except BaseException:
                await self._server.stop(0)
                await asyncio.to_thread(self.telemetry.shutdown)
                raise
            log.info("grpc.health.v1 also on %s:%d (plaintext, no token)", settings.host, self.health_port)
        if settings.http.enabled:
            try:
                self.http_port = await self._start_http(settings)
            except BaseException:
                await self._server.stop(0)
                if self._health_server is not None:
                    await self._health_server.stop(0)
                await asyncio.to_thread(self.telemetry.shutdown)
                raise
            log.info(
                "OpenAI-compatible HTTP API on %s:%d (%s)",
                settings.host,
                self.http_port,
                "HTTPS" if settings.tls.enabled else "plaintext",
            )
        log.info(
            "listening on %s:%d (%s%s)",
            settings.host,
            self.port,
            "TLS" if settings.tls.enabled else "plaintext",
            ", bearer tokens required" if settings.auth.enabled else "",
        )
        return self.port

    async def _start_http(self, settings: ServerSettings) -> int:
        """The HTTP edge on the same registry, lifecycle, callers, limits and telemetry as gRPC."""
        tokens = (
            BearerTokenInterceptor(settings.auth.tokens, refuse=errors.abort)
            if settings.auth.enabled
            else None
        )
        app = OpenAIApp(
            self.registry,
            self.admission,
            self.telemetry.requests,
            self.callers,
            tokens=tokens,
            adapter_admin=self.adapter_admin,
            max_body_bytes=settings.max_receive_message_bytes,
            body_timeout=settings.http.body_timeout,
        )
        self._http = HttpListener(app, settings.http, settings.host, settings.tls)
        return await self._http.start()

    def _listen(self, settings: ServerSettings) -> int:
        # First, so it is outermost: every handler's abort, a refusal by the others included.
        interceptors: list[grpc.aio.ServerInterceptor] = [AbortsReleaseTheirFrames()]
        if settings.auth.enabled:
            interceptors.append(
                BearerTokenInterceptor(
                    settings.auth.tokens,
                    refuse=errors.abort,
                    protect_health=settings.auth.protect_health,
                    on_refused=self._refused_unauthenticated,
                )
            )
        interceptors.append(LoadReportTrailers(self.load_tracker, LOAD_REPORTED_METHODS))
        server = grpc.aio.server(options=server_options(settings), interceptors=interceptors)
        self._servicer = InferenceServicer(
            self.registry,
            self.admission,
            self.telemetry.requests,
            stream_caps=StreamCaps(
                generations=settings.stream.max_generations_per_stream,
                queued=settings.stream.queued_per_stream(settings.engine.max_queue_size),
                unsent_bytes=settings.stream.max_unsent_bytes_per_stream,
                unread_timeout=settings.stream.unread_output_timeout,
            ),
        )
        add_inference_service(self._servicer, server)
        add_adapter_admin_service(AdapterAdminServicer(self.adapter_admin, self.callers), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health.servicer, server)
        add_orca_service(
            OrcaService(self.load_tracker, min_interval=settings.load_report_min_interval), server
        )
        if settings.reflection:
            enable_reflection(
                server,
                (
                    SERVICE_NAME,
                    ADAPTER_ADMIN_SERVICE,
                    health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                    ORCA_SERVICE,
                ),
            )
        address = f"{settings.host}:{settings.port}"
        try:
            if settings.tls.enabled:
                port = server.add_secure_port(address, tls.server_credentials(settings.tls))
            else:
                port = server.add_insecure_port(address)
        except RuntimeError as error:  # gRPC reports a port it cannot bind this way
            raise OSError(f"--port: cannot listen on {address}: {error}") from error
        if port == 0:
            raise OSError(f"--port: cannot listen on {address}")
        self._server = server
        return int(port)

    async def load(self) -> None:
        """Load every model (in a worker thread), start the engines, then report SERVING."""
        settings = self.settings
        load_settings = LoadSettings(
            max_batch_size=settings.engine.max_batch_size,
            max_context_length=settings.max_context_length,
            session=SessionSettings(device=settings.device, intra_op_threads=settings.intra_op_threads),
            max_loras=settings.max_loras,
            max_lora_rank=settings.max_lora_rank,
            kv_cache=settings.kv_cache,
        )
        for source in settings.models:
            loaded = await asyncio.to_thread(load_model, source.path, load_settings, name=source.name)
            # The adapters go on the first model, before its warm-up and before any request.
            loras = settings.loras if source is settings.models[0] else ()
            catalog = AdapterCatalog(await asyncio.to_thread(load_adapters, loaded, loras))
            await asyncio.to_thread(warm_up, loaded.runner)
            if self._wrap_model is not None:
                loaded = self._wrap_model(loaded)
            # Building the format library's view of the vocabulary takes a second on a real one.
            compiler = await asyncio.to_thread(
                FormatCompiler,
                loaded.tokenizer.to_json(),
                vocab_size=loaded.info.vocab_size,
                eos_token_ids=loaded.info.eos_token_ids,
            )
            engine = Engine(
                loaded.runner,
                loaded.tokenizer,
                settings.engine,
                observer=self._observer,
                check_accepting=self.lifecycle.check_accepting,
                formats=FormatCache(compiler, settings.formats),
            )
            engine.start()
            chat = chat_prompts(
                loaded.chat_template,
                loaded.tokenizer,
                control_tokens_in_content=settings.limits.control_tokens_in_messages,
                context_length=loaded.info.context_length,
            )
            template = loaded.chat_template
            validator = RequestValidator(
                loaded.info,
                loaded.tokenizer,
                chat,
                settings.limits,
                ToolCallFormat.JSON if template is None else template.tool_format,
                adapters=catalog.names,
            )
            self.registry.add(ServedModel(loaded, engine, validator, catalog))
        self.lifecycle.enter(ServingPhase.SERVING)

    async def drain(self, timeout: float) -> bool:
        """Stop taking work and wait for live requests to finish; False if `timeout` passed first."""
        self.lifecycle.enter(ServingPhase.DRAINING)  # the engines ask it before every submit
        engines = [served.engine for served in self.registry.all()]
        results = await asyncio.gather(*(engine.wait_idle(timeout) for engine in engines))
        return all(results)

    async def stop(self, grace: float = 1.0) -> None:
        """Fail whatever is still live with UNAVAILABLE, stop the engines, close the server, then
        flush and close telemetry, so the spans and counts of the drain's last requests go out."""
        self.lifecycle.enter(ServingPhase.STOPPED)
        for served in self.registry.all():
            await served.engine.shutdown()
        if self._http is not None:
            await self._http.stop(grace)
            self._http = None
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None
        self.admission.close()
        if self._health_server is not None:
            await self._health_server.stop(0)
            self._health_server = None
        await asyncio.to_thread(self.telemetry.shutdown)

    def _engines(self) -> list[Engine]:
        return [served.engine for served in self.registry.all()]

    def _refused_unauthenticated(
        self, method: str, metadata: Metadata | None, error: GenerationError
    ) -> None:
        self.telemetry.requests.refuse_call(method.rsplit("/", 1)[-1], metadata, error)


def server_options(settings: ServerSettings) -> list[tuple[str, int]]:
    """gRPC core options: message size, streams per connection, keepalive enforcement, and the
    maximum connection age."""
    keepalive = settings.keepalive
    age: list[tuple[str, int]] = []
    if settings.max_connection_age > 0:
        age = [
            ("grpc.max_connection_age_ms", _milliseconds(settings.max_connection_age)),
            ("grpc.max_connection_age_grace_ms", _milliseconds(settings.max_connection_age_grace)),
        ]
    return [
        *age,
        ("grpc.max_receive_message_length", settings.max_receive_message_bytes),
        ("grpc.so_reuseport", 0),
        ("grpc.max_concurrent_streams", settings.max_concurrent_streams),
        ("grpc.keepalive_time_ms", _milliseconds(keepalive.time)),
        ("grpc.keepalive_timeout_ms", _milliseconds(keepalive.timeout)),
        ("grpc.keepalive_permit_without_calls", int(keepalive.permit_without_calls)),
        ("grpc.http2.min_ping_interval_without_data_ms", _milliseconds(keepalive.min_ping_interval)),
        ("grpc.http2.max_ping_strikes", keepalive.max_ping_strikes),
    ]


def _milliseconds(seconds: float) -> int:
    return round(seconds * 1000)

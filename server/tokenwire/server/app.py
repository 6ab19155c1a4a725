"""Assemble the gRPC server: services, models, engines, and the order things start and stop in."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from tokenwire.server.api.servicer import InferenceServicer
from tokenwire.server.config import ServerSettings
from tokenwire.server.engine.engine import Engine, EngineConfig
from tokenwire.server.engine.observer import EngineObserver
from tokenwire.server.engine.registry import ModelRegistry, ServedModel
from tokenwire.server.engine.validation import RequestValidator
from tokenwire.server.lifecycle import Lifecycle, ServingPhase
from tokenwire.server.models.loader import LoadedModel, LoadSettings, load_model
from tokenwire.server.models.session import SessionSettings
from tokenwire.v1 import inference_service_pb2 as pb
from tokenwire.v1 import inference_service_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["InferenceService"].full_name

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
    ) -> None:
        self.settings = settings
        self.lifecycle = Lifecycle()
        self.registry = ModelRegistry()
        self._observer = observer
        self._wrap_model = wrap_model
        self._server: grpc.aio.Server | None = None
        self._health = HealthServicer()
        self._health_updates: set[asyncio.Task[None]] = set()
        self.port = 0

    async def start(self) -> int:
        """Listen on the configured port (NOT_SERVING until load() finishes); return the port."""
        settings = self.settings
        options = [
            ("grpc.max_receive_message_length", settings.max_receive_message_bytes),
            ("grpc.so_reuseport", 0),
        ]
        server = grpc.aio.server(options=options)
        pb_grpc.add_InferenceServiceServicer_to_server(
            InferenceServicer(self.registry, self.lifecycle), server
        )
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            (
                SERVICE_NAME,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            server,
        )
        self.port = server.add_insecure_port(f"{settings.host}:{settings.port}")
        if self.port == 0:
            raise OSError(f"cannot listen on {settings.host}:{settings.port}")
        self._server = server
        self.lifecycle.subscribe(self._publish_health)
        await server.start()
        log.info("listening on %s:%d", settings.host, self.port)
        return self.port

    async def load(self) -> None:
        """Load every model (in a worker thread), start the engines, then report SERVING."""
        settings = self.settings
        load_settings = LoadSettings(
            max_batch_size=settings.max_batch_size,
            max_context_length=settings.max_context_length,
            session=SessionSettings(device=settings.device, intra_op_threads=settings.intra_op_threads),
        )
        for source in settings.models:
            loaded = await asyncio.to_thread(load_model, source.path, load_settings, name=source.name)
            if self._wrap_model is not None:
                loaded = self._wrap_model(loaded)
            engine = Engine(
                loaded.runner,
                loaded.tokenizer,
                EngineConfig(
                    max_batch_size=settings.max_batch_size,
                    max_queue_size=settings.max_queue_size,
                    prefill_chunk_size=settings.prefill_chunk_size,
                ),
                observer=self._observer,
            )
            engine.start()
            validator = RequestValidator(loaded.info, loaded.tokenizer, loaded.chat_template, settings.limits)
            self.registry.add(ServedModel(loaded, engine, validator))
        self.lifecycle.enter(ServingPhase.SERVING)

    async def drain(self, timeout: float) -> bool:
        """Stop taking work and wait for live requests to finish; False if `timeout` passed first."""
        self.lifecycle.enter(ServingPhase.DRAINING)
        engines = [served.engine for served in self.registry.all()]
        for engine in engines:
            engine.stop_accepting()
        results = await asyncio.gather(*(engine.wait_idle(timeout) for engine in engines))
        return all(results)

    async def stop(self, grace: float = 1.0) -> None:
        """Fail whatever is still live with UNAVAILABLE, stop the engines, close the server."""
        self.lifecycle.enter(ServingPhase.STOPPED)
        for served in self.registry.all():
            await served.engine.shutdown()
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None

    def _publish_health(self, phase: ServingPhase) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if phase is ServingPhase.SERVING
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for service in ("", SERVICE_NAME):
            update = asyncio.ensure_future(self._health.set(service, status))
            self._health_updates.add(update)
            update.add_done_callback(self._health_updates.discard)

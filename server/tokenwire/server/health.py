"""What grpc.health.v1 reports: SERVING only while the server serves and no queue is overloaded.

That is the status of "" and of the inference service. A third entry, `liveness`, is SERVING
for as long as the server answers at all, through loading, overload and drain: what a liveness
probe asks, so that none of those gets a working process restarted. With --health-port the
same statuses are also served on a plaintext listener of their own, for probes (Kubernetes'
gRPC probes) that speak neither TLS nor bearer tokens.

The lifecycle decides the basics (NOT_SERVING while loading and draining). With a queue high
watermark, a model whose queue reaches it turns health NOT_SERVING so load balancers send new
work elsewhere, while requests already routed here are still accepted; health turns SERVING
again only once every queue is down to the low watermark (hysteresis, so it does not flap).

Queue depths come from the engine observer's occupancy hook, after every scheduling round, on
the engine thread. The comparison happens there; only a crossing hops to the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from tokenwire.server.config import HealthSettings
from tokenwire.server.engine.observer import NullObserver
from tokenwire.server.lifecycle import ServingPhase

log = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
LIVENESS_SERVICE = "liveness"


class HealthReporter(NullObserver):
    """Publishes one status for `services`; implements EngineObserver for the queue watermarks."""

    def __init__(
        self, servicer: health_aio.HealthServicer, services: Sequence[str], settings: HealthSettings
    ) -> None:
        self.servicer = servicer
        self._services = tuple(services)
        self._high = settings.queue_high_watermark
        self._low = settings.low_watermark
        self._loop: asyncio.AbstractEventLoop | None = None
        self._phase = ServingPhase.LOADING
        self._published: int | None = None
        self._overloaded: set[str] = set()
        """Models over the high watermark (event loop)."""
        self._overloaded_seen: dict[str, bool] = {}
        """The same, as each engine thread last reported it (each thread writes its own key)."""
        self._updates: set[asyncio.Task[None]] = set()

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Use `loop` for updates (call from it, before the engines start); liveness is SERVING."""
        self._loop = loop
        self._set(LIVENESS_SERVICE, SERVING)

    @property
    def overloaded(self) -> bool:
        return bool(self._overloaded)

    async def settled(self) -> None:
        """Return once every status published so far has reached the health service."""
        if self._updates:
            await asyncio.gather(*self._updates)

    def phase_changed(self, phase: ServingPhase) -> None:
        self._phase = phase
        self._publish()

    # -- EngineObserver (only occupancy matters to health) ----------------------------------------

    def occupancy(
        self, *, model: str, queued: int, running: int, slots: int, kv_positions_used: int, kv_positions: int
    ) -> None:
        if self._high is None or self._low is None or self._loop is None:
            return
        was_over = self._overloaded_seen.get(model, False)
        if not was_over and queued >= self._high:
            over = True
        elif was_over and queued <= self._low:
            over = False
        else:
            return
        self._overloaded_seen[model] = over
        # A closed loop means nobody is asking about health any more.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._set_overloaded, model, over, queued)

    # -- event loop -----------------------------------------------------------------------------

    def _set_overloaded(self, model: str, over: bool, queued: int) -> None:
        if over:
            self._overloaded.add(model)
            log.warning(
                "model %s: %d queued, at or above the high watermark %s: health NOT_SERVING",
                model,
                queued,
                self._high,
            )
        else:
            self._overloaded.discard(model)
            log.info("model %s: %d queued, down to the low watermark %s", model, queued, self._low)
        self._publish()

    def _publish(self) -> None:
        status = SERVING if self._phase is ServingPhase.SERVING and not self._overloaded else NOT_SERVING
        if status == self._published:
            return
        self._published = status
        for service in self._services:
            self._set(service, status)

    def _set(self, service: str, status: int) -> None:
        # Tasks start in creation order and set() does not yield before it takes effect, so
        # watchers see the statuses in the order they were published.
        update = asyncio.ensure_future(self.servicer.set(service, status))
        self._updates.add(update)
        update.add_done_callback(self._updates.discard)


async def start_health_listener(
    servicer: health_aio.HealthServicer, host: str, port: int
) -> tuple[grpc.aio.Server, int]:
    """A plaintext server of grpc.health.v1 alone on `host:port`, started; returns it and its port."""
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    address = f"{host}:{port}"
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as error:  # gRPC reports a port it cannot bind this way
        raise OSError(f"--health-port: cannot listen on {address}: {error}") from error
    if bound == 0:
        raise OSError(f"--health-port: cannot listen on {address}")
    await server.start()
    return server, int(bound)

"""Run the server until a signal: SIGTERM/SIGINT drain it, a second signal exits at once.

Shutdown order: health turns NOT_SERVING and new work is refused, live requests get up to the
drain timeout, what is left fails with UNAVAILABLE, the gRPC port closes, and last the metrics
endpoint closes and the exporters flush, so the drain's own requests are counted and traced.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal

from tokenwire.server.app import TokenwireServer
from tokenwire.server.config import ServerSettings

log = logging.getLogger(__name__)


async def serve(settings: ServerSettings) -> int:
    """Serve until SIGTERM or SIGINT, then drain; returns the process exit code."""
    server = TokenwireServer(settings)
    loop = asyncio.get_running_loop()
    stop_requested = asyncio.Event()
    signals_seen = 0

    def on_signal(signum: int) -> None:
        nonlocal signals_seen
        signals_seen += 1
        if signals_seen > 1:
            log.warning("second %s: exiting without draining", signal.Signals(signum).name)
            os._exit(128 + signum)
        log.info("%s: draining (up to %.0fs)", signal.Signals(signum).name, settings.drain_timeout)
        stop_requested.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)

    try:
        await server.start()
    except OSError as error:
        log.error("%s", error)
        return 1
    if server.metrics_port is not None:
        scheme = "https" if settings.telemetry.metrics_tls else "http"
        print(
            f"tokenwire: metrics on {scheme}://{settings.metrics_address}:{server.metrics_port}/metrics",
            flush=True,
        )
    if server.http_port is not None:
        scheme = "https" if settings.tls.enabled else "http"
        print(
            f"tokenwire: OpenAI-compatible API on {scheme}://{settings.host}:{server.http_port}/v1",
            flush=True,
        )
    loading = asyncio.create_task(server.load())
    stopping = asyncio.create_task(stop_requested.wait())
    await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if loading.done() and loading.exception() is not None:
        log.error("model failed to load: %s", loading.exception())
        stopping.cancel()
        await server.stop(grace=0)
        return 1
    if not loading.done():
        loading.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loading
    else:
        log.info("serving on %s:%d", settings.host, server.port)
        print(f"tokenwire: serving on {settings.host}:{server.port}", flush=True)
        await stopping
    drained = await server.drain(settings.drain_timeout)
    if not drained:
        log.warning("drain timeout passed; failing the remaining requests with UNAVAILABLE")
    await server.stop()
    log.info("stopped")
    return 0


def run(settings: ServerSettings) -> int:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(serve(settings))
    return uvloop.run(serve(settings))

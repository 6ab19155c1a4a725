"""The HTTP listener: uvicorn serving the OpenAI-compatible app on the gRPC server's event loop.

uvicorn parses HTTP (httptools, the parser of Node's llhttp lineage) and runs the ASGI app; it
is started here piecewise (startup, its once-a-second tick, shutdown) instead of with its own
`run`, which would want its own loop, signals and logging. The socket is bound here, so port 0
works and a port in use is an OSError like gRPC's. TLS uses the gRPC server's certificate,
key and client CA. The protocol is uvicorn's httptools one within the head's bounds
(http_protocol.py): a head too large, too slow or with too many headers, a URL too long, and a
connection over --http-max-connections are refused there, before any app code runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl

import uvicorn

from tokenwire.server.openai_api.app import OpenAIApp, operation_of
from tokenwire.server.openai_api.http_protocol import HeadLimits, bounded_protocol
from tokenwire.server.openai_api.settings import HttpSettings
from tokenwire.server.security.tls import TlsSettings


class HttpListener:
    def __init__(self, app: OpenAIApp, settings: HttpSettings, host: str, tls: TlsSettings) -> None:
        self._app = app
        self._settings = settings
        self._host = host
        self._tls = tls
        self._server: uvicorn.Server | None = None
        self._ticker: asyncio.Task[None] | None = None
        self.port = 0

    async def start(self) -> int:
        """Bind and serve; return the port. Raises OSError naming --http-port when it cannot bind."""
        settings = self._settings
        assert settings.port is not None
        tls = self._tls
        limits = HeadLimits(
            head_bytes=settings.max_head_bytes,
            headers=settings.max_headers,
            url_bytes=settings.max_url_bytes,
            header_timeout=settings.header_timeout,
            max_connections=settings.max_connections,
        )
        config = uvicorn.Config(
            self._app,
            loop="none",
            http=bounded_protocol(limits, self._app.record_refusal, operation_of),
            ws="none",
            lifespan="off",
            log_config=None,
            log_level="warning",
            access_log=False,  # tokenwire's own access log records every request
            server_header=False,
            limit_concurrency=None,  # the protocol's own bound, refused and recorded like the others
            timeout_keep_alive=round(settings.keepalive_timeout) or 1,
            ssl_certfile=str(tls.cert) if tls.cert is not None else None,
            ssl_keyfile=str(tls.key) if tls.key is not None else None,
            ssl_ca_certs=str(tls.client_ca) if tls.client_ca is not None else None,
            ssl_cert_reqs=ssl.CERT_REQUIRED if tls.client_ca is not None else ssl.CERT_NONE,
        )
        config.load()
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        try:
            sock = socket.create_server((self._host, settings.port), family=family)
        except OSError as error:
            raise OSError(f"--http-port: cannot listen on {self._host}:{settings.port}: {error}") from error
        server = uvicorn.Server(config)
        server.lifespan = config.lifespan_class(config)
        try:
            await server.startup(sockets=[sock])
        except BaseException:
            sock.close()
            raise
        self._server = server
        self._ticker = asyncio.create_task(server.main_loop(), name="http-listener-tick")
        self.port = int(sock.getsockname()[1])
        return self.port

    async def stop(self, grace: float) -> None:
        """Close the port; give open responses `grace` seconds, then cancel what is left."""
        server, self._server = self._server, None
        if server is None:
            return
        server.should_exit = True
        if self._ticker is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
        server.config.timeout_graceful_shutdown = max(1, round(grace))
        await server.shutdown()
        self._app.close()

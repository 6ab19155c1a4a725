"""The Prometheus /metrics endpoint: cheap to scrape, and as closed as the operator asks.

Rendering the page runs every OpenTelemetry instrument's collection in Python, under the GIL the
event loop needs too, so a scraper hammering the endpoint would slow every stream. The rendered
page is therefore reused for `cache_seconds`: scrapes within that window cost an HTTP exchange
and no rendering. Requests are served one at a time in one thread with a socket timeout, so
neither a flood nor a client that never finishes its request can take more than that thread.

The endpoint can require the gRPC bearer tokens (`Authorization: Bearer <token>`, compared as
digests like the gRPC interceptor does) and can speak TLS with the gRPC certificate, client
certificates included when mutual TLS is on.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterable
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)

METRICS_PATH = "/metrics"
CONNECTION_TIMEOUT_SECONDS = 5.0
"""A scraper that has not sent its request (or finished the TLS handshake) by then is dropped."""


class RenderedPage:
    """The registry's text exposition, rendered at most once per `cache_seconds`."""

    def __init__(
        self,
        registry: CollectorRegistry,
        cache_seconds: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._registry = registry
        self._cache_seconds = cache_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._page = b""
        self._rendered_at: float | None = None
        self.renders = 0

    def get(self) -> bytes:
        with self._lock:
            now = self._clock()
            fresh = self._rendered_at is not None and now - self._rendered_at < self._cache_seconds
            if not fresh:
                self._page = generate_latest(self._registry)
                self._rendered_at = now
                self.renders += 1
            return self._page


class TokenCheck:
    """Whether an Authorization header carries one of the bearer tokens."""

    def __init__(self, tokens: Iterable[str]) -> None:
        self._digests = tuple(hashlib.sha256(token.encode()).digest() for token in tokens)

    def accepts(self, header: str | None) -> bool:
        scheme, _, token = (header or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return False
        candidate = hashlib.sha256(token.strip().encode("latin-1", "replace")).digest()
        matched = False
        for digest in self._digests:  # every token, no early exit
            matched |= hmac.compare_digest(candidate, digest)
        return matched


class MetricsEndpoint:
    """An HTTP server for /metrics in a thread of its own; start() binds, stop() closes."""

    def __init__(
        self,
        page: RenderedPage,
        host: str,
        port: int,
        *,
        tokens: TokenCheck | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self._page = page
        self._tokens = tokens
        self._server = _Server((host, port), _handler(page, tokens), tls)
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> None:
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join()
            self._thread = None


def tls_context(cert: str, key: str, client_ca: str | None) -> ssl.SSLContext:
    """TLS 1.2 or later with the server's certificate; client certificates when `client_ca`."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert, key)
    if client_ca is not None:
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(client_ca)
    return context


class _Server(HTTPServer):
    def __init__(
        self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], tls: ssl.SSLContext | None
    ) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self._tls = tls
        super().__init__(address, handler)

    def get_request(self) -> tuple[Any, Any]:
        connection, address = self.socket.accept()
        connection.settimeout(CONNECTION_TIMEOUT_SECONDS)
        if self._tls is not None:
            # Handshake here, under the timeout, rather than on the listening socket's accept.
            connection = self._tls.wrap_socket(connection, server_side=True)
        return connection, address

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A scraper that hangs up, times out or fails the handshake is its own problem.
        log.debug("metrics request from %s failed", client_address, exc_info=True)


def _handler(page: RenderedPage, tokens: TokenCheck | None) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        timeout = CONNECTION_TIMEOUT_SECONDS

        def do_GET(self) -> None:
            self._answer(with_body=True)

        def do_HEAD(self) -> None:
            self._answer(with_body=False)

        def _answer(self, *, with_body: bool) -> None:
            if self.path.split("?", 1)[0] not in (METRICS_PATH, "/"):
                self._plain(404, b"not found: the metrics are at /metrics\n", with_body)
                return
            if tokens is not None and not tokens.accepts(self.headers.get("Authorization")):
                self._plain(
                    401, b"this endpoint requires Authorization: Bearer <token>\n", with_body, bearer=True
                )
                return
            body = page.get()
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if with_body:
                self.wfile.write(body)

        def _plain(self, status: int, body: bytes, with_body: bool, *, bearer: bool = False) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            if bearer:
                self.send_header("WWW-Authenticate", "Bearer")
            self.end_headers()
            if with_body:
                self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # scrapes are not worth a log line each

    return Handler

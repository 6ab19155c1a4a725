"""The /metrics endpoint: a cached page, a bind address no more open than gRPC, a token or TLS on request."""

from __future__ import annotations

import http.client
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter

from tests.server.security.certificates import Authority, Issued
from tokenwire.server.config import AuthSettings, ServerSettings, TelemetrySettings, TlsSettings
from tokenwire.server.telemetry.metrics_endpoint import MetricsEndpoint, RenderedPage, TokenCheck, tls_context

TOKEN = "metrics-Qx7-token"


class ManualClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    Counter("scraped_things", "things", registry=registry).inc(3)
    return registry


def test_the_page_is_rendered_once_per_cache_interval(registry: CollectorRegistry) -> None:
    clock = ManualClock()
    counter = Counter("fresh", "changes between scrapes", registry=registry)
    page = RenderedPage(registry, cache_seconds=1.0, clock=clock)
    first = page.get()
    counter.inc()
    clock.now += 0.5
    assert page.get() == first  # within the interval: the same bytes, no rendering
    assert page.renders == 1
    clock.now += 0.5
    assert b"fresh_total 1.0" in page.get()
    assert page.renders == 2


def test_no_cache_renders_every_time(registry: CollectorRegistry) -> None:
    page = RenderedPage(registry, cache_seconds=0, clock=ManualClock())
    for _ in range(3):
        page.get()
    assert page.renders == 3


@pytest.fixture
def endpoint_factory(registry: CollectorRegistry) -> Iterator[type[MetricsEndpoint]]:
    started: list[MetricsEndpoint] = []

    class Started(MetricsEndpoint):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]
            self.start()
            started.append(self)

    yield Started
    for endpoint in started:
        endpoint.stop()


def status_of(url: str, headers: dict[str, str] | None = None, context: ssl.SSLContext | None = None) -> int:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as response:
            body = response.read()
            assert b"scraped_things_total 3.0" in body
            return int(response.status)
    except urllib.error.HTTPError as error:
        return int(error.code)


def test_with_a_token_the_endpoint_answers_401_without_it(
    registry: CollectorRegistry, endpoint_factory: type[MetricsEndpoint]
) -> None:
    page = RenderedPage(registry, cache_seconds=1.0)
    endpoint = endpoint_factory(page, "127.0.0.1", 0, tokens=TokenCheck([TOKEN, "other"]))
    url = f"http://127.0.0.1:{endpoint.port}/metrics"
    assert status_of(url) == 401
    assert status_of(url, {"Authorization": "Bearer wrong"}) == 401
    assert status_of(url, {"Authorization": f"Basic {TOKEN}"}) == 401
    assert status_of(url, {"Authorization": f"Bearer {TOKEN}"}) == 200
    assert page.renders == 1  # refusals never render the page


@pytest.fixture(scope="module")
def authority(tmp_path_factory: pytest.TempPathFactory) -> Authority:
    return Authority(tmp_path_factory.mktemp("pki"), "metrics")


def client_context(authority: Authority, client: Issued | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(authority.cert))
    if client is not None:
        context.load_cert_chain(str(client.cert), str(client.key))
    return context


def test_with_tls_the_endpoint_speaks_only_tls_1_2_or_later(
    registry: CollectorRegistry, endpoint_factory: type[MetricsEndpoint], authority: Authority
) -> None:
    server = authority.server()
    tls = tls_context(str(server.cert), str(server.key), None)
    endpoint = endpoint_factory(RenderedPage(registry, 1.0), "127.0.0.1", 0, tls=tls)
    assert status_of(f"https://localhost:{endpoint.port}/metrics", context=client_context(authority)) == 200
    with pytest.raises((http.client.HTTPException, ConnectionError, urllib.error.URLError)):
        status_of(f"http://127.0.0.1:{endpoint.port}/metrics")
    assert tls.minimum_version >= ssl.TLSVersion.TLSv1_2


def test_with_mutual_tls_the_endpoint_wants_a_client_certificate(
    registry: CollectorRegistry, endpoint_factory: type[MetricsEndpoint], authority: Authority
) -> None:
    server = authority.server()
    tls = tls_context(str(server.cert), str(server.key), str(authority.cert))
    endpoint = endpoint_factory(RenderedPage(registry, 1.0), "127.0.0.1", 0, tls=tls)
    url = f"https://localhost:{endpoint.port}/metrics"
    assert status_of(url, context=client_context(authority, authority.client())) == 200
    with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
        status_of(url, context=client_context(authority))


PLAIN = ServerSettings(host="0.0.0.0", telemetry=TelemetrySettings(metrics_port=9464))
WITH_TOKENS = ServerSettings(
    host="0.0.0.0", telemetry=TelemetrySettings(metrics_port=9464), auth=AuthSettings(tokens=("t",))
)
WITH_TLS = ServerSettings(
    host="0.0.0.0", telemetry=TelemetrySettings(metrics_port=9464), tls=TlsSettings(Path("c"), Path("k"))
)


@pytest.mark.parametrize(
    ("settings", "address"),
    [
        (PLAIN, "0.0.0.0"),
        (WITH_TOKENS, "127.0.0.1"),
        (WITH_TLS, "127.0.0.1"),
        (
            ServerSettings(
                host="0.0.0.0", telemetry=TelemetrySettings(metrics_auth=True), auth=WITH_TOKENS.auth
            ),
            "0.0.0.0",
        ),
        (
            ServerSettings(host="0.0.0.0", telemetry=TelemetrySettings(metrics_tls=True), tls=WITH_TLS.tls),
            "0.0.0.0",
        ),
        (
            ServerSettings(
                host="::", telemetry=TelemetrySettings(metrics_host="10.0.0.5"), auth=WITH_TOKENS.auth
            ),
            "10.0.0.5",
        ),
    ],
    ids=["plain-grpc", "grpc-tokens", "grpc-tls", "endpoint-token", "endpoint-tls", "explicit"],
)
def test_the_endpoint_is_never_more_open_than_grpc_unless_told(
    settings: ServerSettings, address: str
) -> None:
    assert settings.metrics_address == address


def test_a_token_or_tls_on_the_endpoint_needs_the_grpc_one() -> None:
    problems = ServerSettings(telemetry=TelemetrySettings(metrics_auth=True, metrics_tls=True)).validate(
        require_models=False
    )
    assert "--metrics-auth: needs --auth-tokens-file or TOKENWIRE_AUTH_TOKENS" in problems
    assert "--metrics-tls: needs --tls-cert and --tls-key" in problems

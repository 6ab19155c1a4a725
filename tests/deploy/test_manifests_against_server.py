"""What deploy/kubernetes relies on in the server, checked against a real one.

The pod's TOKENWIRE_* environment, read from the rendered CPU overlay, is turned into settings
the way `tokenwire serve` does it and a real server is started from them (on loopback, with free
ports, the Secrets' files written here). Then: the services the probes name answer as the
probes need, the ports are the server's and the image's, the metrics the autoscaler reads are
on the real /metrics, and the termination grace period covers preStop and the drain.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.server.security.certificates import Authority
from tests.support.manifests import KUBERNETES, OVERLAYS, Rendered, load_adapter_rules, render
from tests.support.prometheus import scrape
from tokenwire.client import AsyncClient
from tokenwire.client.channel import Tls
from tokenwire.server import settings_sources
from tokenwire.server.api.handlers import SERVICE_NAME
from tokenwire.server.app import TokenwireServer
from tokenwire.server.cli import build_parser
from tokenwire.server.config import DEFAULT_METRICS_PORT, DEFAULT_PORT, ServerSettings
from tokenwire.server.health import LIVENESS_SERVICE

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
TOKEN = "manifest-test-token"
OTLP_EXPORT_TIMEOUT = 10.0
"""Seconds the exit may spend flushing to an unreachable OTLP collector (the SDK's default
OTEL_EXPORTER_OTLP_TIMEOUT), after the drain."""


@pytest.fixture(scope="module")
def cpu() -> Rendered:
    return Rendered("cpu", render("cpu"))


@pytest.fixture(scope="module")
def secrets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The Secrets' files, written here, by the variable that points at them in the pod."""
    folder = tmp_path_factory.mktemp("secrets")
    issued = Authority(folder, "ca").server()
    tokens = folder / "tokens"
    tokens.write_text(f"{TOKEN}\n")
    return {
        "TOKENWIRE_AUTH_TOKENS_FILE": str(tokens),
        "TOKENWIRE_TLS_CERT": str(issued.cert),
        "TOKENWIRE_TLS_KEY": str(issued.key),
        "ca": str(folder / "ca-ca.pem"),
    }


@pytest.fixture(scope="module")
def ca_pem(secrets: dict[str, str]) -> bytes:
    return Path(secrets["ca"]).read_bytes()


def pod_settings(rendered: Rendered, model_dir: Path, **replaced: str) -> ServerSettings:
    """Settings from the pod's environment, as `tokenwire serve --model DIR` reads them."""
    args = build_parser().parse_args(["serve", "--model", f"tiny={model_dir}"])
    environ: Mapping[str, str] = {**rendered.env, **replaced}
    return settings_sources.load(args, environ)


def files(secrets: dict[str, str]) -> dict[str, str]:
    return {name: path for name, path in secrets.items() if name.startswith("TOKENWIRE_")}


def test_pod_ports_are_the_servers_and_the_images_defaults(
    cpu: Rendered, tiny_model_dir: Path, secrets: dict[str, str]
) -> None:
    settings = pod_settings(cpu, tiny_model_dir, **files(secrets))
    ports = cpu.container_ports
    assert ports["grpc"] == settings.port == DEFAULT_PORT == ServerSettings().port
    assert ports["metrics"] == settings.telemetry.metrics_port == DEFAULT_METRICS_PORT
    assert ports["health"] == settings.health.port
    containerfile = (KUBERNETES.parent / "Containerfile").read_text()
    image_env = dict(re.findall(r"(TOKENWIRE_\w+)=(\S+)", containerfile))
    assert int(image_env["TOKENWIRE_PORT"]) == ports["grpc"]
    assert int(image_env["TOKENWIRE_METRICS_PORT"]) == ports["metrics"]


def test_metrics_listen_on_the_pod_address_although_grpc_needs_tls_and_a_token(
    cpu: Rendered, tiny_model_dir: Path, secrets: dict[str, str]
) -> None:
    settings = pod_settings(cpu, tiny_model_dir, **files(secrets))
    assert settings.tls.enabled
    assert settings.auth.enabled
    # Prometheus scrapes the pod IP; the NetworkPolicy, not loopback, keeps everyone else out.
    assert settings.metrics_address == "0.0.0.0"
    assert not settings.telemetry.metrics_auth
    assert not settings.telemetry.metrics_tls


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_grace_period_outlasts_prestop_and_the_drain(overlay: str, tiny_model_dir: Path) -> None:
    rendered = Rendered(overlay, render(overlay))
    grace = rendered.pod["terminationGracePeriodSeconds"]
    pre_stop = rendered.container["lifecycle"]["preStop"]["sleep"]["seconds"]
    drain = float(rendered.env.get("TOKENWIRE_DRAIN_TIMEOUT", ServerSettings().drain_timeout))
    assert grace > pre_stop + drain + OTLP_EXPORT_TIMEOUT
    # The startup probe gives the process as long to listen as a cold Python start can take.
    startup = rendered.container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 60


async def health_of(port: int) -> dict[str, int]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        answers = {}
        for service in ("", SERVICE_NAME, LIVENESS_SERVICE):
            answer = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            answers[service] = int(answer.status)
        return answers


async def test_probes_metrics_and_secrets_work_on_a_server_configured_like_the_pod(
    cpu: Rendered, tiny_model_dir: Path, secrets: dict[str, str], ca_pem: bytes
) -> None:
    settings = pod_settings(
        cpu,
        tiny_model_dir,
        **files(secrets),
        TOKENWIRE_HOST="127.0.0.1",
        TOKENWIRE_METRICS_HOST="127.0.0.1",
        TOKENWIRE_PORT="0",
        TOKENWIRE_METRICS_PORT="0",
        TOKENWIRE_HEALTH_PORT="0",
        TOKENWIRE_INTRA_OP_THREADS="1",
    )
    probes = {
        name: cpu.container[name]["grpc"]["service"]
        for name in ("startupProbe", "livenessProbe", "readinessProbe")
    }
    server = TokenwireServer(settings)
    await server.start()
    try:
        assert server.health_port is not None
        await server.health.settled()
        loading = await health_of(server.health_port)
        # While the model loads, the process is alive and started, but not ready.
        assert loading[probes["startupProbe"]] == SERVING
        assert loading[probes["livenessProbe"]] == SERVING
        assert loading[probes["readinessProbe"]] == NOT_SERVING

        await server.load()
        await server.health.settled()
        assert set((await health_of(server.health_port)).values()) == {SERVING}

        # Clients reach the gRPC port with the Secrets' TLS certificate and bearer token.
        tls = Tls(root_certificates=ca_pem)
        async with AsyncClient(f"localhost:{server.port}", token=TOKEN, tls=tls, retries=False) as client:
            assert [m.name for m in await client.list_models(deadline=10)] == ["tiny"]

        assert server.metrics_port is not None
        exposed = (await scrape(server.metrics_port)).names()
        autoscaler = cpu.one("HorizontalPodAutoscaler")["spec"]["metrics"][0]["pods"]["metric"]["name"]
        for rule in load_adapter_rules():
            series = re.match(r"\w+", rule["seriesQuery"])
            assert series is not None
            assert series.group() in exposed
            if rule["name"]["as"] == autoscaler:
                assert re.fullmatch(rule["name"]["matches"], series.group())

        await server.drain(timeout=5)
        await server.health.settled()
        draining = await health_of(server.health_port)
        # A drain takes the pod out of the Services but never gets it restarted.
        assert draining[probes["readinessProbe"]] == NOT_SERVING
        assert draining[probes["livenessProbe"]] == SERVING
    finally:
        await server.stop(grace=0)

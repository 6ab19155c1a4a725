"""Health for probes: the `liveness` entry and the plaintext --health-port listener.

Kubernetes' gRPC probes speak neither TLS nor bearer tokens, and a liveness probe must not fail
while a working server loads, drains or has a long queue; these tests hold the server to both.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.conftest import tiny_settings
from tests.server.security.certificates import Authority
from tokenwire.client import AsyncClient, TokenwireError
from tokenwire.server.api.handlers import SERVICE_NAME
from tokenwire.server.app import TokenwireServer
from tokenwire.server.config import AuthSettings, HealthSettings, TlsSettings
from tokenwire.server.health import LIVENESS_SERVICE

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def statuses(port: int) -> dict[str, int]:
    """Each health entry's status, asked in plaintext without a token."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return {
            service: int(
                (await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)).status
            )
            for service in ("", SERVICE_NAME, LIVENESS_SERVICE)
        }


async def test_liveness_stays_serving_through_loading_and_draining(tiny_model_dir: Path) -> None:
    server = TokenwireServer(tiny_settings(tiny_model_dir))
    await server.start()
    try:
        await server.health.settled()
        assert await statuses(server.port) == {
            "": NOT_SERVING,
            SERVICE_NAME: NOT_SERVING,
            LIVENESS_SERVICE: SERVING,
        }
        await server.load()
        await server.health.settled()
        assert await statuses(server.port) == {"": SERVING, SERVICE_NAME: SERVING, LIVENESS_SERVICE: SERVING}
        await server.drain(timeout=5)
        await server.health.settled()
        assert await statuses(server.port) == {
            "": NOT_SERVING,
            SERVICE_NAME: NOT_SERVING,
            LIVENESS_SERVICE: SERVING,
        }
    finally:
        await server.stop(grace=0)


async def test_health_port_answers_in_plaintext_while_grpc_needs_tls_and_a_token(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    authority = Authority(tmp_path, "ca")
    issued = authority.server()
    settings = tiny_settings(
        tiny_model_dir,
        tls=TlsSettings(cert=issued.cert, key=issued.key),
        auth=AuthSettings(tokens=("secret",), protect_health=True),
        health=HealthSettings(port=0),
    )
    server = TokenwireServer(settings)
    await server.start()
    try:
        assert server.health_port is not None
        assert server.health_port != server.port
        await server.health.settled()
        assert (await statuses(server.health_port))[LIVENESS_SERVICE] == SERVING
        await server.load()
        await server.health.settled()
        assert await statuses(server.health_port) == {
            "": SERVING,
            SERVICE_NAME: SERVING,
            LIVENESS_SERVICE: SERVING,
        }
        # The gRPC port itself still refuses plaintext.
        async with AsyncClient(f"127.0.0.1:{server.port}", token="secret", retries=False) as client:
            with pytest.raises(TokenwireError) as refused:
                await client.list_models(deadline=10)
        assert refused.value.code is grpc.StatusCode.UNAVAILABLE
        # Only health is served there.
        async with AsyncClient(f"127.0.0.1:{server.health_port}", retries=False) as client:
            with pytest.raises(TokenwireError) as unknown:
                await client.list_models(deadline=10)
        assert unknown.value.code is grpc.StatusCode.UNIMPLEMENTED
        await server.drain(timeout=5)
        await server.health.settled()
        assert (await statuses(server.health_port))[SERVICE_NAME] == NOT_SERVING
    finally:
        await server.stop(grace=0)


def test_health_port_must_differ_from_the_other_ports(tiny_model_dir: Path) -> None:
    settings = tiny_settings(tiny_model_dir, port=50051, health=HealthSettings(port=50051))
    assert "--health-port: 50051 is also the --port" in settings.validate()

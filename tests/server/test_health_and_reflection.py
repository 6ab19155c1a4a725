"""Health tells a load balancer the truth; reflection lets grpcurl and buf curl work without protos."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from tests.conftest import tiny_settings
from tokenwire.client import AsyncClient, TokenwireError
from tokenwire.server.app import SERVICE_NAME, TokenwireServer

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def check(port: int, service: str = "") -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        response = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service)
        )
    return int(response.status)


async def test_health_follows_loading_serving_and_draining(tiny_model_dir: object) -> None:
    server = TokenwireServer(tiny_settings(tiny_model_dir))  # type: ignore[arg-type]
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(
                health_pb2.HealthCheckRequest(service=SERVICE_NAME)
            )
            assert (await watch.read()).status == NOT_SERVING
            assert await check(server.port) == NOT_SERVING
            async with AsyncClient(f"127.0.0.1:{server.port}", retries=False) as client:
                with pytest.raises(TokenwireError) as raised:
                    await client.generate("too early")
                assert raised.value.code is grpc.StatusCode.UNAVAILABLE
                assert raised.value.reason == "LOADING"
            await server.load()
            assert (await watch.read()).status == SERVING
            assert await check(server.port, SERVICE_NAME) == SERVING
            await server.drain(timeout=5)
            assert (await watch.read()).status == NOT_SERVING
            assert await check(server.port) == NOT_SERVING
            watch.cancel()
    finally:
        await server.stop(grace=0)


async def test_reflection_lists_and_describes_the_service(server: TokenwireServer) -> None:
    def ask_reflection() -> tuple[set[str], str, set[str]]:
        # The reflection client library is synchronous; run it beside the server's event loop.
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            database = ProtoReflectionDescriptorDatabase(channel)
            services = set(database.get_services())
            described = database.FindFileContainingSymbol(SERVICE_NAME)
            return services, described.package, {m.name for m in described.service[0].method}

    services, package, methods = await asyncio.to_thread(ask_reflection)
    assert {SERVICE_NAME, "grpc.health.v1.Health"} <= services
    assert package == "tokenwire.v1"
    assert methods == {"Generate", "GenerateStream", "StreamGenerate", "ListModels", "Embed"}


async def test_reflection_describes_every_service_it_lists_orca_s_included(server: TokenwireServer) -> None:
    def describe_all() -> dict[str, str]:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            database = ProtoReflectionDescriptorDatabase(channel)
            return {name: database.FindFileContainingSymbol(name).package for name in database.get_services()}

    packages = await asyncio.to_thread(describe_all)
    assert packages["xds.service.orca.v3.OpenRcaService"] == "xds.service.orca.v3"
    assert packages[SERVICE_NAME] == "tokenwire.v1"

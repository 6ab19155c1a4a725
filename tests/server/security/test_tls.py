"""TLS and mutual TLS on a real port: the right certificates get in, everyone else is refused."""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.conftest import tiny_settings
from tests.server.security.certificates import Authority, Issued
from tests.support.servers import serving
from tokenwire.client import AsyncClient, GenerateOptions, Stopping, TokenwireError
from tokenwire.client.channel import Tls
from tokenwire.server import settings_sources
from tokenwire.server.cli import build_parser, main
from tokenwire.server.config import TlsSettings


@dataclass(frozen=True)
class Pki:
    authority: Authority
    server: Issued
    client: Issued
    rogue_authority: Authority
    rogue_client: Issued


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    folder = tmp_path_factory.mktemp("pki")
    authority = Authority(folder / "trusted", "trusted")
    rogue = Authority(folder / "rogue", "rogue")
    return Pki(authority, authority.server(), authority.client(), rogue, rogue.client("intruder"))


async def models_over(port: int, tls: Tls | None) -> list[str]:
    async with AsyncClient(f"localhost:{port}", tls=tls, retries=False) as client:
        return [model.name for model in await client.list_models(deadline=10)]


async def refused_code(port: int, tls: Tls | None) -> grpc.StatusCode:
    with pytest.raises(TokenwireError) as refused:
        await models_over(port, tls)
    return refused.value.code


async def test_tls_serves_clients_that_trust_its_ca_and_no_one_else(tiny_model_dir: Path, pki: Pki) -> None:
    settings = tiny_settings(tiny_model_dir, tls=TlsSettings(cert=pki.server.cert, key=pki.server.key))
    trusting = Tls(root_certificates=pki.authority.cert_pem)
    async with serving(settings) as server:
        assert await models_over(server.port, trusting) == ["tiny"]
        async with AsyncClient(f"127.0.0.1:{server.port}", tls=trusting, retries=False) as client:
            generated = await client.generate(
                "Over TLS", GenerateOptions(stopping=Stopping(4, ignore_eos=True))
            )
        async with grpc.aio.secure_channel(f"localhost:{server.port}", trusting.credentials()) as channel:
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert await refused_code(server.port, None) is grpc.StatusCode.UNAVAILABLE  # plaintext
        rogue_trust = Tls(root_certificates=pki.rogue_authority.cert_pem)
        assert await refused_code(server.port, rogue_trust) is grpc.StatusCode.UNAVAILABLE
    assert generated.completion_tokens == 4
    assert health.status == health_pb2.HealthCheckResponse.SERVING


async def test_mutual_tls_requires_a_client_certificate_signed_by_the_client_ca(
    tiny_model_dir: Path, pki: Pki
) -> None:
    tls = TlsSettings(cert=pki.server.cert, key=pki.server.key, client_ca=pki.authority.cert)
    ca = pki.authority.cert_pem
    async with serving(tiny_settings(tiny_model_dir, tls=tls)) as server:
        with_client_cert = Tls(ca, certificate_chain=pki.client.cert_pem, private_key=pki.client.key_pem)
        assert await models_over(server.port, with_client_cert) == ["tiny"]
        assert await refused_code(server.port, Tls(ca)) is grpc.StatusCode.UNAVAILABLE
        intruder = Tls(ca, certificate_chain=pki.rogue_client.cert_pem, private_key=pki.rogue_client.key_pem)
        assert await refused_code(server.port, intruder) is grpc.StatusCode.UNAVAILABLE


async def test_the_cli_connects_with_its_tls_flags(
    tiny_model_dir: Path, pki: Pki, capsys: pytest.CaptureFixture[str]
) -> None:
    tls = TlsSettings(cert=pki.server.cert, key=pki.server.key, client_ca=pki.authority.cert)
    async with serving(tiny_settings(tiny_model_dir, tls=tls)) as server:
        common = ["models", "--server", f"localhost:{server.port}", "--tls-ca", str(pki.authority.cert)]
        client_identity = ["--tls-cert", str(pki.client.cert), "--tls-key", str(pki.client.key)]
        with_identity = await asyncio.to_thread(main, [*common, *client_identity])
        listed = capsys.readouterr().out
        without_identity = await asyncio.to_thread(main, common)
        refused = capsys.readouterr().err
    assert with_identity == 0 and listed.startswith("tiny\t")
    assert without_identity == 1 and "UNAVAILABLE" in refused


async def test_the_cli_checks_the_certificate_against_the_name_it_is_told(
    tiny_model_dir: Path, pki: Pki, capsys: pytest.CaptureFixture[str]
) -> None:
    internal = pki.authority.server("internal", dns=("tokenwire.internal",), ips=())
    async with serving(
        tiny_settings(tiny_model_dir, tls=TlsSettings(cert=internal.cert, key=internal.key))
    ) as server:
        by_address = ["models", "--server", f"127.0.0.1:{server.port}", "--tls-ca", str(pki.authority.cert)]
        mismatched = await asyncio.to_thread(main, by_address)
        capsys.readouterr()
        named = await asyncio.to_thread(main, [*by_address, "--tls-server-name", "tokenwire.internal"])
        listed = capsys.readouterr().out
    assert mismatched == 1
    assert named == 0 and listed.startswith("tiny\t")


def serve_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def test_a_key_that_does_not_match_the_certificate_stops_the_server_at_start(pki: Pki) -> None:
    args = serve_args("--tls-cert", str(pki.server.cert), "--tls-key", str(pki.client.key))
    with pytest.raises(settings_sources.SettingsError) as raised:
        settings_sources.load(args, {})
    assert any(problem.startswith("--tls-cert/--tls-key:") for problem in raised.value.problems)


def test_tls_settings_name_the_missing_half(pki: Pki) -> None:
    with pytest.raises(settings_sources.SettingsError) as raised:
        settings_sources.load(serve_args("--tls-cert", str(pki.server.cert)), {})
    assert raised.value.problems == ("--tls-cert and --tls-key: give both or neither",)
    with pytest.raises(settings_sources.SettingsError) as raised:
        settings_sources.load(serve_args("--tls-client-ca", str(pki.authority.cert)), {})
    assert raised.value.problems == ("--tls-client-ca: mutual TLS needs --tls-cert and --tls-key too",)

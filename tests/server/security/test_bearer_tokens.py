"""Bearer-token authentication on a real port: every service but health needs a valid token."""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tests.conftest import tiny_settings
from tests.support.prometheus import scrape
from tests.support.servers import serving
from tokenwire.client import AsyncClient, Failed, GenerateOptions, Stopping, TokenwireError
from tokenwire.server.app import TokenwireServer
from tokenwire.server.cli import main
from tokenwire.server.config import AuthSettings, TelemetrySettings
from tokenwire.server.security.auth import TokenFileError, load_tokens

GOOD = "alpha-7Qm2-token"
OTHER_GOOD = "beta-Zx81-token"
WRONG = "wrong-Hk3v-token"
SHORT = GenerateOptions(stopping=Stopping(3, ignore_eos=True))


@pytest.fixture
def spans() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
async def protected(tiny_model_dir: Path, spans: InMemorySpanExporter) -> AsyncIterator[TokenwireServer]:
    settings = tiny_settings(
        tiny_model_dir,
        auth=AuthSettings(tokens=(GOOD, OTHER_GOOD)),
        telemetry=TelemetrySettings(metrics_port=0),
    )
    async with serving(settings, span_exporter=spans) as server:
        yield server


async def first_failure(server: TokenwireServer, token: str | None, call: str) -> TokenwireError:
    async with AsyncClient(f"127.0.0.1:{server.port}", token=token, retries=False) as client:

        async def attempt() -> None:
            if call == "generate":
                await client.generate("Hi", SHORT)
            elif call == "stream":
                async for event in client.stream("Hi", SHORT):
                    if isinstance(event, Failed):  # the call's error ends the generation's events
                        raise event.error
            else:
                await client.list_models()

        with pytest.raises(TokenwireError) as raised:
            await attempt()
    return raised.value


@pytest.mark.parametrize("call", ["generate", "stream", "models"])
@pytest.mark.parametrize(("token", "reason"), [(None, "TOKEN_MISSING"), (WRONG, "TOKEN_INVALID")])
async def test_calls_without_a_valid_token_are_unauthenticated_with_rich_details(
    protected: TokenwireServer, call: str, token: str | None, reason: str
) -> None:
    error = await first_failure(protected, token, call)
    assert error.code is grpc.StatusCode.UNAUTHENTICATED
    assert error.reason == reason  # decoded from google.rpc ErrorInfo, like every other error
    assert "Bearer" in error.message or "not valid" in error.message


@pytest.mark.parametrize("token", [GOOD, OTHER_GOOD])
async def test_every_configured_token_is_accepted(protected: TokenwireServer, token: str) -> None:
    async with AsyncClient(f"127.0.0.1:{protected.port}", token=token, retries=False) as client:
        result = await client.generate("Hi", SHORT)
        streamed = [event async for event in client.stream("Hi", SHORT)]
        models = await client.list_models()
    assert result.completion_tokens == 3
    assert streamed and [m.name for m in models] == ["tiny"]


async def reflection_services(port: int, metadata: tuple[tuple[str, str], ...]) -> list[str]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), metadata=metadata
        )
        response = await call.read()
        call.cancel()
    return [service.name for service in response.list_services_response.service]


async def reflection_refusal(port: int) -> grpc.StatusCode:
    """How a reflection stream the server refuses ends, before the client sends anything: a
    request written while the server refuses the call can fail on the client's side first
    (INTERNAL, "Failed execute_batch"), which would hide the server's status."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo()
        code: grpc.StatusCode = await call.code()
    return code


async def health_status(port: int, metadata: tuple[tuple[str, str], ...] = ()) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        response = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), metadata=metadata
        )
    return int(response.status)


async def test_health_is_open_and_reflection_needs_the_token(protected: TokenwireServer) -> None:
    assert await health_status(protected.port) == health_pb2.HealthCheckResponse.SERVING
    assert await reflection_refusal(protected.port) is grpc.StatusCode.UNAUTHENTICATED
    services = await reflection_services(protected.port, (("authorization", f"Bearer {GOOD}"),))
    assert "tokenwire.v1.InferenceService" in services


async def test_auth_health_puts_health_behind_the_token_too(tiny_model_dir: Path) -> None:
    settings = tiny_settings(tiny_model_dir, auth=AuthSettings(tokens=(GOOD,), protect_health=True))
    async with serving(settings) as server:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await health_status(server.port)
        allowed = await health_status(server.port, (("authorization", f"bearer {GOOD}"),))
    assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
    assert allowed == health_pb2.HealthCheckResponse.SERVING


async def test_reflection_can_be_turned_off(tiny_model_dir: Path) -> None:
    async with serving(tiny_settings(tiny_model_dir, reflection=False)) as server:
        assert await reflection_refusal(server.port) is grpc.StatusCode.UNIMPLEMENTED


async def test_tokens_never_reach_logs_spans_or_metrics(
    protected: TokenwireServer, spans: InMemorySpanExporter, every_log_line: io.StringIO
) -> None:
    async with AsyncClient(f"127.0.0.1:{protected.port}", token=GOOD, retries=False) as client:
        await client.generate("Hi", SHORT, request_id="caller-0")
    for index, token in enumerate((WRONG, None), start=1):
        async with AsyncClient(f"127.0.0.1:{protected.port}", token=token, retries=False) as client:
            with pytest.raises(TokenwireError) as refused:
                await client.generate("Hi", SHORT, request_id=f"caller-{index}")
        assert refused.value.code is grpc.StatusCode.UNAUTHENTICATED
    assert protected.metrics_port
    metrics = await scrape(protected.metrics_port)

    logged = every_log_line.getvalue()
    access = [json.loads(line) for line in logged.splitlines() if '"tokenwire.access"' in line]
    outcomes = sorted(str(entry["outcome"]) for entry in access)
    assert outcomes == ["ok", "unauthenticated", "unauthenticated"]
    assert {entry["reason"] for entry in access if entry["outcome"] != "ok"} == {
        "TOKEN_INVALID",
        "TOKEN_MISSING",
    }
    exported = repr([(s.name, s.attributes, s.events, s.status) for s in spans.get_finished_spans()])
    assert len(spans.get_finished_spans()) >= 3
    for secret in (GOOD, WRONG, OTHER_GOOD):
        assert secret not in logged
        assert secret not in exported
        assert secret not in metrics.text
    assert (
        metrics.value(
            "tokenwire_server_requests_total",
            gen_ai_request_model="",
            outcome="unauthenticated",
            caller="anonymous",
        )
        == 2
    )


def test_tokens_come_from_the_file_and_the_environment(tmp_path: Path) -> None:
    tokens_file = tmp_path / "tokens"
    tokens_file.write_text(
        "# rotated 2025-01\nfirst-token\n\n  second-token  \nfirst-token\n", encoding="utf-8"
    )
    assert load_tokens(tokens_file, {}) == ("first-token", "second-token")
    environ = {"TOKENWIRE_AUTH_TOKENS": "third-token, first-token,"}
    assert load_tokens(tokens_file, environ) == ("first-token", "second-token", "third-token")
    assert load_tokens(None, environ) == ("third-token", "first-token")
    assert load_tokens(None, {}) == ()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("# nothing but a comment\n\n", "holds no token"),
        ("reader tok\x07en\n", "may not hold spaces or control characters"),
        ("reader secret-token weight=heavy\n", "line 1: caller 'reader': weight must be a number"),
        ("# callers\nreader secret-token colour=red\n", "line 2: caller 'reader': unknown option 'colour'"),
        ("bad/name secret-token\n", "caller name 'bad/name' must be"),
        ("# callers\n\nreader secret-token group=a/b\n", "line 3: caller 'reader': group 'a/b' must be"),
        ("reader secret-token group=\n", "line 1: caller 'reader': group '' must be"),
        (None, "cannot read"),
    ],
)
def test_unusable_token_files_are_refused_naming_the_flag(
    tmp_path: Path, content: str | None, message: str
) -> None:
    tokens_file = tmp_path / "tokens"
    if content is not None:
        tokens_file.write_text(content, encoding="utf-8")
    with pytest.raises(TokenFileError) as refused:
        load_tokens(tokens_file, {})
    assert str(refused.value).startswith("--auth-tokens-file")
    assert message in str(refused.value)
    assert "secret-token" not in str(refused.value)


async def test_the_cli_sends_its_token(
    protected: TokenwireServer, capsys: pytest.CaptureFixture[str]
) -> None:
    target = f"127.0.0.1:{protected.port}"
    with_token = await asyncio.to_thread(main, ["models", "--server", target, "--token", GOOD])
    listed = capsys.readouterr().out
    without = await asyncio.to_thread(main, ["models", "--server", target])
    refused = capsys.readouterr().err
    assert with_token == 0 and listed.startswith("tiny\t")
    assert without == 1 and "UNAUTHENTICATED" in refused


@pytest.mark.parametrize("method", ["Generate", "StreamGenerate", "ListModels"])
async def test_a_call_without_a_token_is_refused_before_its_body_is_read(
    protected: TokenwireServer, method: str
) -> None:
    # The request message never comes: a server that read (and decoded) the body before checking
    # the token would wait for it until the deadline instead of refusing at once.
    never: asyncio.Queue[bytes] = asyncio.Queue()

    async def no_messages() -> AsyncIterator[bytes]:
        yield await never.get()

    async with grpc.aio.insecure_channel(f"127.0.0.1:{protected.port}") as channel:
        call = channel.stream_unary(f"/tokenwire.v1.InferenceService/{method}")(no_messages(), timeout=20)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call
    assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED

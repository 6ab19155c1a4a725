"""The inference gateway's fairness and objective headers on a real server with bearer tokens.

Requests are sent the way the gateway forwards them: gRPC calls with the bearer token and the
headers as call metadata (the gateway itself does not run here, see tests/deploy). Which caller
a request ran as is read from the server's own metrics and from its queue limits; which priority
it ran at from the order a one-slot engine serves a held queue in.
"""

from __future__ import annotations

import asyncio
from functools import partial
from pathlib import Path

import grpc
import pytest

from tests.conftest import tiny_settings
from tests.server.openai_api.raw_http import request as http_request
from tests.support.polling import wait_until
from tests.support.prometheus import Scrape, scrape
from tests.support.servers import serving
from tests.support.stepping import StepGate
from tokenwire.client import TokenwireError
from tokenwire.server.config import AuthSettings, ServerSettings, TelemetrySettings
from tokenwire.server.engine.errors import GenerationError
from tokenwire.server.engine.types import Caller, Priority
from tokenwire.server.openai_api.parsing import PRIORITY_HEADER
from tokenwire.server.openai_api.settings import HttpSettings
from tokenwire.server.security.auth import load_token_callers
from tokenwire.server.security.gateway_headers import (
    CALLER_MISMATCH,
    FAIRNESS_ID_HEADER,
    OBJECTIVE_HEADER,
    PRIORITY_MISMATCH,
    UNKNOWN_CALLER,
    GatewayHeaders,
    GatewaySettings,
)
from tokenwire.server.settings_schema import bound_problems, declared_settings
from tokenwire.v1 import inference_service_pb2 as pb
from tokenwire.v1 import inference_service_pb2_grpc as pb_grpc

GATEWAY_TOKEN = "gateway-T7pq-secret"
SEARCH_TOKEN = "search-W3kd-secret"
REPORTS_TOKEN = "reports-Nc5x-secret"
GATEWAY = GatewaySettings(
    caller_header=FAIRNESS_ID_HEADER, trusted_callers="inference-gateway", objective_header=OBJECTIVE_HEADER
)


@pytest.fixture
def auth(tmp_path: Path) -> AuthSettings:
    path = tmp_path / "tokens"
    path.write_text(
        f"inference-gateway {GATEWAY_TOKEN}\nsearch {SEARCH_TOKEN} weight=4\n"
        f"reports {REPORTS_TOKEN} max_queued=1\n",
        encoding="utf-8",
    )
    pairs = load_token_callers(path, {})
    return AuthSettings(tokens=tuple(t for t, _ in pairs), callers=tuple(c for _, c in pairs))


def settings(model_dir: Path, auth: AuthSettings, **overrides: object) -> ServerSettings:
    return tiny_settings(
        model_dir, auth=auth, gateway=GATEWAY, telemetry=TelemetrySettings(metrics_port=0), **overrides
    )


def request(tokens: int = 2, priority: int = pb.PRIORITY_UNSPECIFIED) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt="Hi",
        stopping=pb.StoppingCriteria(max_new_tokens=tokens, ignore_eos=True),
        priority=priority,  # type: ignore[arg-type]
    )


def metadata(token: str, **headers: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"), *headers.items())


def fairness(caller: str) -> dict[str, str]:
    return {FAIRNESS_ID_HEADER: caller}


def objective(name: str) -> dict[str, str]:
    return {OBJECTIVE_HEADER: name}


def requests_of(scraped: Scrape, **labels: str) -> float:
    """Requests counted with these labels, whatever their others (the model of a refusal)."""
    wanted = set(labels.items())
    return sum(
        value
        for (name, found), value in scraped.samples.items()
        if name == "tokenwire_server_requests_total" and wanted <= found
    )


async def refusal(call: object) -> TokenwireError:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await call  # type: ignore[misc]
    return TokenwireError.from_rpc_error(refused.value)


async def test_the_gateways_token_runs_a_request_as_the_caller_its_fairness_header_names(
    tiny_model_dir: Path, auth: AuthSettings
) -> None:
    async with serving(settings(tiny_model_dir, auth)) as server:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.InferenceServiceStub(channel)
            await stub.Generate(request(), metadata=metadata(GATEWAY_TOKEN, **fairness("search")))
            await stub.Generate(request(), metadata=metadata(GATEWAY_TOKEN, **fairness("search")))
            await stub.Generate(request(), metadata=metadata(GATEWAY_TOKEN, **fairness("reports")))
            # Without the header, the gateway's own token is its own caller.
            await stub.Generate(request(), metadata=metadata(GATEWAY_TOKEN))
            # A client calling directly with its own token, naming itself: itself.
            await stub.Generate(request(), metadata=metadata(SEARCH_TOKEN, **fairness("search")))
        assert server.metrics_port is not None
        metrics = await scrape(server.metrics_port)
    served = {
        caller: requests_of(metrics, caller=caller) for caller in ("search", "reports", "inference-gateway")
    }
    assert served == {"search": 3, "reports": 1, "inference-gateway": 1}


async def test_a_caller_that_names_another_caller_is_refused_naming_the_header(
    tiny_model_dir: Path, auth: AuthSettings
) -> None:
    async with serving(settings(tiny_model_dir, auth)) as server:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.InferenceServiceStub(channel)
            posing = await refusal(
                stub.Generate(request(), metadata=metadata(REPORTS_TOKEN, **fairness("search")))
            )
            unknown = await refusal(
                stub.Generate(request(), metadata=metadata(GATEWAY_TOKEN, **fairness("nobody")))
            )
        assert server.metrics_port is not None
        metrics = await scrape(server.metrics_port)
    for error, reason in ((posing, CALLER_MISMATCH), (unknown, UNKNOWN_CALLER)):
        assert error.code is grpc.StatusCode.INVALID_ARGUMENT
        assert error.reason == reason
        assert [v.field for v in error.field_violations] == [FAIRNESS_ID_HEADER]
    assert "'search'" in posing.message and "'reports'" in posing.message
    # Each refusal is counted against the caller its token proves, never the one it named.
    assert requests_of(metrics, outcome="invalid", caller="reports") == 1
    assert requests_of(metrics, outcome="invalid", caller="inference-gateway") == 1
    assert requests_of(metrics, caller="search") == 0


async def test_the_named_callers_own_queue_limit_applies_to_requests_the_gateway_forwards(
    tiny_model_dir: Path, auth: AuthSettings
) -> None:
    gate = StepGate()
    async with serving(settings(tiny_model_dir, auth, max_batch_size=1), gate=gate) as server:
        engine = server.registry.default.engine
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.InferenceServiceStub(channel)
            as_reports = metadata(GATEWAY_TOKEN, **fairness("reports"))
            running = asyncio.ensure_future(stub.Generate(request(), metadata=as_reports))
            # In the slot, not only submitted: until a round admits it, it counts as reports'
            # one queued request and the second would be refused.
            await wait_until(lambda: gate.waiting == 1, what="the first request to take the slot")
            queued = asyncio.ensure_future(stub.Generate(request(), metadata=as_reports))
            await wait_until(lambda: engine.live_count == 2, what="the second request to queue")
            # reports may have one request queued (max_queued=1); the gateway itself has no limit.
            full = await refusal(stub.Generate(request(), metadata=as_reports))
            own = asyncio.ensure_future(stub.Generate(request(), metadata=metadata(GATEWAY_TOKEN)))
            await wait_until(lambda: engine.live_count == 3, what="the gateway's own request to queue")
            gate.open()
            answers = await asyncio.gather(running, queued, own)
    assert full.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert full.reason == "CALLER_QUEUE_FULL"
    assert [a.usage.completion_tokens for a in answers] == [2, 2, 2]


async def test_an_objective_named_after_a_priority_orders_the_queue_like_the_priority_field(
    tiny_model_dir: Path, auth: AuthSettings
) -> None:
    gate = StepGate()
    one_slot = settings(tiny_model_dir, auth, max_batch_size=1, preemption=False, batch_reserved_slots=0)
    async with serving(one_slot, gate=gate) as server:
        engine = server.registry.default.engine
        finished: list[str] = []
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.InferenceServiceStub(channel)

            async def send(name: str, **headers: str) -> None:
                await stub.Generate(request(), metadata=metadata(SEARCH_TOKEN, **headers))
                finished.append(name)

            def holds(count: int) -> bool:
                return bool(engine.live_count == count)

            calls = [asyncio.ensure_future(send("blocker"))]
            # Its decode step held at the gate: it is in the slot, not waiting to be ordered
            # with the others by priority.
            await wait_until(lambda: gate.waiting == 1, what="the blocker to take the slot")
            # Queued in this order; served by priority, then arrival.
            for name, headers in (
                ("batch", objective("batch")),
                ("plain", {}),
                ("interactive", objective("Interactive")),
                ("gateway-only objective", objective("premium-tier")),
            ):
                calls.append(asyncio.ensure_future(send(name, **headers)))
                await wait_until(partial(holds, len(calls)), what=f"{name} to queue")
            gate.open()
            await asyncio.gather(*calls)
    # An objective that names no priority is the gateway's alone: the request keeps DEFAULT.
    assert finished == ["blocker", "interactive", "plain", "gateway-only objective", "batch"]


async def test_an_objective_that_contradicts_the_priority_field_is_refused_and_one_that_agrees_is_served(
    tiny_model_dir: Path, auth: AuthSettings
) -> None:
    async with (
        serving(settings(tiny_model_dir, auth)) as server,
        grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel,
    ):
        stub = pb_grpc.InferenceServiceStub(channel)
        agrees = await stub.Generate(
            request(priority=pb.PRIORITY_BATCH), metadata=metadata(SEARCH_TOKEN, **objective("batch"))
        )
        contradicts = await refusal(
            stub.Generate(
                request(priority=pb.PRIORITY_BATCH),
                metadata=metadata(SEARCH_TOKEN, **objective("interactive")),
            )
        )
    assert agrees.usage.completion_tokens == 2
    assert contradicts.code is grpc.StatusCode.INVALID_ARGUMENT
    assert contradicts.reason == PRIORITY_MISMATCH
    assert [v.field for v in contradicts.field_violations] == [OBJECTIVE_HEADER]


async def test_without_the_settings_the_headers_change_nothing(
    tiny_model_dir: Path, auth: AuthSettings
) -> None:
    plain = tiny_settings(tiny_model_dir, auth=auth, telemetry=TelemetrySettings(metrics_port=0))
    async with serving(plain) as server:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.InferenceServiceStub(channel)
            headers = {**fairness("search"), **objective("interactive")}
            await stub.Generate(
                request(priority=pb.PRIORITY_BATCH), metadata=metadata(REPORTS_TOKEN, **headers)
            )
        assert server.metrics_port is not None
        metrics = await scrape(server.metrics_port)
    assert requests_of(metrics, outcome="ok", caller="reports") == 1
    assert requests_of(metrics, caller="search") == 0


def test_settings_that_cannot_work_are_named_at_startup(tiny_model_dir: Path, auth: AuthSettings) -> None:
    assert settings(tiny_model_dir, auth).validate() == []
    problems = tiny_settings(
        tiny_model_dir,
        gateway=GatewaySettings(caller_header=FAIRNESS_ID_HEADER, trusted_callers="gateway"),
    ).validate()
    assert any(p.startswith("--gateway-caller-header: needs --auth-tokens-file") for p in problems)
    problems = tiny_settings(
        tiny_model_dir, auth=auth, gateway=GatewaySettings(trusted_callers="gatewy")
    ).validate()
    assert "--gateway-trusted-callers: needs --gateway-caller-header" in problems
    assert "--gateway-trusted-callers: no caller of the token file is named gatewy" in problems


@pytest.mark.parametrize("header", ["Authorization", "authorization", "x-trace-bin", "grpc-timeout", "a b"])
def test_a_header_grpc_would_not_pass_as_text_is_refused_as_a_setting(header: str) -> None:
    problems = bound_problems(
        ServerSettings(gateway=GatewaySettings(caller_header=header)), declared_settings(ServerSettings)
    )
    assert any("--gateway-caller-header" in p for p in problems), problems


def test_a_long_header_value_is_cut_short_in_the_error() -> None:
    headers = GatewayHeaders(GATEWAY, [Caller("inference-gateway"), Caller("search")])
    with pytest.raises(GenerationError) as refused:
        headers.caller(Caller("search"), ((FAIRNESS_ID_HEADER, "x" * 5000),))
    assert len(str(refused.value)) < 400
    assert headers.priority((), None) is None
    assert headers.priority(((OBJECTIVE_HEADER, "default"),), None) is Priority.DEFAULT


# -- the same headers over the OpenAI-compatible HTTP API ----------------------------------------


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"model": "tiny", "prompt": "Hi", "max_tokens": 2}),
        ("/v1/responses", {"model": "tiny", "input": "Hi", "max_output_tokens": 2}),
    ],
    ids=["completions", "responses"],
)
async def test_over_http_the_headers_act_as_over_grpc(
    tiny_model_dir: Path, auth: AuthSettings, path: str, body: dict[str, object]
) -> None:
    """One admission serves both edges: the fairness header names the caller an HTTP request runs
    as, a caller naming another is refused naming the header, and an objective sets the priority
    an HTTP request leaves unset (no priority header is not DEFAULT) and must agree with one it sets."""
    async with serving(settings(tiny_model_dir, auth, http=HttpSettings(port=0))) as server:
        assert server.http_port is not None
        post = partial(http_request, server.http_port, "POST", path, body)

        def bearer(token: str, **headers: str) -> dict[str, str]:
            return {"authorization": f"Bearer {token}", **headers}

        forwarded = await post(headers=bearer(GATEWAY_TOKEN, **fairness("search")))
        posing = await post(headers=bearer(REPORTS_TOKEN, **fairness("search")))
        unknown = await post(headers=bearer(GATEWAY_TOKEN, **fairness("nobody")))
        objective_alone = await post(headers=bearer(SEARCH_TOKEN, **objective("batch")))
        agreeing = await post(
            headers=bearer(SEARCH_TOKEN, **objective("batch"), **{PRIORITY_HEADER: "batch"})
        )
        contradicting = await post(
            headers=bearer(SEARCH_TOKEN, **objective("batch"), **{PRIORITY_HEADER: "interactive"})
        )
        assert server.metrics_port is not None
        metrics = await scrape(server.metrics_port)
    assert [forwarded.status, objective_alone.status, agreeing.status] == [200, 200, 200]
    for refused, header, reason in (
        (posing, FAIRNESS_ID_HEADER, CALLER_MISMATCH),
        (unknown, FAIRNESS_ID_HEADER, UNKNOWN_CALLER),
        (contradicting, OBJECTIVE_HEADER, PRIORITY_MISMATCH),
    ):
        assert refused.status == 400
        assert refused.error()["param"] == header
        assert refused.error()["code"] == reason.lower()
    assert requests_of(metrics, caller="search", outcome="ok") == 3
    assert requests_of(metrics, caller="inference-gateway") == 1  # the unknown name's refusal

"""What the inference-gateway overlay relies on in the server, checked against a real one.

No cluster, gateway or endpoint picker runs here. A real server is started from the pod
environment of the rendered overlay (loopback, free ports, the token file written here) and is
called the way the gateway forwards calls: plaintext HTTP/2 gRPC (the pool's h2c), the
gateway's bearer token, the picker's fairness and objective headers. The picker's own view of a
pod is reproduced from the metric specs in the overlay's picker configuration, read from the
server's real /metrics the way the picker's core-metrics-extractor reads them (the metric by
name, the first series whose labels match): waiting requests, running requests and KV-cache use
are followed through a queue that a step gate holds, a batch that decodes, and an empty engine.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.support.manifests import GATEWAY_OVERLAY, Rendered, render
from tests.support.polling import wait_until
from tests.support.prometheus import scrape
from tests.support.servers import serving
from tests.support.stepping import StepGate
from tokenwire.server import settings_sources
from tokenwire.server.cli import build_parser
from tokenwire.server.config import ServerSettings
from tokenwire.server.security.gateway_headers import FAIRNESS_ID_HEADER, OBJECTIVE_HEADER
from tokenwire.v1 import inference_service_pb2 as pb
from tokenwire.v1 import inference_service_pb2_grpc as pb_grpc

GATEWAY_TOKEN = "inference-gateway-Lp3z-secret"
TOKENS = f"inference-gateway {GATEWAY_TOKEN}\nsearch search-Fq8r-secret\nreports reports-Vt2m-secret\n"
GENERATED = 24


@dataclass(frozen=True)
class PickerView:
    """A pod as the endpoint picker sees it."""

    waiting: int
    running: int
    kv_cache: float


@pytest.fixture(scope="module")
def gateway() -> Rendered:
    return Rendered(GATEWAY_OVERLAY, render(GATEWAY_OVERLAY))


@pytest.fixture
def pod_settings(gateway: Rendered, tiny_model_dir: Path, tmp_path: Path) -> Callable[..., ServerSettings]:
    """Settings from the pod's environment, as `tokenwire serve --model DIR` reads them."""
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKENS, encoding="utf-8")

    def load(**replaced: str) -> ServerSettings:
        args = build_parser().parse_args(["serve", "--model", f"tiny={tiny_model_dir}"])
        environ: Mapping[str, str] = {
            **gateway.env,
            "TOKENWIRE_AUTH_TOKENS_FILE": str(tokens),
            "TOKENWIRE_HOST": "127.0.0.1",
            "TOKENWIRE_METRICS_HOST": "127.0.0.1",
            "TOKENWIRE_PORT": "0",
            "TOKENWIRE_METRICS_PORT": "0",
            "TOKENWIRE_HEALTH_PORT": "0",
            "TOKENWIRE_INTRA_OP_THREADS": "1",
            **replaced,
        }
        return settings_sources.load(args, environ)

    return load


def picker_specs(gateway: Rendered) -> dict[str, str]:
    """The metric spec of each figure the picker reads, from the overlay's picker configuration."""
    (config_map,) = (o for o in gateway.all("ConfigMap") if o["metadata"]["name"].startswith("tokenwire-"))
    (text,) = config_map["data"].values()
    plugins = {p.get("name", p["type"]): p for p in yaml.safe_load(text)["plugins"]}
    (engine,) = plugins["core-metrics-extractor"]["parameters"]["engineConfigs"]
    return {
        "waiting": engine["queuedRequestsSpec"],
        "running": engine["runningRequestsSpec"],
        "kv_cache": engine["kvUsageSpec"],
    }


_SPEC = re.compile(r"^\s*(\w[\w:]*)\s*(?:\{([^}]*)\})?\s*$")


def picker_reads(page: str, spec: str) -> float:
    """What the picker's core-metrics-extractor takes from `page` for `spec` (PromQL selector
    syntax, name{label=value,...}): the first series of that metric whose labels match."""
    parsed = _SPEC.match(spec)
    assert parsed is not None, spec
    name, label_block = parsed.group(1), parsed.group(2) or ""
    wanted = {}
    for pair in filter(None, (part.strip() for part in label_block.split(","))):
        key, _, value = pair.partition("=")
        wanted[key.strip()] = value.strip().strip('"')
    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in wanted.items()):
                return float(sample.value)
    raise AssertionError(f"the picker finds no series for {spec!r}: it would not update the pod")


async def picker_view(port: int, specs: dict[str, str]) -> PickerView:
    page = (await scrape(port)).text
    return PickerView(
        waiting=int(picker_reads(page, specs["waiting"])),
        running=int(picker_reads(page, specs["running"])),
        kv_cache=picker_reads(page, specs["kv_cache"]),
    )


async def picker_view_once(
    port: int, specs: dict[str, str], condition: Callable[[PickerView], bool], what: str
) -> PickerView:
    """The picker's view as soon as `condition` holds (the engine reaches states the test
    awaits, but its metrics follow within a round and the page is rendered at most every
    TOKENWIRE_METRICS_CACHE_SECONDS); fails after 20 s."""
    seen = None
    for _ in range(1000):
        seen = await picker_view(port, specs)
        if condition(seen):
            return seen
        await asyncio.sleep(0.02)
    raise AssertionError(f"the picker never saw {what}; last {seen}")


def request(**headers: str) -> tuple[pb.GenerateRequest, tuple[tuple[str, str], ...]]:
    message = pb.GenerateRequest(
        prompt="Once upon a time", stopping=pb.StoppingCriteria(max_new_tokens=GENERATED, ignore_eos=True)
    )
    return message, (("authorization", f"Bearer {GATEWAY_TOKEN}"), *headers.items())


async def test_the_pickers_waiting_running_and_kv_figures_follow_a_real_server_under_concurrent_calls(
    gateway: Rendered, pod_settings: Callable[..., ServerSettings]
) -> None:
    specs = picker_specs(gateway)
    # Two slots, so a handful of calls fill the batch and the queue; preemption off, so the
    # running set (and the KV cache it holds) changes only when the test lets a step run.
    settings = pod_settings(
        TOKENWIRE_MAX_BATCH_SIZE="2", TOKENWIRE_PREEMPTION="false", TOKENWIRE_STALL_FREE="false"
    )
    # The pool's appProtocol is h2c: the pod serves gRPC without TLS, behind the gateway.
    assert not settings.tls.enabled and settings.auth.enabled
    gate = StepGate()
    finished: list[str] = []
    async with serving(settings, gate=gate) as server:
        engine = server.registry.default.engine
        assert server.metrics_port is not None
        port = server.metrics_port
        idle = await picker_view(port, specs)
        assert idle == PickerView(0, 0, 0.0)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.InferenceServiceStub(channel)

            async def call(name: str, caller: str, objective: str | None = None) -> None:
                headers = {FAIRNESS_ID_HEADER: caller}
                if objective is not None:
                    headers[OBJECTIVE_HEADER] = objective
                message, metadata = request(**headers)
                answer = await stub.Generate(message, metadata=metadata)
                assert answer.usage.completion_tokens == GENERATED
                finished.append(name)

            calls = [asyncio.ensure_future(call("a", "search")), asyncio.ensure_future(call("b", "reports"))]
            await wait_until(lambda: engine.live_count == 2, what="both calls to reach the engine")
            if engine.queue_depth == 1:
                # The first call's round began before the second arrived: that round's step
                # must run before the next round gives the second call the other slot.
                gate.allow(1)
                await wait_until(lambda: engine.queue_depth == 0, what="the second call to take a slot")
            # A round reports the batch after its decode step: let the step of the round that
            # holds both run.
            gate.allow(1)
            await picker_view_once(
                port, specs, lambda v: (v.waiting, v.running) == (0, 2), "both calls running"
            )
            later = (("c", "search", "batch"), ("d", "reports", None), ("e", "search", "interactive"))
            for name, caller, objective in later:
                calls.append(asyncio.ensure_future(call(name, caller, objective)))
            full = await picker_view_once(
                port, specs, lambda v: v.waiting == 3, "three calls waiting behind the running two"
            )
            assert (full.waiting, full.running) == (3, 2)
            assert 0 < full.kv_cache <= 1
            # A pod serving several models is read per model, as docs/deploy.md says.
            by_model = {figure: spec + '{gen_ai_request_model="tiny"}' for figure, spec in specs.items()}
            assert await picker_view(port, by_model) == full
            with pytest.raises(AssertionError, match="no series"):
                await picker_view(
                    port, {figure: spec + "{gen_ai_request_model=other}" for figure, spec in specs.items()}
                )

            gate.allow(4)  # four decode steps of the two running sequences: more KV positions held
            decoding = await picker_view_once(
                port, specs, lambda v: v.kv_cache > full.kv_cache, "the KV use grow"
            )
            assert (decoding.waiting, decoding.running) == (3, 2)
            assert decoding.kv_cache <= 1

            gate.open()
            await asyncio.gather(*calls)
        drained = await picker_view_once(port, specs, lambda v: v == PickerView(0, 0, 0.0), "an empty pod")
    assert drained == idle
    # The objective header set each call's priority: interactive and default took the two slots
    # the first calls left, batch went last.
    assert set(finished[:2]) == {"a", "b"}
    assert set(finished[2:4]) == {"d", "e"}
    assert finished[4] == "c"


async def test_calls_the_gateway_forwards_run_as_the_caller_its_fairness_header_names(
    pod_settings: Callable[..., ServerSettings],
) -> None:
    async with serving(pod_settings()) as server:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.InferenceServiceStub(channel)
            for caller in ("search", "search", "reports"):
                message, metadata = request(**{FAIRNESS_ID_HEADER: caller})
                message.stopping.max_new_tokens = 2
                await stub.Generate(message, metadata=metadata)
        assert server.metrics_port is not None
        metrics = await scrape(server.metrics_port)
    served = {
        caller: sum(
            value
            for (name, labels), value in metrics.samples.items()
            if name == "tokenwire_server_requests_total" and ("caller", caller) in labels
        )
        for caller in ("search", "reports", "inference-gateway")
    }
    assert served == {"search": 2, "reports": 1, "inference-gateway": 0}

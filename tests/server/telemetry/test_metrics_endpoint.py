"""The real /metrics endpoint: names, units, and numbers that agree with the responses' own timing."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from tests.conftest import tiny_settings
from tests.support.events import Transcript, read_until
from tests.support.options import greedy
from tests.support.polling import wait_until
from tests.support.prometheus import scrape
from tests.support.servers import serving
from tests.support.stepping import StepGate
from tokenwire.client import AsyncClient, Completed, GenerateOptions, Sampling, TokenwireError
from tokenwire.server.api.stream_limits import StreamLimits
from tokenwire.server.config import TelemetrySettings

MODEL = "tiny"
OK = {"gen_ai_request_model": MODEL, "outcome": "ok"}
BY_MODEL = {"gen_ai_request_model": MODEL}


def with_metrics(**overrides: object) -> TelemetrySettings:
    # Every scrape renders afresh: these tests read numbers right after the requests that made them.
    return TelemetrySettings(metrics_port=0, metrics_cache_seconds=0, **overrides)  # type: ignore[arg-type]


async def test_histograms_and_counters_agree_with_the_response_timing(tiny_model_dir: Path) -> None:
    async with serving(tiny_settings(tiny_model_dir, telemetry=with_metrics())) as server:
        assert server.metrics_port
        async with AsyncClient(f"127.0.0.1:{server.port}", retries=False) as client:
            result = await client.generate("Count the stars", greedy(8))
        metrics = await scrape(server.metrics_port)
        engine = server.registry.default.engine

    timing = result.timing
    assert timing.time_to_first_token is not None and timing.prefill is not None
    assert timing.time_per_output_token is not None
    for name, expected, labels in (
        ("gen_ai_server_request_duration_seconds", timing.total, OK),
        ("gen_ai_server_time_to_first_token_seconds", timing.time_to_first_token, BY_MODEL),
        ("gen_ai_server_time_per_output_token_seconds", timing.time_per_output_token, BY_MODEL),
        ("tokenwire_server_queue_duration_seconds", timing.queued, BY_MODEL),
        ("tokenwire_server_prefill_duration_seconds", timing.prefill, BY_MODEL),
    ):
        assert metrics.value(f"{name}_count", **labels) == 1, name
        # The response carries nanosecond Durations; the histogram the same float seconds.
        assert metrics.value(f"{name}_sum", **labels) == pytest.approx(expected, abs=2e-9), name
        assert metrics.value(f"{name}_bucket", le="+Inf", **labels) == 1, name
    assert metrics.value("tokenwire_server_requests_total", **OK, caller="anonymous") == 1
    assert metrics.value("tokenwire_server_prompt_tokens_total", **BY_MODEL) == result.prompt_tokens
    assert (
        metrics.value("tokenwire_server_generated_tokens_total", **BY_MODEL) == result.completion_tokens == 8
    )
    assert metrics.value("tokenwire_engine_decode_steps_total", **BY_MODEL) == engine.stats.decode_steps >= 7
    prefilled = metrics.value("tokenwire_engine_prefilled_tokens_total", **BY_MODEL)
    assert prefilled == engine.stats.prefill_tokens == result.prompt_tokens
    # Nothing is waiting or running once the request has finished.
    assert metrics.value("tokenwire_engine_queue_depth", **BY_MODEL) == 0
    assert metrics.value("tokenwire_engine_batch_size", **BY_MODEL) == 0
    assert metrics.value("tokenwire_engine_kv_cache_usage", **BY_MODEL) == 0
    assert metrics.value("tokenwire_engine_slots_usage", **BY_MODEL) == 0
    assert any(
        line.startswith("target_info{") and 'service_name="tokenwire"' in line
        for line in metrics.text.splitlines()
    )


async def test_gauges_show_the_queue_and_the_running_batch(tiny_model_dir: Path) -> None:
    gate = StepGate()
    settings = tiny_settings(tiny_model_dir, max_batch_size=2, telemetry=with_metrics())
    async with serving(settings, gate=gate) as server:
        assert server.metrics_port
        engine = server.registry.default.engine
        transcript = Transcript()
        async with (
            AsyncClient(f"127.0.0.1:{server.port}", retries=False) as client,
            client.open_stream() as stream,
        ):
            events = stream.events()
            # The gate holds every decode step, so each admission happens at a known point.
            await stream.submit("a", "First in", greedy(50))
            await read_until(events, transcript, lambda t: len(t.tokens("a")) >= 1)
            await stream.submit("b", "Second in", greedy(50))
            await read_until(events, transcript, lambda t: bool(t.events["b"]))  # queued in the engine
            gate.allow(1)  # a's step ends the round; the next one admits b and prefills it
            await read_until(events, transcript, lambda t: len(t.tokens("b")) >= 1)
            for request_id in ("c", "d", "e"):
                await stream.submit(request_id, "Wait your turn", greedy(50))
            await read_until(events, transcript, lambda t: all(t.events[r] for r in "cde"))
            gate.allow(1)  # a and b decode together; the round reports its occupancy
            await read_until(events, transcript, lambda t: len(t.tokens("b")) >= 2)
            during = await scrape(server.metrics_port)
            for request_id in "abcde":
                await stream.cancel(request_id)
            gate.open()
            await read_until(events, transcript, lambda t: all(t.finished(r) for r in "abcde"))
        await wait_until(lambda: engine.live_count == 0, what="the engine to empty")
        after = await scrape(server.metrics_port)

    assert during.value("tokenwire_engine_queue_depth", **BY_MODEL) == 3
    assert during.value("tokenwire_engine_batch_size", **BY_MODEL) == 2
    assert during.value("tokenwire_engine_slots_usage", **BY_MODEL) == 2 / engine.slots
    # Two short sequences hold a small part of the positions two slots may fill.
    assert 0 < during.value("tokenwire_engine_kv_cache_usage", **BY_MODEL) < 2 / engine.slots
    assert after.value("tokenwire_engine_queue_depth", **BY_MODEL) == 0
    assert after.value("tokenwire_engine_batch_size", **BY_MODEL) == 0
    assert (
        after.value(
            "tokenwire_server_requests_total",
            gen_ai_request_model=MODEL,
            outcome="cancelled",
            caller="anonymous",
        )
        == 5
    )


async def test_every_outcome_is_counted_once_where_it_happens(tiny_model_dir: Path) -> None:
    gate = StepGate()
    settings = tiny_settings(
        tiny_model_dir,
        max_batch_size=1,
        max_queue_size=1,
        telemetry=with_metrics(),
        # "running" may still be waiting for its slot when "queued" arrives on the same stream.
        stream=StreamLimits(max_queued_per_stream=2),
    )
    codes: list[grpc.StatusCode] = []
    async with serving(settings, gate=gate) as server:
        assert server.metrics_port
        engine = server.registry.default.engine
        transcript = Transcript()
        async with (
            AsyncClient(f"127.0.0.1:{server.port}", retries=False) as client,
            client.open_stream() as stream,
        ):
            for bad in (GenerateOptions(sampling=Sampling(temperature=-1.0)), GenerateOptions(model="nope")):
                with pytest.raises(TokenwireError) as invalid:
                    await client.generate("Hi", bad)
                codes.append(invalid.value.code)
            events = stream.events()
            await stream.submit("running", "Holds the only slot", greedy(100))
            await stream.submit("queued", "Holds the only queue place", greedy(100))
            await read_until(events, transcript, lambda t: len(t.tokens("running")) >= 1)
            await read_until(events, transcript, lambda t: bool(t.events["queued"]))
            with pytest.raises(TokenwireError) as rejected:
                await client.generate("No room", greedy(4))
            codes.append(rejected.value.code)
            await stream.cancel("queued")
            await wait_until(lambda: engine.stats.abort_requests == 1, what="the cancel to reach the engine")
            gate.allow(1)
            await read_until(events, transcript, lambda t: t.finished("queued"))
            with pytest.raises(TokenwireError) as late:
                await client.generate("Too slow", greedy(4), deadline=0.2)  # queued behind "running"
            codes.append(late.value.code)
            await stream.cancel("running")
            gate.open()
            await read_until(events, transcript, lambda t: t.finished("running"))
            await wait_until(lambda: engine.live_count == 0, what="the engine to empty")
            done = await client.generate("Finally", greedy(3))
        metrics = await scrape(server.metrics_port)

    assert codes == [
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    ]
    assert isinstance(transcript.final("queued"), Completed)
    assert done.completion_tokens == 3

    def requests(outcome: str, model: str = MODEL) -> float:
        return metrics.value(
            "tokenwire_server_requests_total", gen_ai_request_model=model, outcome=outcome, caller="anonymous"
        )

    # The unknown model resolves to no served model: it is counted without one.
    assert requests("invalid") == 1 and requests("invalid", model="") == 1
    assert requests("rejected") == 1
    assert requests("cancelled") == 2
    assert requests("deadline") == 1
    assert requests("ok") == 1
    # Refusals never reached the engine: only the three it finished have durations.
    finished = sum(
        metrics.value("gen_ai_server_request_duration_seconds_count", gen_ai_request_model=MODEL, outcome=o)
        for o in ("ok", "cancelled", "deadline")
    )
    assert finished == 4 == engine.stats.finished


async def test_metrics_can_be_left_off(tiny_model_dir: Path) -> None:
    async with serving(tiny_settings(tiny_model_dir)) as server:
        assert server.metrics_port is None
        assert server.telemetry.metrics is None

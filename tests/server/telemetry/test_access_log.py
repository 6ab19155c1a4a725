"""One access-log line per request, in text or JSON, with the request's own timings and trace id."""

from __future__ import annotations

import io
import json
import logging
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tests.conftest import tiny_settings
from tests.support.servers import serving
from tokenwire.client import AsyncClient, GenerateOptions, Sampling, Stopping, TokenwireError
from tokenwire.server.telemetry.access_log import ACCESS_LOGGER
from tokenwire.server.telemetry.logs import TextFormatter
from tokenwire.v1 import inference_service_pb2 as pb
from tokenwire.v1 import inference_service_pb2_grpc as pb_grpc

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
TRACEPARENT = (("traceparent", f"00-{TRACE_ID}-b7ad6b7169203331-01"),)


def entries(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


async def test_each_request_writes_one_json_line_with_its_outcome_and_timings(
    tiny_model_dir: Path, access_lines: io.StringIO
) -> None:
    options = GenerateOptions(sampling=Sampling(temperature=0.0), stopping=Stopping(5, ignore_eos=True))
    async with (
        serving(tiny_settings(tiny_model_dir)) as server,
        AsyncClient(f"127.0.0.1:{server.port}", retries=False) as client,
    ):
        result = await client.generate("Hello there", options, request_id="logged-1")
        with pytest.raises(TokenwireError):
            await client.generate("Hello", GenerateOptions(model="absent"), request_id="logged-2")

    first, second = entries(access_lines)
    assert first["message"] == "Generate ok"
    assert first["logger"] == ACCESS_LOGGER and first["level"] == "INFO"
    assert first["request_id"] == "logged-1"
    assert first["model"] == "tiny"
    assert first["outcome"] == "ok" and first["code"] == "OK"
    assert first["finish_reason"] == "length"
    assert first["prompt_tokens"] == result.prompt_tokens
    assert first["completion_tokens"] == result.completion_tokens == 5
    timing = result.timing
    assert first["total_ms"] == pytest.approx(timing.total * 1000, abs=1e-5)
    assert first["queued_ms"] == pytest.approx(timing.queued * 1000, abs=1e-5)
    assert first["ttft_ms"] == pytest.approx((timing.time_to_first_token or 0) * 1000, abs=1e-5)
    assert first["prefill_ms"] == pytest.approx((timing.prefill or 0) * 1000, abs=1e-5)
    assert first["paced_ms"] == pytest.approx((timing.paced or 0) * 1000, abs=1e-5)
    assert first["cached_prompt_tokens"] == result.cached_prompt_tokens
    assert first["tpot_ms"] == pytest.approx((timing.time_per_output_token or 0) * 1000, abs=1e-5)
    assert first["trace_id"] is None  # no caller trace and no tracing

    assert second["request_id"] == "logged-2"
    assert second["outcome"] == "invalid"
    assert second["code"] == "NOT_FOUND" and second["reason"] == "MODEL_NOT_FOUND"
    assert second["model"] == ""


async def test_the_line_carries_the_trace_id_of_the_requests_span(
    tiny_model_dir: Path, access_lines: io.StringIO
) -> None:
    spans = InMemorySpanExporter()
    async with (
        serving(tiny_settings(tiny_model_dir), span_exporter=spans) as server,
        grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel,
    ):
        stub = pb_grpc.InferenceServiceStub(channel)
        await stub.Generate(pb.GenerateRequest(request_id="with-parent", prompt="Hi"), metadata=TRACEPARENT)
        await stub.Generate(pb.GenerateRequest(request_id="own-trace", prompt="Hi"))

    lines = {str(entry["request_id"]): entry for entry in entries(access_lines)}
    spans_by_id = {(s.attributes or {}).get("tokenwire.request_id"): s for s in spans.get_finished_spans()}
    assert lines["with-parent"]["trace_id"] == TRACE_ID
    own = spans_by_id["own-trace"]
    assert lines["own-trace"]["trace_id"] == format(own.context.trace_id, "032x") != TRACE_ID


def test_the_text_format_quotes_values_so_a_request_id_cannot_forge_a_line() -> None:
    record = logging.LogRecord(ACCESS_LOGGER, logging.INFO, __file__, 1, "Generate ok", None, None)
    record.fields = {"request_id": "evil\n2024-01-01 INFO forged", "model": "tiny", "total_ms": 12.5}
    line = TextFormatter("%(message)s").format(record)
    assert "\n" not in line
    assert line == 'Generate ok request_id="evil\\n2024-01-01 INFO forged" model=tiny total_ms=12.5'


def test_serve_with_json_logs_writes_only_json_lines(tiny_model_dir: Path) -> None:
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tokenwire.server.cli",
            "serve",
            "--model",
            f"tiny={tiny_model_dir}",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--no-metrics",
            "--device",
            "cpu",
            "--intra-op-threads",
            "1",
            "--log-format",
            "json",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        port = next(int(line.rsplit(":", 1)[1]) for line in process.stdout if "serving on" in line)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            pb_grpc.InferenceServiceStub(channel).Generate(
                pb.GenerateRequest(request_id="from-process", prompt="Hi"), timeout=30
            )
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0
    logged = [json.loads(line) for line in stderr.splitlines() if line.strip()]
    assert {"time", "level", "logger", "message"} <= set(logged[0])
    access = [entry for entry in logged if entry["logger"] == ACCESS_LOGGER]
    assert [entry["request_id"] for entry in access] == ["from-process"]
    assert access[0]["outcome"] == "ok"
    assert any("draining" in str(entry["message"]) for entry in logged)

"""ORCA load reports from a real server: the out-of-band StreamCoreMetrics stream follows the load.

The per-call trailer `endpoint-load-metrics-bin` is consumed by gRPC's C-core client (its load
balancers read it) and never reaches Python code, so tests/interop reads it with buf curl, and
tests/client/test_fleet.py shows a weighted round robin client acting on it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration
from google.rpc import error_details_pb2, status_pb2

from tests.conftest import tiny_settings
from tests.support.events import Transcript, read_until
from tests.support.options import greedy
from tests.support.polling import wait_until
from tests.support.servers import serving
from tests.support.stepping import StepGate
from tokenwire.client import AsyncClient
from tokenwire.server.api.orca import ORCA_SERVICE, report_interval
from tokenwire.server.api.orca_messages import OrcaLoadReport, OrcaLoadReportRequest
from tokenwire.server.config import AuthSettings
from tokenwire.server.engine.errors import ErrorKind, GenerationError

STREAM_CORE_METRICS = f"/{ORCA_SERVICE}/StreamCoreMetrics"
MIN_INTERVAL = 0.05
MAX_REPORTS = 200
"""Reports to read while waiting for one that shows a change: 10 s at MIN_INTERVAL."""


def open_reports(channel: grpc.aio.Channel, interval: Duration | None = None) -> grpc.aio.UnaryStreamCall:
    method = channel.unary_stream(
        STREAM_CORE_METRICS,
        request_serializer=OrcaLoadReportRequest.SerializeToString,
        response_deserializer=OrcaLoadReport.FromString,
    )
    request = OrcaLoadReportRequest()
    if interval is not None:
        # The request's Duration type lives in the ORCA messages' own pool: copy it over the wire.
        request.report_interval.MergeFromString(interval.SerializeToString())
    return method(request)


async def read_report_until(
    reports: grpc.aio.UnaryStreamCall, condition: Callable[[OrcaLoadReport], bool]
) -> OrcaLoadReport:
    for _ in range(MAX_REPORTS):
        report = await reports.read()
        assert report is not grpc.aio.EOF
        if condition(report):
            return report
    raise AssertionError(f"none of {MAX_REPORTS} load reports met the condition; last: {report}")


async def test_out_of_band_reports_follow_occupancy_queue_and_completions(tiny_model_dir: Path) -> None:
    gate = StepGate()
    settings = tiny_settings(
        tiny_model_dir, max_batch_size=2, max_queue_size=8, load_report_min_interval=MIN_INTERVAL
    )
    async with (
        serving(settings, gate=gate) as server,
        grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel,
        AsyncClient(f"127.0.0.1:{server.port}", retries=False) as client,
        client.open_stream() as stream,
    ):
        reports = open_reports(channel, Duration(nanos=1_000_000))  # asks for 1 ms: gets MIN_INTERVAL
        idle = await reports.read()
        assert idle.application_utilization == 0.0
        assert idle.named_metrics["queue_depth"] == 0.0
        assert idle.rps_fractional == 0.0

        # Two generations hold both slots, two more queue. The engine takes one prompt per round
        # and reports occupancy as a round ends, so let decode steps through one at a time until
        # a round has reported that state; the gate then holds it there.
        transcript = Transcript()
        events = stream.events()
        for request_id in ("a", "b", "c", "d"):
            await stream.submit(request_id, "Load", greedy(40))
        await read_until(events, transcript, lambda t: all(t.events[r] for r in "abcd"))
        engine = server.registry.default.engine
        tracker = server.load_tracker
        for _ in range(10):
            if (tracker.snapshot().running, tracker.snapshot().queued) == (2, 2):
                break
            steps = engine.stats.decode_steps
            gate.allow(1)
            await wait_until(lambda: engine.stats.decode_steps > steps, what="one decode step")  # noqa: B023
            await wait_until(lambda: tracker.snapshot().running > 0, what="a round's occupancy report")

        busy = await read_report_until(reports, lambda r: r.named_metrics["queue_depth"] == 2.0)
        assert busy.application_utilization == pytest.approx(4 / 2)  # (2 running + 2 queued) / 2 slots
        assert busy.named_metrics["running"] == 2.0
        assert 0.0 < busy.named_metrics["kv_cache_utilization"] < 1.0  # two short sequences

        gate.open()
        await read_until(events, transcript, lambda t: all(t.finished(r) for r in "abcd"))
        after = await read_report_until(reports, lambda r: r.application_utilization == 0.0)
        assert after.rps_fractional > 0.0  # four requests finished within the window
        assert after.named_metrics["queue_depth"] == 0.0
        reports.cancel()
        await stream.close_requests()


async def test_a_negative_report_interval_is_invalid_argument_naming_the_field(tiny_model_dir: Path) -> None:
    async with (
        serving(tiny_settings(tiny_model_dir)) as server,
        grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel,
    ):
        reports = open_reports(channel, Duration(seconds=-1))
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await reports.read()
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = dict(caught.value.trailing_metadata() or ())["grpc-status-details-bin"]
    status = status_pb2.Status.FromString(details)
    bad_request = error_details_pb2.BadRequest()
    assert status.details[0].Unpack(bad_request)
    assert [v.field for v in bad_request.field_violations] == ["report_interval"]


def test_the_report_interval_is_the_clients_but_never_below_the_minimum() -> None:
    assert report_interval(Duration(), 1.0) == 1.0  # unset
    assert report_interval(Duration(nanos=500_000_000), 1.0) == 1.0
    assert report_interval(Duration(seconds=5, nanos=500_000_000), 1.0) == 5.5
    with pytest.raises(GenerationError) as caught:
        report_interval(Duration(seconds=-2), 1.0)
    assert caught.value.kind is ErrorKind.INVALID_ARGUMENT


async def test_load_reports_need_no_token_unless_health_needs_one(
    tiny_model_dir: Path,
) -> None:
    # gRPC clients open the report stream per replica on their own, without the caller's metadata.
    settings = tiny_settings(tiny_model_dir, auth=AuthSettings(tokens=("a-token",)))
    async with (
        serving(settings) as server,
        grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel,
    ):
        report = await open_reports(channel).read()
    assert report.named_metrics["queue_depth"] == 0.0
    protected = replace(settings, auth=AuthSettings(tokens=("a-token",), protect_health=True))
    async with (
        serving(protected) as server,
        grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel,
    ):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await open_reports(channel).read()
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED

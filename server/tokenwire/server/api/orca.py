"""ORCA load reports (gRPC proposals A51 and A58), so gRPC clients can weigh replicas by load.

Two channels carry the same report (`xds.data.orca.v3.OrcaLoadReport`, built in `orca_messages`;
grpc Python has no ORCA server API of its own):

- Out of band: `xds.service.orca.v3.OpenRcaService/StreamCoreMetrics` streams a report right
  away and then once per interval the client asks for, never more often than the server's
  minimum. A `weighted_round_robin` client with `enableOobLoadReport` opens one such stream per
  replica and weighs it by the latest report.
- Per call: the `endpoint-load-metrics-bin` trailer of every successful Generate, GenerateStream
  and StreamGenerate, for clients that take weights from their own calls' trailers instead.

The report: `application_utilization` is the engines' occupancy, (running + queued) / slots;
`rps_fractional` is requests finished per second; `named_metrics` carries `queue_depth`,
`running` and `kv_cache_utilization`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import grpc
from google.protobuf import duration_pb2
from google.protobuf.message import Message

from tokenwire.server.api import errors
from tokenwire.server.api.decoding import UndecodableRequest, tolerant
from tokenwire.server.api.orca_messages import SERVICE_NAME, OrcaLoadReport, OrcaLoadReportRequest
from tokenwire.server.engine.errors import FieldViolation, GenerationError
from tokenwire.server.load import LoadSnapshot, LoadTracker
from tokenwire.server.method_handlers import Continuation, Streaming, Unary, rewrapped

ORCA_SERVICE = SERVICE_NAME
TRAILER = "endpoint-load-metrics-bin"


def load_report(snapshot: LoadSnapshot) -> Message:
    report: Message = OrcaLoadReport(
        application_utilization=snapshot.utilization,
        rps_fractional=snapshot.qps,
        named_metrics={
            "queue_depth": float(snapshot.queued),
            "running": float(snapshot.running),
            "kv_cache_utilization": snapshot.kv_cache_utilization,
        },
    )
    return report


def report_interval(asked: duration_pb2.Duration, minimum: float) -> float:
    """Seconds between out-of-band reports: what the client asked for, but at least `minimum`.

    Unset or shorter means the minimum (A58), so no client can make the server spend its event
    loop on reports. Raises INVALID_ARGUMENT for a negative interval.
    """
    if asked.seconds < 0 or asked.nanos < 0:
        raise GenerationError.invalid(FieldViolation("report_interval", "must not be negative"))
    return max(minimum, asked.seconds + asked.nanos / 1e9)


class OrcaService:
    """OpenRcaService: one load report stream per caller, at the caller's interval."""

    def __init__(self, tracker: LoadTracker, *, min_interval: float) -> None:
        self._tracker = tracker
        self._min_interval = min_interval

    async def StreamCoreMetrics(  # noqa: N802
        self,
        request: Any,
        context: grpc.aio.ServicerContext,  # OrcaLoadReportRequest or UndecodableRequest
    ) -> AsyncIterator[Message]:
        if isinstance(request, UndecodableRequest):
            await errors.abort(context, request.error())
            return
        try:
            interval = report_interval(request.report_interval, self._min_interval)
        except GenerationError as error:
            await errors.abort(context, error)
            return
        while True:
            yield load_report(self._tracker.snapshot())
            await asyncio.sleep(interval)


def add_orca_service(service: OrcaService, server: grpc.aio.Server) -> None:
    handlers = {
        "StreamCoreMetrics": grpc.unary_stream_rpc_method_handler(
            service.StreamCoreMetrics,
            request_deserializer=tolerant(OrcaLoadReportRequest.FromString, "OrcaLoadReportRequest"),
            response_serializer=OrcaLoadReport.SerializeToString,
        )
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(ORCA_SERVICE, handlers),))


class LoadReportTrailers(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Adds the `endpoint-load-metrics-bin` trailer to calls of `methods` that end normally.

    A call that aborts keeps only its error trailers (rich status details), which a load report
    must not replace.
    """

    def __init__(self, tracker: LoadTracker, methods: frozenset[str]) -> None:
        self._tracker = tracker
        self._methods = methods

    async def intercept_service(
        self, continuation: Continuation, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method not in self._methods:
            return handler
        return rewrapped(handler, unary=self._unary, streaming=self._streaming)

    def _unary(self, behavior: Unary) -> Unary:
        async def with_trailer(request: Any, context: grpc.aio.ServicerContext) -> Any:
            response = await behavior(request, context)
            self._add_trailer(context)
            return response

        return with_trailer

    def _streaming(self, behavior: Streaming) -> Streaming:
        async def with_trailer(requests: Any, context: grpc.aio.ServicerContext) -> AsyncGenerator[Any, None]:
            async with contextlib.aclosing(behavior(requests, context)) as responses:  # see Streaming
                async for response in responses:
                    yield response
            self._add_trailer(context)

        return with_trailer

    def _add_trailer(self, context: grpc.aio.ServicerContext) -> None:
        report = load_report(self._tracker.snapshot()).SerializeToString()
        existing = tuple(context.trailing_metadata() or ())
        context.set_trailing_metadata((*existing, (TRAILER, report)))

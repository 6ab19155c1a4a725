"""Per-request telemetry at the API edge: a record follows one request from receipt to its end.

The edge knows what the engine's observer cannot: the request id, the caller's trace context,
and requests refused before they reached the engine. When a request ends its record emits the
span (when tracing is on), the access-log line, and, for a refusal, the outcome count that the
engine's observer never sees. The record takes the request's events as they are delivered; it
only looks at Started, the first token and the final event, and records nothing per token.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from tokenwire.server.engine.errors import ErrorKind, GenerationError
from tokenwire.server.engine.types import (
    Completed,
    EngineEvent,
    Failed,
    FinishReason,
    GenerationResult,
    Started,
    TokensGenerated,
)
from tokenwire.server.engine.validation import RequestSpec
from tokenwire.server.telemetry.access_log import AccessLog
from tokenwire.server.telemetry.metrics import ServerMetrics
from tokenwire.server.telemetry.summary import RequestParameters, RequestSummary, Stages
from tokenwire.server.telemetry.tracing import Metadata, RequestTracer, caller_context, trace_id_of

log = logging.getLogger(__name__)

_REFUSAL_OUTCOMES = {
    ErrorKind.INVALID_ARGUMENT: "invalid",
    ErrorKind.NOT_FOUND: "invalid",
    ErrorKind.RESOURCE_EXHAUSTED: "rejected",
    ErrorKind.UNAVAILABLE: "rejected",
    ErrorKind.UNAUTHENTICATED: "unauthenticated",
    ErrorKind.DEADLINE_EXCEEDED: "deadline",
    ErrorKind.INTERNAL: "error",
}
"""Outcomes of requests refused at the edge, before the engine accepted them."""

_FAILURE_OUTCOMES = {
    ErrorKind.DEADLINE_EXCEEDED: "deadline",
    ErrorKind.UNAVAILABLE: "unavailable",
}
"""Outcomes of requests the engine accepted and then failed (the engine observer's names)."""


class RequestTelemetry:
    """Hands out a record per request; with nothing to emit, records cost next to nothing."""

    def __init__(
        self,
        *,
        metrics: ServerMetrics | None = None,
        tracer: RequestTracer | None = None,
        access_log: AccessLog | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.metrics = metrics
        self.tracer = tracer
        self.access_log = access_log
        self.clock = clock
        self.enabled = metrics is not None or tracer is not None or access_log is not None

    def begin(self, method: str, metadata: Metadata | None, received: float) -> RequestRecord:
        return RequestRecord(self, method, metadata, received)

    def refuse_call(self, method: str, metadata: Metadata | None, error: GenerationError) -> None:
        """A call refused before any request in it was read (authentication, a draining server)."""
        self.begin(method, metadata, self.clock()).refused(error)


class RequestRecord:
    def __init__(
        self, owner: RequestTelemetry, method: str, metadata: Metadata | None, received: float
    ) -> None:
        self._owner = owner
        self._method = method
        self._metadata = metadata
        self._received = received
        self._received_wall_ns = time.time_ns() - round((owner.clock() - received) * 1e9)
        self._request_id = ""
        self._model = ""
        self._parameters: RequestParameters | None = None
        self._queued: float | None = None
        self._prompt_tokens = 0
        self._first_token: float | None = None
        self._ended = not owner.enabled

    def describe(self, spec: RequestSpec) -> None:
        self._request_id = spec.request_id
        self._parameters = RequestParameters(
            operation="chat" if spec.messages else "text_completion",
            requested_model=spec.model,
            max_new_tokens=spec.max_new_tokens,
            temperature=spec.temperature,
            top_p=spec.top_p,
            top_k=spec.top_k,
            seed=spec.seed,
        )

    def resolved(self, model: str) -> None:
        self._model = model

    def observe(self, event: EngineEvent) -> None:
        """Take one of the request's engine events (called by its event sink)."""
        if self._ended:
            return
        if isinstance(event, TokensGenerated):
            if self._first_token is None and event.token_ids:
                self._first_token = self._owner.clock() - self._received
        elif isinstance(event, Started):
            self._queued = event.queued_seconds
            self._prompt_tokens = event.prompt_tokens
        elif isinstance(event, Completed):
            self._emit(self._completed(event.result))
        elif isinstance(event, Failed):
            self._emit(self._failed(event.error, event.completion_tokens))

    def refused(self, error: GenerationError) -> None:
        """The request was refused before the engine accepted it."""
        if self._ended:
            return
        outcome = _REFUSAL_OUTCOMES.get(error.kind, "error")
        if self._owner.metrics is not None:
            self._owner.metrics.request_refused(model=self._model, outcome=outcome)
        self._emit(
            RequestSummary(
                method=self._method,
                request_id=self._request_id,
                model=self._model,
                outcome=outcome,
                stages=Stages(total=self._owner.clock() - self._received),
                parameters=self._parameters,
                error_code=error.kind.name,
                error_reason=error.reason,
                error_message=error.message,
            )
        )

    def _completed(self, result: GenerationResult) -> RequestSummary:
        timing = result.timing
        return RequestSummary(
            method=self._method,
            request_id=result.request_id,
            model=result.model,
            outcome="cancelled" if result.finish_reason is FinishReason.CANCELLED else "ok",
            stages=Stages(
                total=timing.total,
                queued=timing.queued,
                first_token=timing.time_to_first_token,
                time_per_output_token=timing.time_per_output_token,
            ),
            parameters=self._parameters,
            finish_reason=result.finish_reason.value,
            prompt_tokens=result.prompt_tokens,
            completion_tokens=result.completion_tokens,
        )

    def _failed(self, error: GenerationError, completion_tokens: int) -> RequestSummary:
        # The engine reports no timing with a failure: the stages are the edge's own view, and a
        # request that never started spent its whole life in the queue.
        total = self._owner.clock() - self._received
        return RequestSummary(
            method=self._method,
            request_id=self._request_id,
            model=self._model,
            outcome=_FAILURE_OUTCOMES.get(error.kind, "error"),
            stages=Stages(
                total=total,
                queued=total if self._queued is None else self._queued,
                first_token=self._first_token,
            ),
            parameters=self._parameters,
            prompt_tokens=self._prompt_tokens,
            completion_tokens=completion_tokens,
            error_code=error.kind.name,
            error_reason=error.reason,
            error_message=error.message,
        )

    def _emit(self, summary: RequestSummary) -> None:
        self._ended = True
        owner = self._owner
        logging_it = owner.access_log is not None and owner.access_log.enabled
        if owner.tracer is None and not logging_it:
            self._metadata = None
            return
        try:
            parent = caller_context(self._metadata)
            if owner.tracer is not None:
                trace_id: str | None = owner.tracer.record(
                    summary, parent=parent, received_wall_ns=self._received_wall_ns
                )
            else:
                trace_id = trace_id_of(parent)
            if logging_it and owner.access_log is not None:
                owner.access_log.write(summary, trace_id)
        except Exception:  # telemetry must never break the request it describes
            log.exception("recording telemetry for request %r failed", summary.request_id)
        self._metadata = None  # holds the caller's credentials: keep them no longer than needed

"""Per-request telemetry at the API edge: a record follows one request from receipt to its end.

The edge knows what the engine's observer cannot: the request id, the caller's trace context,
and requests refused before they reached the engine. When a request ends its record emits the
span (when tracing is on), the access-log line, and, for a request the engine never counted, the
outcome count that the engine's observer never sees.

A request ends in exactly one of these ways, and each is one method of its record:
- `observe` takes the final engine event (completed, cancelled, deadline, failed), which carries
  the outcome and the engine's timing;
- `refused`: admission refused it (invalid, queue full, draining, ...);
- `left`: its call went away (cancelled, disconnected, past its deadline) or stopped listening
  (its client left the output unread) where no final event will reach this record: before the
  engine had the request, or from a generation that other calls still listen to.
- `served`: the edge answered it itself (the HTTP edge's model listing).
The first of them writes the record; any later one is ignored, so no request is written twice.
Everything here runs on the event loop. Until its end a record keeps two numbers per request
(when it started, how many tokens it heard of), so that a call that left is recorded with what
it got; nothing is written per token.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from tokenwire.server.engine.errors import ErrorKind, GenerationError, excerpt
from tokenwire.server.engine.types import (
    AbortReason,
    Completed,
    EngineEvent,
    Failed,
    FinishReason,
    Outcome,
    Started,
    TokensGenerated,
    unread_output_error,
)
from tokenwire.server.engine.validation import RequestSpec
from tokenwire.server.metadata import Metadata
from tokenwire.server.telemetry.access_log import AccessLog
from tokenwire.server.telemetry.metrics import ServerMetrics
from tokenwire.server.telemetry.summary import RequestParameters, RequestSummary, Stages
from tokenwire.server.telemetry.tracing import RequestTracer, caller_context, trace_id_of

log = logging.getLogger(__name__)

RECORDED_TEXT_CHARACTERS = 128
"""Longest request id or model name a span or log line carries (the longest valid request id)."""


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
        self._caller = "anonymous"
        self._adapter = ""
        self._parameters: RequestParameters | None = None
        self._ended = not owner.enabled
        self._queued: float | None = None
        self._prompt_tokens = 0
        self._first_token: float | None = None
        self._tokens_heard = 0

    def describe(self, spec: RequestSpec) -> None:
        # A refused request is recorded with whatever id and model it carried: never all of them.
        self._request_id = excerpt(spec.request_id, RECORDED_TEXT_CHARACTERS)
        self._parameters = RequestParameters(
            operation="chat" if spec.messages else "text_completion",
            requested_model=excerpt(spec.model, RECORDED_TEXT_CHARACTERS),
            max_new_tokens=spec.max_new_tokens,
            temperature=spec.temperature,
            top_p=spec.top_p,
            top_k=spec.top_k,
            seed=spec.seed,
            completions=1 if spec.n is None else spec.n,
        )

    def identified(self, caller: str) -> None:
        self._caller = caller

    def resolved(self, model: str) -> None:
        self._model = model

    def runs_adapter(self, adapter: str) -> None:
        """The request runs with this served adapter (one it may use): recorded from now on."""
        self._adapter = adapter

    def observe(self, event: EngineEvent) -> None:
        """Take one of the request's engine events (called by its event sink)."""
        if self._ended:
            return
        if isinstance(event, TokensGenerated):
            if event.token_ids and self._first_token is None:
                self._first_token = self._owner.clock() - self._received
            self._tokens_heard += len(event.token_ids)
        elif isinstance(event, Started):
            self._queued, self._prompt_tokens = event.queued_seconds, event.prompt_tokens
        elif isinstance(event, Completed):
            self._emit(self._completed(event))
        elif isinstance(event, Failed):
            self._emit(self._failed(event))

    def left(self, reason: AbortReason, *, reached_engine: bool) -> None:
        """The request's call went away and no final event will reach this record.

        reached_engine: the engine has (or had) the request, so its observer counts the
        generation's outcome; otherwise the record counts this one, as it does a refusal.
        """
        if self._ended:
            return
        outcome, error = _LEFT_ENDINGS[reason]
        if not reached_engine and self._owner.metrics is not None:
            self._owner.metrics.request_refused(
                model=self._model, outcome=outcome, caller=self._caller, adapter=self._adapter
            )
        stages = Stages(
            total=self._owner.clock() - self._received, queued=self._queued, first_token=self._first_token
        )
        self._emit(
            self._summary(
                outcome,
                stages,
                error,
                finish_reason=FinishReason.CANCELLED.value if error is None else None,
                prompt_tokens=self._prompt_tokens,
                completion_tokens=self._tokens_heard,
            )
        )

    def refused(self, error: GenerationError) -> None:
        """The request was refused before the engine accepted it."""
        if self._ended:
            return
        outcome = Outcome.of_refusal(error)
        if self._owner.metrics is not None:
            self._owner.metrics.request_refused(
                model=self._model, outcome=outcome, caller=self._caller, adapter=self._adapter
            )
        self._emit(self._summary(outcome, Stages(total=self._owner.clock() - self._received), error))

    def served(self) -> None:
        """Answered by the edge itself, without the engine (the HTTP edge's model listing)."""
        if not self._ended:
            self._emit(self._summary(Outcome.OK, Stages(total=self._owner.clock() - self._received)))

    def _completed(self, event: Completed) -> RequestSummary:
        result = event.result
        return self._summary(
            event.outcome,
            _stages(event),
            request_id=result.request_id,
            model=result.model,
            finish_reason=result.finish_reason.value,
            prompt_tokens=result.prompt_tokens,
            completion_tokens=result.completion_tokens,
            cached_prompt_tokens=result.cached_prompt_tokens,
            draft_tokens=result.draft_tokens,
            accepted_draft_tokens=result.accepted_draft_tokens,
        )

    def _failed(self, event: Failed) -> RequestSummary:
        return self._summary(
            event.outcome,
            _stages(event),
            event.error,
            prompt_tokens=event.prompt_tokens,
            completion_tokens=event.completion_tokens,
        )

    def _summary(
        self,
        outcome: Outcome,
        stages: Stages,
        error: GenerationError | None = None,
        *,
        request_id: str | None = None,
        model: str | None = None,
        finish_reason: str | None = None,
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
        cached_prompt_tokens: int = 0,
        draft_tokens: int = 0,
        accepted_draft_tokens: int = 0,
    ) -> RequestSummary:
        """The record of this request's ending; the id and model are this record's unless given."""
        return RequestSummary(
            method=self._method,
            request_id=self._request_id if request_id is None else request_id,
            model=self._model if model is None else model,
            outcome=outcome,
            stages=stages,
            parameters=self._parameters,
            error_code=None if error is None else error.kind.name,
            error_reason=None if error is None else error.reason,
            error_message=None if error is None else error.message,
            caller=self._caller,
            adapter=self._adapter,
            finish_reason=finish_reason,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            cached_prompt_tokens=cached_prompt_tokens,
            draft_tokens=draft_tokens,
            accepted_draft_tokens=accepted_draft_tokens,
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


_LEFT_ENDINGS: dict[AbortReason, tuple[Outcome, GenerationError | None]] = {
    AbortReason.CANCELLED: (Outcome.CANCELLED, None),
    AbortReason.DISCONNECTED: (Outcome.CANCELLED, None),
    AbortReason.DEADLINE: (
        Outcome.DEADLINE,
        GenerationError(
            ErrorKind.DEADLINE_EXCEEDED, "the call's deadline passed", reason="DEADLINE_EXCEEDED"
        ),
    ),
    AbortReason.SHUTDOWN: (
        Outcome.UNAVAILABLE,
        GenerationError(
            ErrorKind.UNAVAILABLE, "the server shut down before the request ended", reason="SHUTDOWN"
        ),
    ),
    AbortReason.OUTPUT_UNREAD: (Outcome.STOPPED, unread_output_error(AbortReason.OUTPUT_UNREAD)),
    AbortReason.BACKLOG: (Outcome.STOPPED, unread_output_error(AbortReason.BACKLOG)),
}
"""A call that went away, or stopped listening, is recorded as the engine records the same
abort: cancelled (a result), or failed with the reason's error."""


def _stages(event: Completed | Failed) -> Stages:
    timing = event.timing
    return Stages(
        total=timing.total,
        queued=timing.queued,
        first_token=timing.time_to_first_token,
        time_per_output_token=timing.time_per_output_token,
        paced=timing.paced,
    )

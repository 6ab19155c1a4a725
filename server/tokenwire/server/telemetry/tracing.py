"""One span per request, with queue, prefill and decode children, continuing the caller's trace.

Spans are built after the fact, when the request has ended, from the stage times the engine
measured (seconds from receipt) and the wall-clock time of receipt. The engine thread never
touches the tracer, and nothing happens per token. Span and attribute names follow the
OpenTelemetry GenAI semantic conventions; no metadata (so no bearer token) is ever recorded.
"""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

from tokenwire.server.engine.types import Outcome
from tokenwire.server.metadata import Metadata
from tokenwire.server.telemetry.summary import RequestSummary

RPC_SERVICE = "tokenwire.v1.InferenceService"

"""gRPC invocation metadata: (key, value) pairs, bytes for keys ending in -bin."""

_PROPAGATOR = TraceContextTextMapPropagator()
_TRACE_HEADERS = frozenset(_PROPAGATOR.fields)
_HEALTHY_OUTCOMES = frozenset({Outcome.OK, Outcome.CANCELLED})


def caller_context(metadata: Metadata | None) -> Context | None:
    """The caller's trace context from W3C `traceparent`/`tracestate` metadata, if it sent one."""
    if not metadata:
        return None
    carrier = {key: value for key, value in metadata if key in _TRACE_HEADERS and isinstance(value, str)}
    if not carrier:
        return None
    context = _PROPAGATOR.extract(carrier)
    return context if trace.get_current_span(context).get_span_context().is_valid else None


def trace_id_of(context: Context | None) -> str | None:
    if context is None:
        return None
    span_context = trace.get_current_span(context).get_span_context()
    return trace.format_trace_id(span_context.trace_id) if span_context.is_valid else None


class RequestTracer:
    def __init__(self, tracer: Tracer) -> None:
        self._tracer = tracer

    def record(self, summary: RequestSummary, *, parent: Context | None, received_wall_ns: int) -> str:
        """Emit the request's spans; returns the trace id (hex) they belong to."""

        def at(seconds: float) -> int:
            return received_wall_ns + round(seconds * 1e9)

        stages = summary.stages
        root = self._tracer.start_span(
            _span_name(summary),
            context=parent,
            kind=SpanKind.SERVER,
            attributes=_attributes(summary),
            start_time=received_wall_ns,
        )
        if summary.outcome not in _HEALTHY_OUTCOMES:
            root.set_status(Status(StatusCode.ERROR, summary.error_message))
        inside = trace.set_span_in_context(root)
        children: list[tuple[str, float, float, dict[str, AttributeValue]]] = []
        if stages.queued is not None:
            children.append(("queue", 0.0, stages.queued, {}))
            if stages.first_token is not None:
                # The span covers the prompt's whole stage; the attributes say how much of it
                # was waiting on other requests and how much of the prompt the cache held.
                prompt: dict[str, AttributeValue] = {
                    "gen_ai.usage.input_tokens": summary.prompt_tokens,
                    "tokenwire.prefill.cached_tokens": summary.cached_prompt_tokens,
                    "tokenwire.prefill.paced_seconds": stages.paced or 0.0,
                }
                children.append(("prefill", stages.queued, stages.first_token, prompt))
                # Each completion's first token came from the prompt's stage; the rest were decoded.
                completions = 1 if summary.parameters is None else summary.parameters.completions
                decoded: dict[str, AttributeValue] = {
                    "tokenwire.decode.tokens": max(0, summary.completion_tokens - completions)
                }
                if summary.draft_tokens:
                    decoded["tokenwire.decode.draft_tokens"] = summary.draft_tokens
                    decoded["tokenwire.decode.accepted_draft_tokens"] = summary.accepted_draft_tokens
                    decoded["tokenwire.decode.draft_acceptance"] = (
                        summary.accepted_draft_tokens / summary.draft_tokens
                    )
                children.append(("decode", stages.first_token, stages.total, decoded))
        for name, start, end, attributes in children:
            child = self._tracer.start_span(name, context=inside, attributes=attributes, start_time=at(start))
            child.end(end_time=at(end))
        root.end(end_time=at(stages.total))
        return trace.format_trace_id(root.get_span_context().trace_id)


def _span_name(summary: RequestSummary) -> str:
    if summary.parameters is None:
        return f"{RPC_SERVICE}/{summary.method}"
    return f"{summary.parameters.operation} {summary.model or summary.parameters.requested_model}".rstrip()


def _attributes(summary: RequestSummary) -> dict[str, AttributeValue]:
    attributes: dict[str, AttributeValue] = {
        "rpc.system": "grpc",
        "rpc.service": RPC_SERVICE,
        "rpc.method": summary.method,
        "tokenwire.outcome": summary.outcome.value,
        "tokenwire.caller": summary.caller,
    }
    if summary.adapter:
        attributes["tokenwire.adapter"] = summary.adapter
    if summary.request_id:
        attributes["tokenwire.request_id"] = summary.request_id
        attributes["gen_ai.response.id"] = summary.request_id
    parameters = summary.parameters
    if parameters is not None:
        attributes["gen_ai.operation.name"] = parameters.operation
        attributes["gen_ai.request.model"] = parameters.requested_model or summary.model
        for key, value in (
            ("gen_ai.request.max_tokens", parameters.max_new_tokens),
            ("gen_ai.request.temperature", parameters.temperature),
            ("gen_ai.request.top_p", parameters.top_p),
            ("gen_ai.request.top_k", parameters.top_k or None),
            ("gen_ai.request.seed", parameters.seed),
            ("gen_ai.request.choice.count", parameters.completions if parameters.completions != 1 else None),
        ):
            if value is not None:
                attributes[key] = value
    if summary.model:
        attributes["gen_ai.response.model"] = summary.model
        attributes["gen_ai.usage.input_tokens"] = summary.prompt_tokens
        attributes["gen_ai.usage.output_tokens"] = summary.completion_tokens
    if summary.finish_reason is not None:
        attributes["gen_ai.response.finish_reasons"] = (summary.finish_reason,)
    if summary.error_code is not None:
        attributes["error.type"] = summary.error_code
    if summary.error_reason is not None:
        attributes["tokenwire.error.reason"] = summary.error_reason
    return attributes

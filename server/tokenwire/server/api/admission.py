"""Admission: one generation request from its arrival to the engine's queue, or to its refusal.

Every generation request, from either edge, is admitted the same way: start its telemetry
record, read the caller (and the gateway's headers), check its sizes against their bounds
(request_bounds.py), convert it, check that the server takes work, resolve the model, validate
the request against it and submit it. A refusal at any step is recorded and raised as a
GenerationError; each edge answers it in its own way (a status for Generate, an error event on
a stream, an HTTP error).

Each edge hands over its decoded request as one plain `AdmissionInput`: its sizes, how to convert
it into a RequestSpec (the priority None when the request leaves it unset, so the gateway's
objective header may set it), how to rename the validator's fields into the edge's terms, and
the idempotency key. Nothing here knows which edge a request came by.

Validation tokenizes the prompt or renders the conversation, work that grows with the input:
beyond a small input it runs in a worker thread, in pieces that each hold the GIL only briefly
(Tokenizer.encode_within), so the event loop keeps serving every other stream meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import uuid
from collections.abc import Callable, Container
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from tokenwire.server.api import request_bounds
from tokenwire.server.api.registry import ModelRegistry
from tokenwire.server.api.request_ids import GenerationRegistry
from tokenwire.server.engine.errors import ErrorKind, FieldViolation, GenerationError
from tokenwire.server.engine.types import AbortReason, EngineEvent, GenerationRequest
from tokenwire.server.engine.validation import RequestLimits, RequestSpec
from tokenwire.server.lifecycle import Lifecycle
from tokenwire.server.metadata import Metadata
from tokenwire.server.security.callers import CallerDirectory
from tokenwire.server.security.gateway_headers import GatewayHeaders
from tokenwire.server.telemetry.requests import RequestRecord, RequestTelemetry
from tokenwire.server.text.tools import ToolCalling


@dataclass(frozen=True)
class Admitted:
    """A request in the engine's queue, or a call attached to a generation of the same idempotency key."""

    request_id: str
    queue_position: int
    stop: Callable[[AbortReason], None]
    """Ends the request (a cancel) or lets go of it (the call went away): through the engine, or
    through the generation registry when other calls may share the generation."""
    attached: bool = False
    """True when the call joined a generation asked for earlier with the same idempotency key."""
    tool_calling: ToolCalling | None = None
    """How the output is read for tool calls; None when the request offers no tools."""


@dataclass(frozen=True)
class AdmissionInput:
    """One decoded request of either edge, in the plain terms admission reads."""

    sizes: request_bounds.RequestSizes
    """Its id, model and sizes, bounded before anything else is read."""
    convert: Callable[[], RequestSpec]
    """The request in domain terms, called once its sizes are within their bounds. Raises
    GenerationError (fields named as in RequestSpec) for a value the edge cannot convert."""
    name_fields: Callable[[GenerationError], GenerationError]
    """Renames the violations of an error (RequestSpec fields) into the edge's terms."""
    idempotency_key: str | None = None
    """Makes the request idempotent for its caller; None: it is not."""


INLINE_INPUT_CHARACTERS = 2048
"""Prompts (or conversations) up to this size are validated on the event loop: tokenizing them
takes less than the hop to a worker thread would."""
INLINE_MESSAGES = 16
VALIDATION_WORKERS = 2


class Admission:
    def __init__(
        self,
        registry: ModelRegistry,
        lifecycle: Lifecycle,
        telemetry: RequestTelemetry,
        callers: CallerDirectory,
        limits: RequestLimits | None = None,
        generations: GenerationRegistry | None = None,
        gateway: GatewayHeaders | None = None,
    ) -> None:
        self._registry = registry
        self._lifecycle = lifecycle
        self._telemetry = telemetry
        self._callers = callers
        self._limits = limits or RequestLimits()
        self._workers = ThreadPoolExecutor(VALIDATION_WORKERS, thread_name_prefix="validation")
        self._generations = generations
        self._gateway = gateway if gateway is not None and gateway.active else None

    def close(self) -> None:
        self._workers.shutdown(wait=False, cancel_futures=True)

    def refuse(
        self,
        method: str,
        metadata: Metadata | None,
        sizes: request_bounds.RequestSizes,
        error: GenerationError,
        *,
        received: float,
    ) -> None:
        """Record a request its call refused before admission (a stream's own limits) like any
        other refusal: with its caller, its id and the model it asked for."""
        record = self._telemetry.begin(method, metadata, received)
        caller = self._callers.identify(metadata)
        if self._gateway is not None:
            # A header that may not be honoured would have been refused too: the token's caller
            # is who asked.
            with contextlib.suppress(GenerationError):
                caller = self._gateway.caller(caller, metadata)
        record.identified(caller.name)
        record.describe(RequestSpec(request_id=sizes.request_id, model=sizes.model))
        record.refused(error)

    async def admit(
        self,
        method: str,
        metadata: Metadata | None,
        message: AdmissionInput,
        *,
        received: float,
        call_deadline: float | None,
        on_event: Callable[[EngineEvent], None],
        live_ids: Container[str] | None = None,
    ) -> Admitted:
        """Queue `message`, or record and raise why not. `on_event` gets each of its events.

        live_ids: for a request on a stream, the ids live on that stream; the request must carry
        an id that is not among them. Without it (a unary call) a missing id is made up.
        """
        record = self._telemetry.begin(method, metadata, received)
        caller = self._callers.identify(metadata)
        record.identified(caller.name)

        def observed(event: EngineEvent) -> None:
            record.observe(event)
            on_event(event)

        try:
            if self._gateway is not None:
                caller = self._gateway.caller(caller, metadata)
                record.identified(caller.name)
            sizes = message.sizes
            # Only the id and model first: the rest may be huge, and is bounded before it is read.
            record.describe(RequestSpec(request_id=sizes.request_id, model=sizes.model))
            request_bounds.check_before_model(sizes, self._limits)
            spec = message.convert()
            if self._gateway is not None:
                spec = replace(spec, priority=self._gateway.priority(metadata, spec.priority))
            if live_ids is None and not spec.request_id:
                spec = replace(spec, request_id=f"gen-{uuid.uuid4().hex[:16]}")
            record.describe(spec)
            if live_ids is not None and spec.request_id and spec.request_id in live_ids:
                raise _duplicate_id(spec.request_id)
            # Only an idempotency key makes a request retryable (bounded above, so at most 128
            # characters); a request without one is never looked up and pays nothing.
            idempotency_key = message.idempotency_key or None
            fingerprint = b""
            if self._generations is not None and idempotency_key is not None:
                fingerprint = _fingerprint(spec)
                earlier = self._generations.find(caller.name, idempotency_key, fingerprint)
                if earlier is not None:
                    subscription = self._generations.attach(earlier, observed)
                    return Admitted(
                        spec.request_id,
                        0,
                        _leaving(subscription.stop, record),
                        attached=True,
                        tool_calling=self._tool_calling(spec),
                    )
            self._lifecycle.check_accepting()
            model, adapter = self._registry.route(spec.model, spec.adapter)
            if (model, adapter) != (spec.model, spec.adapter):
                spec = replace(spec, model=model, adapter=adapter)
            served = self._registry.resolve(spec.model)
            record.resolved(served.name)
            request_bounds.check_against_model(sizes, self._limits, served.model.info.context_length)
            served.validator.check_adapter(spec, caller)
            record.runs_adapter(spec.adapter)
            # A request the queue would refuse whatever its prompt is refused before its prompt
            # is tokenized: a flood over its share must not spend the cores the others need.
            served.engine.check_room(caller)

            def validate() -> GenerationRequest:
                return served.validator.validate(
                    spec,
                    received_at=received,
                    call_deadline=call_deadline,
                    require_request_id=live_ids is not None,
                )

            if _small(spec):
                request = validate()
            else:
                request = await asyncio.get_running_loop().run_in_executor(self._workers, validate)
            request = replace(request, caller=caller)
            calling = served.validator.tool_calling(spec)
            if idempotency_key is None or self._generations is None:
                ticket = served.engine.submit(request, observed)
                engine, key = served.engine, ticket.key
                return Admitted(
                    spec.request_id,
                    ticket.queue_position,
                    lambda reason: engine.abort(key, reason),
                    tool_calling=calling,
                )
            # The same request may have arrived while this one was validated on a worker.
            earlier = self._generations.find(caller.name, idempotency_key, fingerprint)
            if earlier is not None:
                subscription = self._generations.attach(earlier, observed)
                return Admitted(
                    spec.request_id,
                    0,
                    _leaving(subscription.stop, record),
                    attached=True,
                    tool_calling=calling,
                )
            generation, subscription = self._generations.begin(
                caller.name, idempotency_key, fingerprint, observed
            )
            try:
                ticket = served.engine.submit(request, self._generations.deliver_to(generation))
            except GenerationError:
                self._generations.discard(generation)
                raise
            self._generations.bind(generation, served.engine, ticket.key)
            return Admitted(
                spec.request_id,
                ticket.queue_position,
                _leaving(subscription.stop, record),
                tool_calling=calling,
            )
        except GenerationError as error:
            # Every refusal names its fields in the edge's own terms, whichever step refused it.
            raise _recorded_refusal(record, message.name_fields(error)) from None
        except asyncio.CancelledError:  # the call went away while its request was being validated
            record.left(AbortReason.DISCONNECTED, reached_engine=False)
            raise

    def _tool_calling(self, spec: RequestSpec) -> ToolCalling | None:
        """How a generation joined before its model was resolved here reads its output."""
        try:
            served = self._registry.resolve(spec.model)
        except GenerationError:
            return None
        return served.validator.tool_calling(spec)


def _recorded_refusal(record: RequestRecord, error: GenerationError) -> GenerationError:
    """`error`, written to the request's record as its refusal. Raised straight from this call:
    a local of the raising frame naming it would make that frame and the error's traceback hold
    each other, and with them the decoded request, until the cyclic collector ran."""
    record.refused(error)
    return error


def _leaving(stop: Callable[[AbortReason], None], record: RequestRecord) -> Callable[[AbortReason], None]:
    """`stop` for a call that hears its generation through the generation registry.

    A cancel ends the generation for every listener, this call included, so the request's record
    hears the final event. A call that goes away stops listening at once (other calls may keep
    the generation going), so no final event will reach its record: it is written here.
    """

    def stop_and_record(reason: AbortReason) -> None:
        stop(reason)
        if reason is not AbortReason.CANCELLED:
            record.left(reason, reached_engine=True)

    return stop_and_record


def _fingerprint(spec: RequestSpec) -> bytes:
    """The request as converted, its handle aside: two requests with equal fingerprints ask for
    the same thing (a retry may come on another stream, under another request_id). RequestSpec
    is a frozen dataclass of plain values, so its repr spells every field deterministically."""
    body = replace(spec, request_id="", n=spec.n or 1)  # n unset and 1 both ask for one completion
    return hashlib.sha256(repr(body).encode()).digest()


def _small(spec: RequestSpec) -> bool:
    """Whether validating `spec` is too little work to be worth a worker thread."""
    if spec.tools and sum(len(tool.parameters) + len(tool.description) for tool in spec.tools) > (
        INLINE_INPUT_CHARACTERS
    ):
        return False
    if spec.prompt is not None:
        return len(spec.prompt) <= INLINE_INPUT_CHARACTERS
    if spec.messages:
        return (
            len(spec.messages) <= INLINE_MESSAGES
            and sum(len(turn.content) for turn in spec.messages) <= INLINE_INPUT_CHARACTERS
        )
    return True  # token ids: checked against the vocabulary, nothing to tokenize


def _duplicate_id(request_id: str) -> GenerationError:
    return GenerationError(
        ErrorKind.INVALID_ARGUMENT,
        f"request_id {request_id!r} is already live on this stream; that generation continues",
        violations=(FieldViolation("request_id", "already used by a live request of this stream"),),
        reason="DUPLICATE_REQUEST_ID",
    )

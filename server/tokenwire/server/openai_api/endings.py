"""One HTTP request's access-log line (and span), written exactly once whatever ends the request.

The app and the protocol end a request in many places: refusals from its head, its route, its
method, its token, its Content-Type or its body, a client gone mid-body, an internal error, the
models routes. Each ends it through one RequestEnding; from admission on the admission writes the
request's own record, and the ending is only told so (`handed_over`), so no request is written
twice and none is left out.
"""

from __future__ import annotations

from tokenwire.server.engine.errors import GenerationError
from tokenwire.server.engine.types import AbortReason
from tokenwire.server.metadata import Metadata
from tokenwire.server.security.callers import CallerDirectory
from tokenwire.server.telemetry.requests import RequestRecord, RequestTelemetry


class RequestEnding:
    def __init__(
        self,
        telemetry: RequestTelemetry,
        callers: CallerDirectory,
        operation: str,
        metadata: Metadata | None,
        received: float,
    ) -> None:
        self._telemetry = telemetry
        self._callers = callers
        self._operation = operation
        self._metadata = metadata
        self._received = received
        self._ended = False

    def handed_over(self) -> None:
        """The admission has the request and writes its record."""
        self._ended = True

    def refused(self, error: GenerationError) -> None:
        record = self._record()
        if record is not None:
            record.refused(error)

    def served(self) -> None:
        """Answered by the edge itself, without the engine (a models listing)."""
        record = self._record()
        if record is not None:
            record.served()

    def left(self) -> None:
        """The client went away before its request was whole."""
        record = self._record()
        if record is not None:
            record.left(AbortReason.DISCONNECTED, reached_engine=False)

    def _record(self) -> RequestRecord | None:
        if self._ended:
            return None
        self._ended = True
        record = self._telemetry.begin(self._operation, self._metadata, self._received)
        record.identified(self._callers.identify(self._metadata).name)
        return record

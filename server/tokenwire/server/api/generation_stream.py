"""GenerateStream: one generation per call, its events streamed as they happen.

Everything here runs on the event loop, owned by the call's coroutine: the engine thread hands
events over with `call_soon_threadsafe` (through Admission's sink), they wait in the call's
outbox, and the coroutine writes them out.

The parts are StreamGenerate's own: admission (admission.py), event conversion (convert.py), the
byte-bounded outbox and chunk coalescing (outbox.py, stream.coalesce_chunks). What differs is how
a generation ends, since the call is the generation: a refusal or failure ends the call with the
status Generate would return, instead of an `error` event on a stream that stays open; and the
call ending first (cancel, disconnect, deadline) stops the generation, within one decode step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable

from tokenwire.server.api import convert
from tokenwire.server.api.admission import Admission, Admitted
from tokenwire.server.api.decoding import UndecodableRequest
from tokenwire.server.api.outbox import Outbox
from tokenwire.server.api.stream import coalesce_chunks
from tokenwire.server.api.tool_output import ToolOutput
from tokenwire.server.engine.errors import ErrorKind, GenerationError
from tokenwire.server.engine.types import AbortReason, Completed, EngineEvent, Failed
from tokenwire.server.metadata import Metadata
from tokenwire.v1 import inference_service_pb2 as pb

log = logging.getLogger(__name__)

METHOD = "GenerateStream"
BACKLOG_REASON = "STREAM_BACKLOG"
"""StreamGenerate's reason for a client that stopped reading, the same on both calls."""


class GenerationStream:
    """The events of one generation, for one GenerateStream call."""

    def __init__(self, admission: Admission, unsent_bytes: int) -> None:
        self._admission = admission
        self._outbox = Outbox(unsent_bytes, time.monotonic)
        self._request_id = ""
        self._admitted: Admitted | None = None
        self._tools = ToolOutput(None)
        self._completed = False
        self._ending: GenerationError | None = None
        """Why the call ends with an error: the generation failed, or its client stopped reading."""

    async def run(
        self,
        request: pb.GenerateRequest | UndecodableRequest,
        *,
        metadata: Metadata | None,
        received: float,
        call_deadline: float | None,
        gone_reason: Callable[[], AbortReason],
    ) -> AsyncIterator[pb.StreamGenerateResponse]:
        """Queue `request` and yield its events until `completed`.

        Raises GenerationError when the request is refused or the generation fails: the caller
        ends the call with its status. If the call ends first, the generation is stopped with
        `gone_reason()` (asked then, so a passed deadline can be told from a cancel).
        """
        admitted = await self._admission.admit(
            METHOD,
            metadata,
            convert.admission_input(request),
            received=received,
            call_deadline=call_deadline,
            on_event=self._deliver,
        )
        # No event can have arrived yet: the engine's come through the event loop, and a joined
        # generation's catch-up on its next turn (GenerationRegistry.attach), so `queued` is first.
        self._admitted = admitted
        self._tools = ToolOutput(admitted.tool_calling)
        self._request_id = admitted.request_id
        self._outbox.put(convert.queued_event(admitted.request_id, admitted.queue_position))
        try:
            while True:
                for message in coalesce_chunks(await self._outbox.take_all()):
                    if self._ending is not None and self._ending.reason == BACKLOG_REASON:
                        break  # the client stopped reading: nothing more is written
                    yield message
                self._outbox.sent()
                if self._ending is not None and self._ending.reason == BACKLOG_REASON:
                    raise self._ending
                # The last event may have arrived while the batch before it was being written:
                # the call ends only once everything before the ending has gone out.
                if not self._outbox.empty():
                    continue
                if self._ending is not None:
                    raise self._ending
                if self._completed:
                    return
        finally:
            if not self._completed and self._ending is None:
                admitted.stop(gone_reason())

    def _deliver(self, event: EngineEvent) -> None:
        if self._completed or self._ending is not None:
            return
        if isinstance(event, Failed):
            self._ending = event.error
            self._outbox.put(None)  # wake the writer, which ends the call with the failure
            return
        if isinstance(event, Completed):
            self._completed = True
        for message in convert.stream_messages(self._request_id, event, self._tools):
            if not self._outbox.put(message):
                self._stop_backlogged()
                return

    def _stop_backlogged(self) -> None:
        """The client left so much output unread that the generation stops now (its slot and
        memory go at once) and the call ends with RESOURCE_EXHAUSTED."""
        limit = self._outbox.max_bytes
        self._completed = False
        self._ending = GenerationError(
            ErrorKind.RESOURCE_EXHAUSTED,
            f"this call's responses waiting to be read passed {limit} bytes "
            "(--max-unsent-bytes-per-stream); its generation was stopped: read responses as they come",
            reason=BACKLOG_REASON,
        )
        log.warning("generation stopped: its client left more than %d bytes of responses unread", limit)
        if self._admitted is not None:
            self._admitted.stop(AbortReason.BACKLOG)
        self._outbox.discard()

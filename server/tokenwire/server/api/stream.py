"""One StreamGenerate call: many generations multiplexed on a bidirectional stream.

A reader task takes client messages (generate / cancel) while the call's coroutine writes the
events of every live generation as they come. Half-close ends the reading; the stream ends
once every live generation has delivered its last event. If the call itself ends first
(client cancel, disconnect, deadline), every live generation is aborted in `finally`, and the
engine stops them within one decode step.

One call holds a bounded share of the server (stream_limits.py): so many live generations, so
many queue places, so many bytes of responses its client has not read yet. Past the last bound
the call's generations are stopped and the call ends with RESOURCE_EXHAUSTED, so a client that
stops reading holds neither compute nor memory. Sooner than that, once a response has waited
unread for the unread-output timeout, the call's live generations are stopped, each with an
error event, and new ones are refused until the client reads again: a client that reads nothing
does not keep slots while its output slowly adds up.

A request_id is the stream's handle only: it routes a generation's events and names what a
cancel stops, and is unique among the call's live generations. Events of a generation the call
has already ended (stopped while an event of it was on its way) are dropped, so each request's
events still end with exactly one completed or error.

Everything here runs on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from tokenwire.server.api import convert
from tokenwire.server.api.admission import Admission, Admitted
from tokenwire.server.api.decoding import UndecodableRequest
from tokenwire.server.api.errors import status_proto
from tokenwire.server.api.outbox import Outbox
from tokenwire.server.api.tool_output import ToolOutput
from tokenwire.server.engine.errors import ErrorKind, FieldViolation, GenerationError
from tokenwire.server.engine.types import (
    MAX_COMPLETIONS,
    AbortReason,
    Completed,
    EngineEvent,
    Failed,
    Started,
)
from tokenwire.server.metadata import Metadata
from tokenwire.server.telemetry.requests import RequestTelemetry
from tokenwire.v1 import inference_service_pb2 as pb

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StreamCaps:
    """One call's limits, resolved from StreamLimits and the server's queue size."""

    generations: int = 32
    queued: int = 32
    unsent_bytes: int = 1024 * 1024
    unread_timeout: float = 5.0
    """Seconds a response may wait unread before the call's generations are stopped; 0: no bound."""


class StreamSession:
    def __init__(
        self,
        admission: Admission,
        clock: Callable[[], float],
        call_deadline: float | None,
        telemetry: RequestTelemetry,
        metadata: Metadata | None,
        caps: StreamCaps | None = None,
    ) -> None:
        self._admission = admission
        self._clock = clock
        self._call_deadline = call_deadline
        self._telemetry = telemetry
        self._metadata = metadata
        self._caps = caps or StreamCaps()
        self._outbox = Outbox(self._caps.unsent_bytes, clock)
        self._live: dict[str, Admitted] = {}
        self._tool_outputs: dict[str, ToolOutput] = {}
        """Per live request, its output read for tool calls."""
        self._started: set[str] = set()
        self._completions: dict[str, int] = {}
        """Each live request's n: it holds as many generations and queue places as completions."""
        self._half_closed = False
        self._reader_error: BaseException | None = None
        self._backlog_error: GenerationError | None = None
        self._reader: asyncio.Task[None] | None = None
        self._unread_check: asyncio.TimerHandle | None = None

    async def run(
        self, requests: AsyncIterator[pb.StreamGenerateRequest]
    ) -> AsyncIterator[pb.StreamGenerateResponse]:
        """The call's responses. Raises GenerationError (STREAM_BACKLOG) when the client fell
        too far behind: the caller ends the call with it."""
        self._reader = asyncio.create_task(self._read(requests), name="stream-reader")
        try:
            while True:
                if self._backlog_error is not None:
                    raise self._backlog_error
                if self._reader_error is not None:
                    raise self._reader_error
                if self._half_closed and not self._live and self._outbox.empty():
                    return
                backlog = await self._outbox.take_all()
                for message in coalesce_chunks(backlog):
                    if self._backlog_error is not None:
                        break
                    yield message
                self._outbox.sent()
        finally:
            self._reader.cancel()
            self._stop_watching_unread()
            self._abort_all()

    async def _read(self, requests: AsyncIterator[pb.StreamGenerateRequest]) -> None:
        try:
            async for message in requests:
                if isinstance(message, UndecodableRequest):
                    # Which request this was meant to be is unknowable: answer with an empty id.
                    self._telemetry.begin("StreamGenerate", self._metadata, self._clock()).refused(
                        message.error()
                    )
                    self._send(_error_event("", message.error()))
                    continue
                kind = message.WhichOneof("request")
                if kind == "generate":
                    await self._start(message.generate)
                elif kind == "cancel":
                    self._cancel(message.cancel.request_id)
                else:
                    error = GenerationError.invalid(FieldViolation("request", "set generate or cancel"))
                    self._telemetry.begin("StreamGenerate", self._metadata, self._clock()).refused(error)
                    self._send(_error_event("", error))
        except asyncio.CancelledError:
            raise
        except BaseException as error:  # a broken read ends the call; the writer re-raises it
            self._reader_error = error
        finally:
            self._half_closed = True
            self._outbox.put(None)  # wake the writer so it can notice

    async def _start(self, message: pb.GenerateRequest) -> None:
        request_id = message.request_id
        received = self._clock()
        completions = min(max(message.n, 1), MAX_COMPLETIONS)  # validation refuses a bad n after
        over = self._over_limit(completions)
        if over is not None:
            self._admission.refuse(
                "StreamGenerate", self._metadata, convert.request_sizes(message), over, received=received
            )
            self._send(_error_event(request_id, over))
            return
        try:
            admitted = await self._admission.admit(
                "StreamGenerate",
                self._metadata,
                convert.admission_input(message),
                received=received,
                call_deadline=self._call_deadline,
                on_event=lambda event: self._deliver(request_id, event),
                live_ids=self._live,
            )
        except GenerationError as error:
            self._send(_error_event(request_id, error))
            return
        if self._backlog_error is not None:  # the call broke while this one was being validated
            admitted.stop(AbortReason.DISCONNECTED)
            return
        self._live[request_id] = admitted
        self._tool_outputs[request_id] = ToolOutput(admitted.tool_calling)
        self._completions[request_id] = completions
        self._send(convert.queued_event(request_id, admitted.queue_position))

    def _over_limit(self, completions: int) -> GenerationError | None:
        """Why a request of `completions` generations cannot start on this call now, or None."""
        caps = self._caps
        if self._unread_too_long():
            return self._unread_error()
        live = sum(self._completions.values())
        if live + completions > caps.generations:
            return GenerationError(
                ErrorKind.RESOURCE_EXHAUSTED,
                f"this call already has {live} live generations and this request asks for "
                f"{completions}, more than one StreamGenerate call may have (--max-generations-per-stream "
                f"{caps.generations}); wait for one to end",
                reason="STREAM_GENERATIONS_LIMIT",
            )
        queued = sum(n for request_id, n in self._completions.items() if request_id not in self._started)
        if queued + completions > caps.queued:
            return GenerationError(
                ErrorKind.RESOURCE_EXHAUSTED,
                f"this call already has {queued} generations waiting for a slot, the most one "
                f"StreamGenerate call may have (--max-queued-per-stream {caps.queued}); "
                "wait for one to start",
                reason="STREAM_QUEUE_LIMIT",
            )
        return None

    def _cancel(self, request_id: str) -> None:
        live = self._live.get(request_id)
        if live is not None:
            live.stop(AbortReason.CANCELLED)

    def _deliver(self, request_id: str, event: EngineEvent) -> None:
        if self._backlog_error is not None:
            return  # the call is ending: nothing more is sent
        if request_id not in self._live:
            return  # the call stopped this generation and told its client so
        if isinstance(event, Started):
            self._started.add(request_id)
        if isinstance(event, Failed):
            self._forget(request_id)
            self._send(_error_event(request_id, event.error))
            return
        tools = self._tool_outputs.get(request_id)
        if isinstance(event, Completed):
            self._forget(request_id)
        for message in convert.stream_messages(request_id, event, tools):
            self._send(message)

    def _forget(self, request_id: str) -> None:
        self._live.pop(request_id, None)
        self._tool_outputs.pop(request_id, None)
        self._started.discard(request_id)
        self._completions.pop(request_id, None)

    def _send(self, message: pb.StreamGenerateResponse) -> None:
        if self._backlog_error is not None:
            return
        if not self._outbox.put(message):
            self._stop_backlogged()
            return
        self._watch_unread()

    def _unread_too_long(self) -> bool:
        timeout = self._caps.unread_timeout
        since = self._outbox.unsent_since()
        return timeout > 0 and since is not None and self._clock() - since >= timeout

    def _unread_error(self) -> GenerationError:
        return GenerationError(
            ErrorKind.RESOURCE_EXHAUSTED,
            f"this call's responses have waited unread for more than {self._caps.unread_timeout:g} s "
            "(--unread-output-timeout); its generations were stopped to free their slots and new ones "
            "are refused until the client reads again: read responses as they come",
            reason="STREAM_OUTPUT_UNREAD",
        )

    def _watch_unread(self) -> None:
        """Look again once the oldest unsent response will have waited the unread-output timeout."""
        timeout = self._caps.unread_timeout
        if timeout <= 0 or self._unread_check is not None:
            return
        since = self._outbox.unsent_since()
        if since is None:
            return
        delay = max(0.0, since + timeout - self._clock())
        self._unread_check = asyncio.get_running_loop().call_later(delay, self._check_unread)

    def _stop_watching_unread(self) -> None:
        if self._unread_check is not None:
            self._unread_check.cancel()
            self._unread_check = None

    def _check_unread(self) -> None:
        self._unread_check = None
        if self._backlog_error is not None:
            return
        if not self._unread_too_long():
            self._watch_unread()  # what waited was sent; look again for what waits now
            return
        if not self._live:
            return  # nothing holds a slot; a new response looks again
        stopped = list(self._live)
        log.warning(
            "stream stopped %d generations: its client left responses unread for more than %g s",
            len(stopped),
            self._caps.unread_timeout,
        )
        self._abort_all(AbortReason.OUTPUT_UNREAD)
        error = self._unread_error()
        for request_id in stopped:
            self._send(_error_event(request_id, error))

    def _stop_backlogged(self) -> None:
        """The client has not read so much output that the call stops: its generations end now
        (freeing their slots and memory), and the call ends with RESOURCE_EXHAUSTED once the
        response being sent, if any, goes out."""
        limit = self._caps.unsent_bytes
        self._backlog_error = GenerationError(
            ErrorKind.RESOURCE_EXHAUSTED,
            f"this call's responses waiting to be read passed {limit} bytes "
            f"(--max-unsent-bytes-per-stream); its generations were stopped: read responses as they come",
            reason="STREAM_BACKLOG",
        )
        log.warning("stream stopped: its client left more than %d bytes of responses unread", limit)
        self._stop_watching_unread()
        self._abort_all(AbortReason.BACKLOG)
        self._outbox.discard()
        if self._reader is not None:
            self._reader.cancel()

    def _abort_all(self, reason: AbortReason = AbortReason.DISCONNECTED) -> None:
        for live in self._live.values():
            live.stop(reason)
        self._live.clear()
        self._tool_outputs.clear()
        self._started.clear()
        self._completions.clear()


def coalesce_chunks(backlog: list[pb.StreamGenerateResponse | None]) -> list[pb.StreamGenerateResponse]:
    """Merge the chunks of each request that piled up while the previous message was being sent.

    Only a backlog is merged, so a reader that keeps up still gets every token the moment it is
    made; one that falls behind gets fewer, larger chunks instead of paying per token on both
    sides. A request's events keep their order: its chunks merge only up to its next other event.
    Chunks of different completions of one request (n > 1) never merge: each completion's chunks
    merge among themselves, in their order.
    """
    merged: list[pb.StreamGenerateResponse] = []
    open_chunks: dict[str, dict[int, pb.StreamGenerateResponse]] = {}
    """Per request, per completion index, the chunk later ones merge into."""
    for message in backlog:
        if message is None:
            continue
        request_id = message.request_id
        if message.WhichOneof("event") == "chunk":
            of_request = open_chunks.setdefault(request_id, {})
            target = of_request.get(message.chunk.index)
            if target is not None:
                target.chunk.text += message.chunk.text
                target.chunk.token_ids.extend(message.chunk.token_ids)
                target.chunk.logprobs.extend(message.chunk.logprobs)
                target.chunk.tool_calls.extend(message.chunk.tool_calls)
                continue
            of_request[message.chunk.index] = message
        else:
            open_chunks.pop(request_id, None)
        merged.append(message)
    return merged


def _error_event(request_id: str, error: GenerationError) -> pb.StreamGenerateResponse:
    return pb.StreamGenerateResponse(request_id=request_id, error=status_proto(error))

"""One StreamGenerate call: many generations multiplexed on a bidirectional stream.

A reader task takes client messages (generate / cancel) while the call's coroutine writes the
events of every live generation as they come. Half-close ends the reading; the stream ends
once every live generation has delivered its last event. If the call itself ends first
(client cancel, disconnect, deadline), every live generation is aborted in `finally`, and the
engine stops them within one decode step.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

from tokenwire.server.api import convert
from tokenwire.server.api.admission import Admission, Admitted
from tokenwire.server.api.decoding import UndecodableRequest
from tokenwire.server.api.errors import status_proto
from tokenwire.server.engine.errors import FieldViolation, GenerationError
from tokenwire.server.engine.types import AbortReason, Completed, EngineEvent, Failed
from tokenwire.server.telemetry.requests import RequestTelemetry
from tokenwire.server.telemetry.tracing import Metadata
from tokenwire.v1 import inference_service_pb2 as pb

log = logging.getLogger(__name__)


class StreamSession:
    def __init__(
        self,
        admission: Admission,
        clock: Callable[[], float],
        call_deadline: float | None,
        telemetry: RequestTelemetry,
        metadata: Metadata | None,
    ) -> None:
        self._admission = admission
        self._clock = clock
        self._call_deadline = call_deadline
        self._telemetry = telemetry
        self._metadata = metadata
        self._outbox: asyncio.Queue[pb.StreamGenerateResponse | None] = asyncio.Queue()
        self._live: dict[str, Admitted] = {}
        self._half_closed = False
        self._reader_error: BaseException | None = None

    async def run(
        self, requests: AsyncIterator[pb.StreamGenerateRequest]
    ) -> AsyncIterator[pb.StreamGenerateResponse]:
        reader = asyncio.create_task(self._read(requests), name="stream-reader")
        try:
            while True:
                if self._reader_error is not None:
                    raise self._reader_error
                if self._half_closed and not self._live and self._outbox.empty():
                    return
                backlog = [await self._outbox.get()]
                while not self._outbox.empty():
                    backlog.append(self._outbox.get_nowait())
                for message in coalesce_chunks(backlog):
                    yield message
        finally:
            reader.cancel()
            for live in self._live.values():
                live.engine.abort(live.key, AbortReason.DISCONNECTED)
            self._live.clear()

    async def _read(self, requests: AsyncIterator[pb.StreamGenerateRequest]) -> None:
        try:
            async for message in requests:
                if isinstance(message, UndecodableRequest):
                    # Which request this was meant to be is unknowable: answer with an empty id.
                    self._telemetry.begin("StreamGenerate", self._metadata, self._clock()).refused(
                        message.error()
                    )
                    self._outbox.put_nowait(_error_event("", message.error()))
                    continue
                kind = message.WhichOneof("request")
                if kind == "generate":
                    self._start(message.generate)
                elif kind == "cancel":
                    self._cancel(message.cancel.request_id)
                else:
                    error = GenerationError.invalid(FieldViolation("request", "set generate or cancel"))
                    self._telemetry.begin("StreamGenerate", self._metadata, self._clock()).refused(error)
                    self._outbox.put_nowait(_error_event("", error))
        except asyncio.CancelledError:
            raise
        except BaseException as error:  # a broken read ends the call; the writer re-raises it
            self._reader_error = error
        finally:
            self._half_closed = True
            self._outbox.put_nowait(None)  # wake the writer so it can notice

    def _start(self, message: pb.GenerateRequest) -> None:
        request_id = message.request_id
        try:
            admitted = self._admission.admit(
                "StreamGenerate",
                self._metadata,
                message,
                received=self._clock(),
                call_deadline=self._call_deadline,
                on_event=lambda event: self._deliver(request_id, event),
                live_ids=self._live,
            )
        except GenerationError as error:
            self._outbox.put_nowait(_error_event(request_id, error))
            return
        self._live[request_id] = admitted
        self._outbox.put_nowait(convert.queued_event(request_id, admitted.queue_position))

    def _cancel(self, request_id: str) -> None:
        live = self._live.get(request_id)
        if live is not None:
            live.engine.abort(live.key, AbortReason.CANCELLED)

    def _deliver(self, request_id: str, event: EngineEvent) -> None:
        if isinstance(event, Failed):
            self._live.pop(request_id, None)
            self._outbox.put_nowait(_error_event(request_id, event.error))
            return
        if isinstance(event, Completed):
            self._live.pop(request_id, None)
        self._outbox.put_nowait(convert.stream_event(request_id, event))


def coalesce_chunks(backlog: list[pb.StreamGenerateResponse | None]) -> list[pb.StreamGenerateResponse]:
    """Merge the chunks of each request that piled up while the previous message was being sent.

    Only a backlog is merged, so a reader that keeps up still gets every token the moment it is
    made; one that falls behind gets fewer, larger chunks instead of paying per token on both
    sides. A request's events keep their order: its chunks merge only up to its next other event.
    """
    merged: list[pb.StreamGenerateResponse] = []
    open_chunks: dict[str, pb.StreamGenerateResponse] = {}
    for message in backlog:
        if message is None:
            continue
        request_id = message.request_id
        if message.WhichOneof("event") == "chunk":
            target = open_chunks.get(request_id)
            if target is not None:
                target.chunk.text += message.chunk.text
                target.chunk.token_ids.extend(message.chunk.token_ids)
                target.chunk.logprobs.extend(message.chunk.logprobs)
                continue
            open_chunks[request_id] = message
        else:
            open_chunks.pop(request_id, None)
        merged.append(message)
    return merged


def _error_event(request_id: str, error: GenerationError) -> pb.StreamGenerateResponse:
    return pb.StreamGenerateResponse(request_id=request_id, error=status_proto(error))

"""InferenceService: convert, delegate to the engine, convert back."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import TypeAlias

import grpc

from tokenwire.server.api import convert, errors
from tokenwire.server.api.admission import Admission
from tokenwire.server.api.decoding import UndecodableRequest
from tokenwire.server.api.embed_messages import embed_response, embedding_input
from tokenwire.server.api.embeddings import Embedder
from tokenwire.server.api.generation_stream import GenerationStream
from tokenwire.server.api.registry import ModelRegistry
from tokenwire.server.api.stream import StreamCaps, StreamSession
from tokenwire.server.api.tool_output import ToolOutput
from tokenwire.server.engine.errors import GenerationError
from tokenwire.server.engine.types import AbortReason, Completed, EngineEvent, Failed
from tokenwire.server.telemetry.requests import RequestTelemetry
from tokenwire.v1 import inference_service_pb2 as pb
from tokenwire.v1 import inference_service_pb2_grpc as pb_grpc

Context: TypeAlias = grpc.aio.ServicerContext

DEADLINE_CLOCK_SLACK = 0.05
"""Seconds: gRPC's deadline timer can cancel a call while time_remaining() still reads a few
milliseconds left (its timer and the context's clock differ), so a call cancelled this close to
its deadline was ended by the deadline, and is recorded so."""


class InferenceServicer(pb_grpc.InferenceServiceServicer):
    def __init__(
        self,
        registry: ModelRegistry,
        admission: Admission,
        telemetry: RequestTelemetry,
        *,
        clock: Callable[[], float] = time.monotonic,
        stream_caps: StreamCaps | None = None,
    ) -> None:
        """`admission` is the server's one admission, which the HTTP edge shares."""
        self._registry = registry
        self._clock = clock
        self._telemetry = telemetry
        self._admission = admission
        self._caps = stream_caps or StreamCaps()
        self._embedder = Embedder(registry)

    async def Generate(self, request: pb.GenerateRequest, context: Context) -> pb.GenerateResponse:  # noqa: N802
        received = self._clock()
        outcome: asyncio.Future[Completed | Failed] = asyncio.get_running_loop().create_future()

        def collect(event: EngineEvent) -> None:
            if isinstance(event, Completed | Failed) and not outcome.done():
                outcome.set_result(event)

        try:
            admitted = await self._admission.admit(
                "Generate",
                context.invocation_metadata(),
                convert.admission_input(request),
                received=received,
                call_deadline=_call_deadline(context, received),
                on_event=collect,
            )
        except GenerationError as error:
            await errors.abort(context, error)
            raise  # unreachable: abort raises
        try:
            event = await outcome
        except asyncio.CancelledError:
            # The call ended under us: the client cancelled, disconnected or its deadline passed.
            admitted.stop(_gone_reason(context))
            raise
        if isinstance(event, Failed):
            await errors.abort(context, event.error)
        assert isinstance(event, Completed)
        return convert.generate_response(event.result, tools=ToolOutput(admitted.tool_calling))

    async def StreamGenerate(  # noqa: N802
        self, request_iterator: AsyncIterator[pb.StreamGenerateRequest], context: Context
    ) -> AsyncIterator[pb.StreamGenerateResponse]:
        received = self._clock()
        # A server that is loading or draining still opens the call and reads it: admission
        # refuses each generation on it with a retryable UNAVAILABLE (one record each), and the
        # call ends with OK once the client half-closes. Ending the call with a status while its
        # client is still writing would race those writes, and a grpc client whose write fails
        # on a finished call reports INTERNAL ("Internal error from Core") instead of the status.
        session = StreamSession(
            self._admission,
            self._clock,
            _call_deadline(context, received),
            self._telemetry,
            context.invocation_metadata(),
            self._caps,
        )
        try:
            async for message in session.run(request_iterator):
                yield message
        except GenerationError as error:  # the client left too much unread: the call ends
            await errors.abort(context, error)

    async def GenerateStream(  # noqa: N802
        self, request: pb.GenerateRequest, context: Context
    ) -> AsyncIterator[pb.StreamGenerateResponse]:
        received = self._clock()
        generation = GenerationStream(self._admission, self._caps.unsent_bytes)
        try:
            async for message in generation.run(
                request,
                metadata=context.invocation_metadata(),
                received=received,
                call_deadline=_call_deadline(context, received),
                gone_reason=lambda: _gone_reason(context),
            ):
                yield message
        except GenerationError as error:
            await errors.abort(context, error)

    async def Embed(self, request: pb.EmbedRequest, context: Context) -> pb.EmbedResponse:  # noqa: N802
        if isinstance(request, UndecodableRequest):
            await errors.abort(context, request.error())
        try:
            embedded = await self._embedder.embed(embedding_input(request))
        except GenerationError as error:
            await errors.abort(context, error)
            raise  # unreachable: abort raises
        return await asyncio.to_thread(embed_response, embedded)

    async def ListModels(self, request: pb.ListModelsRequest, context: Context) -> pb.ListModelsResponse:  # noqa: N802
        if isinstance(request, UndecodableRequest):
            await errors.abort(context, request.error())
        served = self._registry.all()
        return pb.ListModelsResponse(
            models=[
                convert.model_info(
                    s.model.info,
                    has_chat_template=s.model.chat_template is not None,
                    is_default=index == 0,
                    adapters=s.adapters,
                )
                for index, s in enumerate(served)
            ]
        )


def _call_deadline(context: Context, received: float) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None else received + remaining


def _gone_reason(context: Context) -> AbortReason:
    """Why a call ended before its generation did: its deadline passed, or its client went away."""
    remaining = context.time_remaining()
    # gRPC's deadline timer may cancel the call while time_remaining() still reads a few ms.
    deadline_passed = remaining is not None and remaining <= DEADLINE_CLOCK_SLACK
    return AbortReason.DEADLINE if deadline_passed else AbortReason.DISCONNECTED

"""The asyncio client."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from types import TracebackType
from typing import Any

import grpc

from tokenwire.client import messages
from tokenwire.client.channel import Tls, aio_channel, auth_metadata
from tokenwire.client.errors import TokenwireError
from tokenwire.client.messages import Prompt
from tokenwire.client.routing import Routing
from tokenwire.client.types import (
    Chunk,
    Completed,
    Failed,
    GenerateOptions,
    Generation,
    ModelDescription,
    StreamEvent,
    TokenLogprob,
)
from tokenwire.v1 import inference_service_pb2 as pb
from tokenwire.v1 import inference_service_pb2_grpc as pb_grpc

_DEFAULT_OPTIONS = GenerateOptions()


class AsyncClient:
    """Talks to a tokenwire server from asyncio code.

    `deadline` arguments are gRPC deadlines in seconds for the whole call; `options.timeout` is
    the server-side per-request deadline, which also covers time in the queue.

    With `routing`, the target may resolve to many replicas and each call is balanced over them
    (see tokenwire.client.routing).
    """

    def __init__(
        self,
        target: str = "localhost:50051",
        *,
        token: str | None = None,
        tls: Tls | None = None,
        retries: bool = True,
        routing: Routing | None = None,
    ) -> None:
        self.target = target
        self._channel = aio_channel(target, tls, retries=retries, routing=routing)
        self._retries = retries
        self._stub = pb_grpc.InferenceServiceStub(self._channel)
        self._metadata = auth_metadata(token)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def generate(
        self,
        prompt: Prompt,
        options: GenerateOptions = _DEFAULT_OPTIONS,
        *,
        request_id: str = "",
        idempotency_key: str = "",
        deadline: float | None = None,
    ) -> Generation:
        """Run one generation and return it whole. Raises TokenwireError."""
        # With retries on, the request carries an idempotency key, so a retry the channel sends
        # (the same message) joins the first attempt's generation instead of starting another.
        if self._retries and not idempotency_key:
            idempotency_key = messages.new_idempotency_key()
        request = messages.generate_request(prompt, options, request_id, idempotency_key)
        try:
            response = await self._stub.Generate(request, timeout=deadline, metadata=self._metadata)
        except grpc.RpcError as error:
            raise TokenwireError.from_rpc_error(error) from None
        return messages.generation(response)

    async def stream(
        self,
        prompt: Prompt,
        options: GenerateOptions = _DEFAULT_OPTIONS,
        *,
        request_id: str = "",
        idempotency_key: str = "",
        deadline: float | None = None,
    ) -> AsyncIterator[StreamEvent]:
        """Run one generation on a GenerateStream call of its own and yield its events as they
        arrive: queued, started, chunks, then Completed, or Failed with the call's error.

        One call per generation, so a balancer (fleet mode, an L7 proxy) places each one on its
        own. Leaving the loop early cancels the call, which stops the generation on the server.
        With retries on, a generation refused before it was queued is sent again by gRPC's retry
        policy, unseen; one that was queued is never sent again.
        """
        request_id = request_id or messages.new_request_id()
        # With retries on, the request carries an idempotency key, so a retry the channel sends
        # (the same message) joins the first attempt's generation instead of starting another.
        if self._retries and not idempotency_key:
            idempotency_key = messages.new_idempotency_key()
        request = messages.generate_request(prompt, options, request_id, idempotency_key)
        call = self._stub.GenerateStream(request, timeout=deadline, metadata=self._metadata)
        try:
            async for message in call:
                yield messages.stream_event(message)
        except grpc.RpcError as error:
            yield Failed(request_id, TokenwireError.from_rpc_error(error))
        finally:
            call.cancel()  # a no-op once the call has ended; otherwise it stops the generation

    def open_stream(self, *, deadline: float | None = None) -> MultiplexedStream:
        """Open one StreamGenerate call that carries many generations (use `async with`)."""
        return MultiplexedStream(self._stub, self._metadata, deadline)

    async def list_models(self, *, deadline: float | None = 10.0) -> list[ModelDescription]:
        try:
            response = await self._stub.ListModels(
                pb.ListModelsRequest(), timeout=deadline, metadata=self._metadata
            )
        except grpc.RpcError as error:
            raise TokenwireError.from_rpc_error(error) from None
        return [messages.model_description(m) for m in response.models]


class MultiplexedStream:
    """Many generations on one bidirectional stream, each addressed by its request_id."""

    def __init__(
        self,
        stub: pb_grpc.InferenceServiceStub,
        metadata: tuple[tuple[str, str], ...],
        deadline: float | None,
    ) -> None:
        # The generated stubs type this as a plain iterator; at run time it is a grpc.aio
        # StreamStreamCall with read/write/done_writing.
        self._call: Any = stub.StreamGenerate(timeout=deadline, metadata=metadata)

    async def __aenter__(self) -> MultiplexedStream:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if not self._call.done():
            self._call.cancel()

    async def submit(
        self,
        request_id: str,
        prompt: Prompt,
        options: GenerateOptions = _DEFAULT_OPTIONS,
        *,
        idempotency_key: str = "",
    ) -> None:
        """Start a generation; its events arrive through events(). `request_id` labels them (unique
        among this stream's live generations); `idempotency_key`, when set, makes the request
        idempotent for this caller on every stream and Generate call."""
        request = messages.generate_request(prompt, options, request_id, idempotency_key)
        await self._write(pb.StreamGenerateRequest(generate=request))

    async def cancel(self, request_id: str) -> None:
        """Stop one generation; it then completes with FinishReason.CANCELLED."""
        await self._write(pb.StreamGenerateRequest(cancel=pb.CancelRequest(request_id=request_id)))

    async def close_requests(self) -> None:
        """Say no more generations will be submitted; the stream ends after the live ones finish."""
        await self._call.done_writing()

    def cancel_all(self) -> None:
        """Cancel the whole call: every generation on it stops."""
        self._call.cancel()

    async def events(self) -> AsyncIterator[StreamEvent]:
        """Every event of every generation on this stream, until the stream ends."""
        try:
            while True:
                message = await self._call.read()
                if message is grpc.aio.EOF:
                    return
                yield messages.stream_event(message)
        except grpc.RpcError as error:
            raise TokenwireError.from_rpc_error(error) from None

    async def _write(self, request: pb.StreamGenerateRequest) -> None:
        try:
            await self._call.write(request)
        except grpc.RpcError as error:
            raise TokenwireError.from_rpc_error(error) from None


async def collect(events: AsyncIterator[StreamEvent]) -> Generation:
    """Drain one generation's events into a Generation with the streamed text and tokens; with
    n > 1, each of its choices gets the text, tokens and logprobs its chunks carried."""
    text: dict[int, list[str]] = {}
    tokens: dict[int, list[int]] = {}
    logprobs: dict[int, list[TokenLogprob]] = {}
    async for event in events:
        if isinstance(event, Failed):
            raise event.error
        if isinstance(event, Completed):
            generation = event.generation
            if generation.choices:
                choices = tuple(
                    replace(
                        choice,
                        text="".join(text.get(choice.index, [])),
                        token_ids=tuple(tokens.get(choice.index, [])),
                        logprobs=tuple(logprobs.get(choice.index, [])),
                    )
                    for choice in generation.choices
                )
                return replace(generation, choices=choices)
            return replace(generation, text="".join(text.get(0, [])), token_ids=tuple(tokens.get(0, [])))
        if isinstance(event, Chunk):
            text.setdefault(event.index, []).append(event.text)
            tokens.setdefault(event.index, []).extend(event.token_ids)
            logprobs.setdefault(event.index, []).extend(event.logprobs)
    raise TokenwireError(grpc.StatusCode.UNKNOWN, "stream ended before the generation completed")

"""The blocking client, for scripts and services without asyncio."""

from __future__ import annotations

import queue
from collections.abc import Iterator
from types import TracebackType

import grpc

from tokenwire.client import messages
from tokenwire.client.channel import Tls, auth_metadata, sync_channel
from tokenwire.client.errors import TokenwireError
from tokenwire.client.messages import Prompt
from tokenwire.client.routing import Routing
from tokenwire.client.types import Failed, GenerateOptions, Generation, ModelDescription, StreamEvent
from tokenwire.v1 import inference_service_pb2 as pb
from tokenwire.v1 import inference_service_pb2_grpc as pb_grpc

_DEFAULT_OPTIONS = GenerateOptions()
_END = object()


class Client:
    """Talks to a tokenwire server with blocking calls. See AsyncClient for the semantics."""

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
        self._channel = sync_channel(target, tls, retries=retries, routing=routing)
        self._retries = retries
        self._stub = pb_grpc.InferenceServiceStub(self._channel)
        self._metadata = auth_metadata(token)

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def generate(
        self,
        prompt: Prompt,
        options: GenerateOptions = _DEFAULT_OPTIONS,
        *,
        request_id: str = "",
        idempotency_key: str = "",
        deadline: float | None = None,
    ) -> Generation:
        # With retries on, the request carries an idempotency key, so a retry the channel sends
        # (the same message) joins the first attempt's generation instead of starting another.
        if self._retries and not idempotency_key:
            idempotency_key = messages.new_idempotency_key()
        request = messages.generate_request(prompt, options, request_id, idempotency_key)
        try:
            response = self._stub.Generate(request, timeout=deadline, metadata=self._metadata)
        except grpc.RpcError as error:
            raise TokenwireError.from_rpc_error(error) from None
        return messages.generation(response)

    def stream(
        self,
        prompt: Prompt,
        options: GenerateOptions = _DEFAULT_OPTIONS,
        *,
        request_id: str = "",
        idempotency_key: str = "",
        deadline: float | None = None,
    ) -> Iterator[StreamEvent]:
        """Yield one generation's events from a GenerateStream call of its own, ending with
        Completed or Failed; closing the iterator early cancels the call on the server. A
        generation refused before it was queued is sent again by gRPC's retry policy."""
        request_id = request_id or messages.new_request_id()
        # With retries on, the request carries an idempotency key, so a retry the channel sends
        # (the same message) joins the first attempt's generation instead of starting another.
        if self._retries and not idempotency_key:
            idempotency_key = messages.new_idempotency_key()
        request = messages.generate_request(prompt, options, request_id, idempotency_key)
        call = self._stub.GenerateStream(request, timeout=deadline, metadata=self._metadata)
        try:
            for message in call:
                yield messages.stream_event(message)
        except grpc.RpcError as error:
            yield Failed(request_id, TokenwireError.from_rpc_error(error))
        finally:
            call.cancel()

    def open_stream(self, *, deadline: float | None = None) -> SyncStream:
        return SyncStream(self._stub, self._metadata, deadline)

    def list_models(self, *, deadline: float | None = 10.0) -> list[ModelDescription]:
        try:
            response = self._stub.ListModels(
                pb.ListModelsRequest(), timeout=deadline, metadata=self._metadata
            )
        except grpc.RpcError as error:
            raise TokenwireError.from_rpc_error(error) from None
        return [messages.model_description(m) for m in response.models]


class SyncStream:
    """A multiplexed StreamGenerate call driven from blocking code."""

    def __init__(
        self,
        stub: pb_grpc.InferenceServiceStub,
        metadata: tuple[tuple[str, str], ...],
        deadline: float | None,
    ) -> None:
        self._outgoing: queue.Queue[object] = queue.Queue()
        self._call = stub.StreamGenerate(self._requests(), timeout=deadline, metadata=metadata)

    def _requests(self) -> Iterator[pb.StreamGenerateRequest]:
        while True:
            item = self._outgoing.get()
            if item is _END:
                return
            assert isinstance(item, pb.StreamGenerateRequest)
            yield item

    def submit(
        self,
        request_id: str,
        prompt: Prompt,
        options: GenerateOptions = _DEFAULT_OPTIONS,
        *,
        idempotency_key: str = "",
    ) -> None:
        """Start a generation (see MultiplexedStream.submit)."""
        request = messages.generate_request(prompt, options, request_id, idempotency_key)
        self._outgoing.put(pb.StreamGenerateRequest(generate=request))

    def cancel(self, request_id: str) -> None:
        self._outgoing.put(pb.StreamGenerateRequest(cancel=pb.CancelRequest(request_id=request_id)))

    def close_requests(self) -> None:
        self._outgoing.put(_END)

    def cancel_all(self) -> None:
        self._outgoing.put(_END)
        self._call.cancel()

    def events(self) -> Iterator[StreamEvent]:
        try:
            for message in self._call:
                yield messages.stream_event(message)
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.CANCELLED:
                return
            raise TokenwireError.from_rpc_error(error) from None

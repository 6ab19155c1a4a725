"""The blocking client, for scripts and services without asyncio."""

from __future__ import annotations

import queue
import time
import uuid
from collections.abc import Iterator
from types import TracebackType

import grpc

from tokenwire.client import messages
from tokenwire.client.channel import Tls, auth_metadata, sync_channel
from tokenwire.client.errors import TokenwireError
from tokenwire.client.messages import Prompt
from tokenwire.client.retry import inference_retry_policy
from tokenwire.client.routing import Routing
from tokenwire.client.types import GenerateOptions, Generation, ModelDescription, StreamEvent
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
        self._retry = inference_retry_policy() if retries else None
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
        # With retries on, every Generate carries an idempotency key, so a retry the channel sends
        # (the same message) joins the first attempt's generation on the server instead of starting
        # another. The request_id is only a label and makes nothing idempotent.
        if self._retry is not None and not idempotency_key:
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
        """Yield one generation's events, from a StreamGenerate call of its own; closing the iterator
        early cancels it on the server. A generation refused before admission is sent again."""
        request_id = request_id or f"req-{uuid.uuid4().hex[:12]}"
        # Sent again, the generation carries the first attempt's key: should the first have been
        # admitted after all, the second joins it instead of running twice.
        if self._retry is not None and not idempotency_key:
            idempotency_key = messages.new_idempotency_key()
        give_up = None if deadline is None else time.monotonic() + deadline
        attempts = 0
        while True:
            attempts += 1
            remaining = None if give_up is None else max(0.0, give_up - time.monotonic())
            first: StreamEvent | None = None
            delay: float | None = None
            stream = self.open_stream(deadline=remaining)
            try:
                stream.submit(request_id, prompt, options, idempotency_key=idempotency_key)
                stream.close_requests()
                for event in stream.events():
                    if first is None:
                        first = event
                        delay = None if self._retry is None else self._retry.delay(event, attempts)
                        if delay is not None and (give_up is None or time.monotonic() + delay < give_up):
                            break
                        delay = None
                    yield event
            finally:
                stream.cancel_all()
            if delay is None:
                return
            time.sleep(delay)

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

"""Every failure class, identical for unary calls and stream error events."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import replace

import grpc
import numpy as np
import pytest

from tests.conftest import ServerFactory
from tests.support.events import Transcript, read_until
from tests.support.options import greedy
from tests.support.polling import wait_until
from tests.support.runners import DelegatingRunner
from tests.support.stepping import StepGate, gated
from tokenwire.client import (
    AsyncClient,
    ChatMessage,
    Completed,
    Failed,
    GenerateOptions,
    Sampling,
    Stopping,
    TokenwireError,
)
from tokenwire.server.app import TokenwireServer
from tokenwire.server.models.loader import LoadedModel
from tokenwire.server.models.runner import ModelRunner
from tokenwire.v1 import inference_service_pb2 as pb
from tokenwire.v1 import inference_service_pb2_grpc as pb_grpc

MessagesOrPrompt = str | Sequence[ChatMessage] | Sequence[int]


INVALID_REQUESTS: list[tuple[str, MessagesOrPrompt, GenerateOptions, list[str]]] = [
    (
        "negative temperature",
        "Hi",
        GenerateOptions(sampling=Sampling(temperature=-0.5)),
        ["sampling.temperature"],
    ),
    (
        "NaN temperature",
        "Hi",
        GenerateOptions(sampling=Sampling(temperature=float("nan"))),
        ["sampling.temperature"],
    ),
    ("top_p zero", "Hi", GenerateOptions(sampling=Sampling(top_p=0.0)), ["sampling.top_p"]),
    ("top_p above one", "Hi", GenerateOptions(sampling=Sampling(top_p=1.5)), ["sampling.top_p"]),
    ("negative top_k", "Hi", GenerateOptions(sampling=Sampling(top_k=-1)), ["sampling.top_k"]),
    ("min_p above one", "Hi", GenerateOptions(sampling=Sampling(min_p=2.0)), ["sampling.min_p"]),
    (
        "zero repetition penalty",
        "Hi",
        GenerateOptions(sampling=Sampling(repetition_penalty=0.0)),
        ["sampling.repetition_penalty"],
    ),
    (
        "logit bias outside the vocabulary",
        "Hi",
        GenerateOptions(sampling=Sampling(logit_bias={50000: -100.0})),
        ["sampling.logit_bias[50000]"],
    ),
    (
        "presence penalty above 2",
        "Hi",
        GenerateOptions(sampling=Sampling(presence_penalty=2.5)),
        ["sampling.presence_penalty"],
    ),
    (
        "zero max_new_tokens",
        "Hi",
        GenerateOptions(stopping=Stopping(max_new_tokens=0)),
        ["stopping.max_new_tokens"],
    ),
    (
        "max_new_tokens above cap",
        "Hi",
        GenerateOptions(stopping=Stopping(max_new_tokens=100_000)),
        ["stopping.max_new_tokens"],
    ),
    (
        "prompt plus output beyond context",
        "Hi",
        GenerateOptions(stopping=Stopping(max_new_tokens=256)),
        ["stopping.max_new_tokens"],
    ),
    ("empty prompt", "", GenerateOptions(), ["prompt"]),
    ("empty token ids", [], GenerateOptions(), ["token_ids.ids"]),
    ("token id outside the vocabulary", [1, 2, 512], GenerateOptions(), ["token_ids.ids[2]"]),
    ("prompt longer than the context", [5] * 300, GenerateOptions(), ["token_ids.ids"]),
    ("unknown role", [ChatMessage("wizard", "hi")], GenerateOptions(), ["messages[0].role"]),
    (
        "too many stop strings",
        "Hi",
        GenerateOptions(stopping=Stopping(stop=tuple("abcdefghijklmnopq"))),
        ["stopping.stop"],
    ),
    (
        "too long stop string",
        "Hi",
        GenerateOptions(stopping=Stopping(stop=("x" * 300,))),
        ["stopping.stop[0]"],
    ),
    ("empty stop string", "Hi", GenerateOptions(stopping=Stopping(stop=("",))), ["stopping.stop[0]"]),
    ("top_logprobs above 20", "Hi", GenerateOptions(logprobs=True, top_logprobs=21), ["top_logprobs"]),
    ("top_logprobs without logprobs", "Hi", GenerateOptions(top_logprobs=2), ["top_logprobs"]),
    ("non-positive timeout", "Hi", GenerateOptions(timeout=-1.0), ["timeout"]),
    (
        "several problems at once",
        "Hi",
        GenerateOptions(sampling=Sampling(temperature=-1, top_k=-2)),
        ["sampling.temperature", "sampling.top_k"],
    ),
]


@pytest.mark.parametrize(
    ("prompt", "options", "fields"),
    [case[1:] for case in INVALID_REQUESTS],
    ids=[case[0] for case in INVALID_REQUESTS],
)
async def test_invalid_request_is_invalid_argument_naming_the_field_in_unary_and_stream(
    client: AsyncClient, prompt: MessagesOrPrompt, options: GenerateOptions, fields: list[str]
) -> None:
    with pytest.raises(TokenwireError) as unary:
        await client.generate(prompt, options)
    assert unary.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert [v.field for v in unary.value.field_violations] == fields
    assert all(v.description for v in unary.value.field_violations)

    events = [e async for e in client.stream(prompt, options, request_id="bad")]
    assert len(events) == 1 and isinstance(events[0], Failed)
    streamed = events[0].error
    assert isinstance(streamed, TokenwireError)
    assert streamed.code is unary.value.code
    assert streamed.field_violations == unary.value.field_violations
    assert streamed.message == unary.value.message


async def test_more_than_one_input_is_rejected(server: TokenwireServer) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.InferenceServiceStub(channel)
        request = pb.GenerateRequest(prompt="Hi", token_ids=pb.TokenIds(ids=[1, 2]))
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await stub.Generate(request)
    error = TokenwireError.from_rpc_error(raised.value)
    assert error.code is grpc.StatusCode.INVALID_ARGUMENT
    assert [v.field for v in error.field_violations] == ["token_ids"]


async def test_messages_without_a_chat_template_are_rejected(
    start_server: ServerFactory, tiny_model_without_chat_dir: object
) -> None:
    server = await start_server(model_dir=tiny_model_without_chat_dir)
    async with AsyncClient(f"127.0.0.1:{server.port}", retries=False) as client:
        with pytest.raises(TokenwireError) as raised:
            await client.generate([ChatMessage("user", "hi")])
        assert raised.value.code is grpc.StatusCode.INVALID_ARGUMENT
        assert [v.field for v in raised.value.field_violations] == ["messages"]
        assert "no chat template" in raised.value.field_violations[0].description
        assert not (await client.list_models())[0].has_chat_template


async def test_stream_request_without_request_id_is_rejected(client: AsyncClient) -> None:
    async with client.open_stream() as stream:
        await stream.submit("", "Hello", greedy(8))
        await stream.close_requests()
        events = [e async for e in stream.events()]
    assert len(events) == 1 and isinstance(events[0], Failed)
    assert [v.field for v in events[0].error.field_violations] == ["request_id"]  # type: ignore[attr-defined]


async def test_duplicate_live_request_id_is_rejected_and_the_first_continues(
    start_server: ServerFactory,
) -> None:
    gate = StepGate()
    server = await start_server(wrap_model=gated(gate))
    transcript = Transcript()
    async with (
        AsyncClient(f"127.0.0.1:{server.port}", retries=False) as client,
        client.open_stream() as stream,
    ):
        events = stream.events()
        await stream.submit("dup", "First", greedy(5))
        await read_until(events, transcript, lambda t: len(t.tokens("dup")) >= 1)
        await stream.submit("dup", "Second", greedy(5))
        await read_until(events, transcript, lambda t: any(isinstance(e, Failed) for e in t.events["dup"]))
        gate.open()
        await stream.close_requests()
        async for event in events:
            transcript.add(event)
    failures = [e for e in transcript.events["dup"] if isinstance(e, Failed)]
    assert len(failures) == 1
    error = failures[0].error
    assert isinstance(error, TokenwireError) and error.code is grpc.StatusCode.INVALID_ARGUMENT
    assert error.reason == "DUPLICATE_REQUEST_ID"
    assert [v.field for v in error.field_violations] == ["request_id"]
    final = transcript.final("dup")
    assert isinstance(final, Completed) and final.generation.completion_tokens == 5


async def test_unknown_model_is_not_found(client: AsyncClient) -> None:
    with pytest.raises(TokenwireError) as raised:
        await client.generate("Hi", GenerateOptions(model="no-such-model"))
    assert raised.value.code is grpc.StatusCode.NOT_FOUND
    events = [e async for e in client.stream("Hi", GenerateOptions(model="no-such-model"))]
    assert isinstance(events[0], Failed) and events[0].error.code is grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]


async def test_full_queue_is_resource_exhausted_at_once_with_a_retry_hint(
    start_server: ServerFactory,
) -> None:
    gate = StepGate()
    server = await start_server(wrap_model=gated(gate), max_batch_size=1, max_queue_size=1)
    engine = server.registry.default.engine
    async with AsyncClient(f"127.0.0.1:{server.port}", retries=False) as client:
        running = asyncio.create_task(client.generate("one", greedy(5)))
        waiting = asyncio.create_task(client.generate("two", greedy(5)))
        # Both accepted: one in the slot, one in the queue.
        await wait_until(lambda: engine.live_count == 2, what="two accepted requests")
        with pytest.raises(TokenwireError) as unary:
            await client.generate("three", greedy(5))
        events = [e async for e in client.stream("four", greedy(5), request_id="four")]
        # The raw call shows the trailer gRPC's own retry policy reads.
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            call = pb_grpc.InferenceServiceStub(channel).Generate(pb.GenerateRequest(prompt="five"))
            with pytest.raises(grpc.aio.AioRpcError):
                await call
            trailers = dict(await call.trailing_metadata())
        gate.open()
        assert (await running).completion_tokens == 5
        assert (await waiting).completion_tokens == 5
    error = unary.value
    assert error.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error.reason == "QUEUE_FULL"
    assert error.retry_after is not None and 0.05 <= error.retry_after <= 30
    assert error.retryable
    assert isinstance(events[0], Failed) and events[0].error.code is grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
    assert int(trailers["grpc-retry-pushback-ms"]) >= 50


async def test_requests_are_unavailable_while_draining(server: TokenwireServer, client: AsyncClient) -> None:
    await server.drain(timeout=5)
    with pytest.raises(TokenwireError) as raised:
        await client.generate("Hi", greedy(8))
    assert raised.value.code is grpc.StatusCode.UNAVAILABLE
    assert raised.value.retryable


class _FailingRunner(DelegatingRunner):
    """The real runner, except that one chosen decode step fails."""

    def __init__(self, inner: ModelRunner, poison_after_steps: int) -> None:
        super().__init__(inner)
        self.calls = 0
        self._poison_after = poison_after_steps

    def decode(self, seq_ids: Sequence[int], token_ids: Sequence[int]) -> np.ndarray:
        self.calls += 1
        if self.calls == self._poison_after:
            raise RuntimeError("injected model failure")
        return self.inner.decode(seq_ids, token_ids)


async def test_model_failure_is_internal_for_that_step_and_the_server_keeps_serving(
    start_server: ServerFactory,
) -> None:
    def poison(model: LoadedModel) -> LoadedModel:
        return replace(model, runner=_FailingRunner(model.runner, poison_after_steps=3))

    server = await start_server(wrap_model=poison)
    async with AsyncClient(f"127.0.0.1:{server.port}", retries=False) as client:
        with pytest.raises(TokenwireError) as raised:
            await client.generate("Hi", greedy(20))
        assert raised.value.code is grpc.StatusCode.INTERNAL
        after = await client.generate("Hi", greedy(20))
    assert after.completion_tokens == 20
    engine = server.registry.default.engine
    assert engine.stats.step_failures == 1
    assert engine.live_count == 0

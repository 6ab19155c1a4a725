"""A string that is not valid UTF-8 is INVALID_ARGUMENT naming its field, on Generate and on
StreamGenerate, and the stream goes on serving.

No UTF-8 encoder writes a lone surrogate, so the requests are serialized and then patched: the
three bytes "abc" of a field become ED A0 80, the surrogate U+D800 as CESU-8 writes it.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from tokenwire.server.app import TokenwireServer
from tokenwire.v1 import inference_service_pb2 as pb

GENERATE = "/tokenwire.v1.InferenceService/Generate"
STREAM_GENERATE = "/tokenwire.v1.InferenceService/StreamGenerate"
SURROGATE = b"\xed\xa0\x80"


def patched(message: pb.GenerateRequest | pb.StreamGenerateRequest) -> bytes:
    data = message.SerializeToString()
    assert data.count(b"abc") == 1
    return data.replace(b"abc", SURROGATE)


def fields_of(status: status_pb2.Status) -> list[str]:
    for detail in status.details:
        bad = error_details_pb2.BadRequest()
        if detail.Unpack(bad):
            return [violation.field for violation in bad.field_violations]
    return []


REQUESTS: dict[str, tuple[Callable[[], pb.GenerateRequest], str]] = {
    "message content": (
        lambda: pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="abc")]),
        "messages[0].content",
    ),
    "second message's role": (
        lambda: pb.GenerateRequest(
            messages=[pb.ChatMessage(role="user", content="hi"), pb.ChatMessage(role="abc", content="yo")]
        ),
        "messages[1].role",
    ),
    "prompt": (lambda: pb.GenerateRequest(prompt="abc"), "prompt"),
    "stop string": (
        lambda: pb.GenerateRequest(prompt="hi", stopping=pb.StoppingCriteria(stop=["x", "abc"])),
        "stopping.stop[1]",
    ),
}


@pytest.mark.parametrize("case", sorted(REQUESTS))
async def test_generate_names_the_field_that_is_not_utf8(case: str, server: TokenwireServer) -> None:
    build, field = REQUESTS[case]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await channel.unary_unary(GENERATE)(patched(build()), timeout=30)
    error = raised.value
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
    details = dict(error.trailing_metadata() or ())["grpc-status-details-bin"]
    assert isinstance(details, bytes)
    assert fields_of(status_pb2.Status.FromString(details)) == [field]
    assert "UTF-8" in (error.details() or "")


async def test_a_stream_names_the_field_and_serves_the_next_request(server: TokenwireServer) -> None:
    bad = pb.StreamGenerateRequest(
        generate=pb.GenerateRequest(request_id="bad", messages=[pb.ChatMessage(role="user", content="abc")])
    )
    good = pb.StreamGenerateRequest(
        generate=pb.GenerateRequest(
            request_id="good",
            token_ids=pb.TokenIds(ids=[1, 2]),
            stopping=pb.StoppingCriteria(max_new_tokens=2),
        )
    )
    events: list[pb.StreamGenerateResponse] = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        call = channel.stream_stream(STREAM_GENERATE)(
            iter([patched(bad), good.SerializeToString()]), timeout=30
        )
        async for raw in call:
            events.append(pb.StreamGenerateResponse.FromString(raw))
            if events[-1].WhichOneof("event") == "completed":
                break
    errors = [event.error for event in events if event.WhichOneof("event") == "error"]
    assert len(errors) == 1 and errors[0].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert fields_of(errors[0]) == ["messages[0].content"]  # as every error of a generation on a stream
    assert events[-1].completed.request_id == "good"

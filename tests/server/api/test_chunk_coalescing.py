"""A stream that falls behind gets merged chunks, never reordered or lost events."""

from __future__ import annotations

from tokenwire.server.api.stream import coalesce_chunks
from tokenwire.v1 import inference_service_pb2 as pb


def chunk(request_id: str, text: str, token: int) -> pb.StreamGenerateResponse:
    return pb.StreamGenerateResponse(request_id=request_id, chunk=pb.TokenChunk(text=text, token_ids=[token]))


def completed(request_id: str) -> pb.StreamGenerateResponse:
    return pb.StreamGenerateResponse(
        request_id=request_id, completed=pb.GenerateResponse(request_id=request_id)
    )


def test_chunks_of_one_request_merge_in_order_around_other_requests() -> None:
    backlog = [
        chunk("a", "He", 1),
        None,
        chunk("b", "x", 9),
        chunk("a", "llo", 2),
        completed("a"),
        chunk("b", "y", 8),
    ]
    merged = coalesce_chunks(backlog)
    assert [(m.request_id, m.WhichOneof("event")) for m in merged] == [
        ("a", "chunk"),
        ("b", "chunk"),
        ("a", "completed"),
    ]
    assert merged[0].chunk.text == "Hello" and list(merged[0].chunk.token_ids) == [1, 2]
    assert merged[1].chunk.text == "xy" and list(merged[1].chunk.token_ids) == [9, 8]


def test_chunks_after_a_request_s_final_event_are_not_merged_into_earlier_ones() -> None:
    # A request id reused after completion: its new chunk must follow the completion.
    backlog = [chunk("a", "1", 1), completed("a"), chunk("a", "2", 2)]
    merged = coalesce_chunks(backlog)
    assert [m.WhichOneof("event") for m in merged] == ["chunk", "completed", "chunk"]
    assert [m.chunk.text for m in (merged[0], merged[2])] == ["1", "2"]


def test_a_single_message_passes_unchanged() -> None:
    only = chunk("a", "x", 1)
    assert coalesce_chunks([only]) == [only]


def test_chunks_of_different_completions_never_merge() -> None:
    def of_completion(index: int, text: str, token: int) -> pb.StreamGenerateResponse:
        message = chunk("a", text, token)
        message.chunk.index = index
        return message

    backlog = [
        of_completion(0, "A", 1),
        of_completion(1, "x", 9),
        of_completion(0, "B", 2),
        of_completion(1, "y", 8),
        completed("a"),
    ]
    merged = coalesce_chunks(backlog)
    assert [(m.WhichOneof("event"), m.chunk.index) for m in merged] == [
        ("chunk", 0),
        ("chunk", 1),
        ("completed", 0),
    ]
    assert merged[0].chunk.text == "AB" and list(merged[0].chunk.token_ids) == [1, 2]
    assert merged[1].chunk.text == "xy" and list(merged[1].chunk.token_ids) == [9, 8]

"""n completions of one request in the engine, round by round over the fake runners: the prompt
is prefilled once and copied, the request is heard as one (one start, indexed tokens, one end),
a cancel stops every completion, and the n count against the queue.

What the copies compute on real models is in test_completions_exactness.py.
"""

from __future__ import annotations

from tests.support.callers_harness import FLOOD, QUIET, Harness
from tests.support.fake_runner import RowCopyingRunner
from tokenwire.server.engine.errors import ErrorKind, GenerationError
from tokenwire.server.engine.types import (
    AbortReason,
    Completed,
    Failed,
    FinishReason,
    Started,
    TokensGenerated,
)


def terminal(h: Harness, rid: str) -> list[Completed | Failed]:
    return [e for e in h.events[rid] if isinstance(e, Completed | Failed)]


def tokens_by_index(h: Harness, rid: str) -> dict[int, int]:
    counts: dict[int, int] = {}
    for event in h.events[rid]:
        if isinstance(event, TokensGenerated):
            counts[event.index] = counts.get(event.index, 0) + len(event.token_ids)
    return counts


def test_n_completions_prefill_the_prompt_once_and_are_heard_as_one_request() -> None:
    h = Harness(slots=4, queue=8, copies_rows=True, prompt_tokens=40)
    h.submit("r", QUIET, tokens=6, n=3)
    h.rounds(20)

    (final,) = terminal(h, "r")
    assert isinstance(final, Completed)
    result = final.result
    assert [c.index for c in result.choices] == [0, 1, 2]
    assert all(len(c.token_ids) == 6 and c.finish_reason is FinishReason.LENGTH for c in result.choices)
    assert result.completion_tokens == 18 and result.prompt_tokens == 40 and result.token_ids == ()
    assert sum(isinstance(e, Started) for e in h.events["r"]) == 1
    assert tokens_by_index(h, "r") == {0: 6, 1: 6, 2: 6}
    # The model saw the prompt once; the two other completions copied its 40 rows, slot to slot
    # from the first, which still decoded.
    stats = h.engine.stats
    assert stats.prefill_tokens == 40 and stats.forked_prompt_tokens == 80
    assert isinstance(h.runner, RowCopyingRunner)
    source = h.keys["r"]
    assert [(source_id, length) for _, source_id, length in h.runner.copies] == [(source, 40), (source, 40)]
    assert h.runner.loads == []
    assert h.engine.live_count == 0 and h.runner.lengths == {}


def test_completions_whose_source_has_ended_copy_the_prompt_kept_in_host_memory() -> None:
    # One slot: the first completion prefills, decodes and ends before the others get the slot,
    # so its rows are gone from the cache and each follower loads the kept copy.
    h = Harness(slots=1, queue=8, copies_rows=True, prompt_tokens=40)
    h.submit("r", QUIET, tokens=3, n=3)
    h.rounds(20)

    (final,) = terminal(h, "r")
    assert isinstance(final, Completed) and final.result.completion_tokens == 9
    assert h.engine.stats.prefill_tokens == 40 and h.engine.stats.forked_prompt_tokens == 80
    assert isinstance(h.runner, RowCopyingRunner)
    assert h.runner.copies == [] and [length for _, length in h.runner.loads] == [40, 40]


def test_completions_wait_for_the_prompt_they_copy_and_get_their_first_token_the_next_round() -> None:
    # Another request decodes, so prompt work is paced at one 8-token chunk a round: the
    # 40-token prompt takes five rounds, and the other completions start only after it.
    h = Harness(slots=4, queue=8, copies_rows=True, prompt_tokens=40, chunk=8)
    h.submit("busy", FLOOD, tokens=60)
    h.rounds(1)
    h.submit("r", QUIET, tokens=4, n=3)
    assert isinstance(h.runner, RowCopyingRunner)
    for _ in range(4):
        h.rounds(1)
        assert h.runner.copies == [] and tokens_by_index(h, "r") == {}
    h.rounds(1)
    # The prompt is done: its completion's first token, and its second from the round's decode
    # step, which it joins at once; the others copy the prompt in the next round and do the same.
    assert tokens_by_index(h, "r") == {0: 2}
    h.rounds(1)
    assert tokens_by_index(h, "r") == {0: 3, 1: 2, 2: 2}
    assert [length for _, _, length in h.runner.copies] == [40, 40]
    h.rounds(10)
    (final,) = terminal(h, "r")
    assert isinstance(final, Completed) and final.result.completion_tokens == 12


def test_cancelling_the_request_ends_every_completion_as_cancelled() -> None:
    h = Harness(slots=4, queue=8, copies_rows=True)
    h.submit("r", QUIET, tokens=50, n=3)
    h.rounds(4)
    h.engine.abort(h.keys["r"], AbortReason.CANCELLED)
    h.rounds(1)

    (final,) = terminal(h, "r")
    assert isinstance(final, Completed)
    assert final.result.finish_reason is FinishReason.CANCELLED
    assert [c.finish_reason for c in final.result.choices] == [FinishReason.CANCELLED] * 3
    assert all(0 < len(c.token_ids) < 50 for c in final.result.choices)
    assert h.engine.live_count == 0
    assert isinstance(h.runner, RowCopyingRunner) and h.runner.lengths == {}


def test_a_deadline_fails_the_request_once_for_all_its_completions() -> None:
    h = Harness(slots=4, queue=8, copies_rows=True)
    h.submit("r", QUIET, tokens=50, n=3, deadline=h.clock() + 5.0)
    h.rounds(3)
    h.clock.advance(6.0)
    h.rounds(2)

    (final,) = terminal(h, "r")
    assert isinstance(final, Failed) and final.error.kind is ErrorKind.DEADLINE_EXCEEDED
    assert final.completion_tokens == sum(tokens_by_index(h, "r").values()) > 0
    assert h.engine.live_count == 0


def test_n_completions_count_as_n_requests_against_the_queue() -> None:
    h = Harness(slots=1, queue=2)
    h.submit("r", QUIET, tokens=5, n=3)  # one slot and the queue's two places
    try:
        h.submit("late", QUIET, tokens=5)
    except GenerationError as error:
        refused: GenerationError | None = error
    else:
        refused = None
    assert refused is not None and refused.kind is ErrorKind.RESOURCE_EXHAUSTED
    h.rounds(40)
    (final,) = terminal(h, "r")
    assert isinstance(final, Completed) and len(final.result.choices) == 3


def test_without_row_copying_each_completion_prefills_its_prompt() -> None:
    h = Harness(slots=4, queue=8, copies_rows=False, prompt_tokens=40)
    h.submit("r", QUIET, tokens=5, n=3)
    h.rounds(20)

    (final,) = terminal(h, "r")
    assert isinstance(final, Completed) and final.result.completion_tokens == 15
    assert h.engine.stats.prefill_tokens == 120 and h.engine.stats.forked_prompt_tokens == 0


def test_completions_beyond_the_free_slots_wait_their_turn_and_still_copy_the_prompt() -> None:
    h = Harness(slots=2, queue=8, copies_rows=True, prompt_tokens=40)
    h.submit("r", QUIET, tokens=5, n=4)
    h.rounds(40)

    (final,) = terminal(h, "r")
    assert isinstance(final, Completed) and [len(c.token_ids) for c in final.result.choices] == [5] * 4
    assert h.engine.stats.prefill_tokens == 40 and h.engine.stats.forked_prompt_tokens == 120

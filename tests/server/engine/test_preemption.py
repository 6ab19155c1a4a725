"""Preemption in the scheduler, round by round: who gives a slot up, when, and that the work
given up resumes where it stopped.

The engine is driven through `Engine.run_round` over the fake runner that can copy KV rows
(tests/support/fake_runner.py), which checks that a swapped-out sequence comes back with exactly
the rows it had and never decodes without a slot. Exactness over real models is in
test_preemption_exactness.py.
"""

from __future__ import annotations

from tests.support.callers_harness import FLOOD, QUIET, Harness
from tests.support.fake_runner import RowCopyingRunner
from tokenwire.server.engine.engine import EngineStats
from tokenwire.server.engine.errors import ErrorKind
from tokenwire.server.engine.types import (
    AbortReason,
    Caller,
    Completed,
    Failed,
    FinishReason,
    Priority,
    Started,
)


def running(h: Harness) -> set[str]:
    """Requests holding a slot (KV rows in the runner) now."""
    assert isinstance(h.runner, RowCopyingRunner)
    return {rid for rid, key in h.keys.items() if key in h.runner.lengths}


def stats(h: Harness) -> EngineStats:
    return h.engine.stats


def test_a_caller_under_its_share_gets_a_slot_in_the_next_round_when_another_holds_every_slot() -> None:
    h = Harness(slots=4, queue=32, copies_rows=True)
    for i in range(12):
        h.submit(f"f{i}", FLOOD, tokens=40)
    h.rounds(5)
    assert h.started == ["f0", "f1", "f2", "f3"]

    h.submit("q0", QUIET, tokens=5)
    h.rounds(1)
    assert h.started[-1] == "q0"
    assert stats(h).preemptions == 1
    # One of the flood's gave its slot up, and exactly its rows were read: the prompt's and all
    # but its newest token's, which it feeds when it decodes again.
    (swapped,) = {"f0", "f1", "f2", "f3"} - running(h)
    assert isinstance(h.runner, RowCopyingRunner)
    assert h.runner.reads == [(h.keys[swapped], 0, 4 + h.tokens_of(swapped) - 1)]


def test_preempted_work_resumes_with_every_token_once_and_one_start() -> None:
    h = Harness(slots=2, queue=16, copies_rows=True)
    h.submit("f0", FLOOD, tokens=30)
    h.submit("f1", FLOOD, tokens=30)
    h.rounds(6)
    h.submit("q0", QUIET, tokens=4)
    h.rounds(1)
    assert stats(h).preemptions == 1
    h.rounds(100)

    for rid, tokens in (("f0", 30), ("f1", 30), ("q0", 4)):
        final = h.events[rid][-1]
        assert isinstance(final, Completed), rid
        assert final.result.finish_reason is FinishReason.LENGTH
        assert len(final.result.token_ids) == tokens
        assert h.tokens_of(rid) == tokens, "streamed exactly once each"
        assert sum(isinstance(e, Started) for e in h.events[rid]) == 1
    assert stats(h).resumptions == 1
    # Swapped back in with the rows it had: the load matched the read.
    (seq, start, stop), (loaded_seq, length) = h.runner.reads[-1], h.runner.loads[-1]
    assert (loaded_seq, length) == (seq, stop - start)


def long_prompts_mid_prefill(h: Harness, *flood: str) -> None:
    """f0 decodes (so prompt work is paced: one chunk a round) while `flood`'s long prompts,
    admitted together, share that chunk: the first gets it, the others none yet."""
    h.submit("f0", FLOOD, tokens=60)
    h.rounds(1)  # nothing decoded yet: f0's whole prompt in one round
    for rid in flood:
        h.submit(rid, FLOOD, tokens=10)
    h.rounds(3)


def test_a_long_prompt_mid_prefill_gives_its_slot_to_a_caller_under_its_share() -> None:
    h = Harness(slots=2, queue=16, copies_rows=True, prompt_tokens=64, chunk=8)
    long_prompts_mid_prefill(h, "f1")
    assert isinstance(h.runner, RowCopyingRunner)
    assert h.runner.lengths[h.keys["f1"]] == 24, "three chunks of its prompt in, five to go"

    h.submit("q0", QUIET, tokens=3)
    h.rounds(1)

    # The slot went to the quiet caller at once, taken from the prompt with the fewest rows
    # (f0 has all 64 of its prompt's and more), whose 24 rows were set aside.
    assert h.started[-1] == "q0" and stats(h).preemptions == 1
    assert running(h) == {"f0", "q0"}
    assert h.runner.reads == [(h.keys["f1"], 0, 24)]
    h.rounds(200)
    for rid, tokens in (("f0", 60), ("f1", 10), ("q0", 3)):
        final = h.events[rid][-1]
        assert isinstance(final, Completed), rid
        assert len(final.result.token_ids) == tokens and h.tokens_of(rid) == tokens, rid
        assert sum(isinstance(e, Started) for e in h.events[rid]) == 1, rid
    # It came back with its 24 rows and prefilled on from there (the runner refuses a prefill
    # that does not continue where the rows end).
    assert (h.keys["f1"], 24) in h.runner.loads and stats(h).resumptions == 1
    assert stats(h).prefill_tokens == 3 * 64, "no prompt token was prefilled twice"


def test_a_prompt_preempted_before_its_first_chunk_starts_afresh_when_it_resumes() -> None:
    h = Harness(slots=3, queue=16, copies_rows=True, prompt_tokens=64, chunk=8)
    long_prompts_mid_prefill(h, "f1", "f2")
    assert isinstance(h.runner, RowCopyingRunner)
    assert h.keys["f2"] not in h.runner.lengths, "the round's one chunk went to f1"

    h.submit("q0", QUIET, tokens=3)
    h.rounds(1)

    assert h.started[-1] == "q0" and running(h) == {"f0", "f1", "q0"}
    assert h.runner.reads == [], "nothing of f2 to set aside"
    h.rounds(300)
    final = h.events["f2"][-1]
    assert isinstance(final, Completed) and len(final.result.token_ids) == 10
    assert sum(isinstance(e, Started) for e in h.events["f2"]) == 1
    assert h.runner.loads == [] and stats(h).resumptions == 1
    assert stats(h).prefill_tokens == 4 * 64


def test_callers_at_their_shares_never_take_slots_from_each_other() -> None:
    h = Harness(slots=4, queue=32, copies_rows=True)
    for i in range(2):
        h.submit(f"f{i}", FLOOD, tokens=40)
        h.submit(f"q{i}", QUIET, tokens=40)
    h.rounds(3)
    for i in range(2, 6):
        h.submit(f"f{i}", FLOOD, tokens=40)
        h.submit(f"q{i}", QUIET, tokens=40)
    h.rounds(30)
    assert stats(h).preemptions == 0
    assert running(h) == {"f0", "f1", "q0", "q1"}


def test_a_preempting_caller_stops_at_its_share_and_nothing_goes_back_and_forth() -> None:
    h = Harness(slots=4, queue=32, copies_rows=True)
    for i in range(8):
        h.submit(f"f{i}", FLOOD, tokens=200)
    h.rounds(3)
    for i in range(8):
        h.submit(f"q{i}", QUIET, tokens=200)
    h.rounds(40)
    # One slot a round until the quiet caller holds its half; then no more swaps either way.
    assert stats(h).preemptions == 2
    held = running(h)
    assert len([r for r in held if r.startswith("q")]) == 2
    assert len([r for r in held if r.startswith("f")]) == 2


def test_weights_set_the_share_a_caller_may_preempt_up_to() -> None:
    h = Harness(slots=4, queue=32, copies_rows=True)
    heavy = Caller("heavy", weight=3.0)
    for i in range(8):
        h.submit(f"f{i}", FLOOD, tokens=200)
    h.rounds(3)
    for i in range(8):
        h.submit(f"h{i}", heavy, tokens=200)
    h.rounds(40)
    assert len([r for r in running(h) if r.startswith("h")]) == 3  # 3/4 of the slots


def test_a_lone_caller_never_preempts_itself() -> None:
    h = Harness(slots=2, queue=16, copies_rows=True)
    for i in range(6):
        h.submit(f"f{i}", FLOOD, tokens=10)
    h.rounds(100)
    assert stats(h).preemptions == 0
    assert all(isinstance(h.events[f"f{i}"][-1], Completed) for i in range(6))


def test_batch_work_gives_its_slot_to_a_more_urgent_request_when_every_slot_is_busy() -> None:
    h = Harness(slots=3, queue=16, copies_rows=True)
    for i in range(4):
        h.submit(f"b{i}", FLOOD, Priority.BATCH, tokens=100)
    h.rounds(3)
    h.submit("d0", QUIET, tokens=100)  # takes the slot BATCH leaves free
    h.rounds(2)
    assert running(h) == {"b0", "b1", "d0"}

    h.submit("i0", QUIET, Priority.INTERACTIVE, tokens=3)
    h.rounds(1)
    assert h.started[-1] == "i0", "admitted in the very next round"
    assert stats(h).preemptions == 1
    assert "d0" in running(h), "DEFAULT work is not preempted for INTERACTIVE"
    h.rounds(400)
    assert all(isinstance(events[-1], Completed) for events in h.events.values())
    assert h.tokens_of("b0") == h.tokens_of("b1") == 100


def test_without_row_copying_or_with_preemption_off_running_work_keeps_its_slot() -> None:
    for h in (Harness(slots=2, queue=16), Harness(slots=2, queue=16, copies_rows=True, preemption=False)):
        h.submit("f0", FLOOD, tokens=20)
        h.submit("f1", FLOOD, tokens=20)
        h.rounds(2)
        h.submit("q0", QUIET, tokens=2)
        h.rounds(5)
        assert stats(h).preemptions == 0
        assert "q0" not in h.started


def swap_one_out(h: Harness, *, deadline: float | None = None) -> str:
    """Two flood generations fill both slots; a quiet request takes one. The swapped-out one."""
    h.submit("f0", FLOOD, tokens=50, deadline=deadline)
    h.submit("f1", FLOOD, tokens=50, deadline=deadline)
    h.rounds(5)
    h.submit("q0", QUIET, tokens=50)
    h.rounds(1)
    (swapped,) = {"f0", "f1"} - running(h)
    return swapped


def test_cancelling_preempted_work_ends_it_with_the_tokens_it_had() -> None:
    h = Harness(slots=2, queue=16, copies_rows=True)
    swapped = swap_one_out(h)
    before = h.tokens_of(swapped)
    assert before > 0

    h.engine.abort(h.keys[swapped], AbortReason.CANCELLED)
    h.rounds(1)
    final = h.events[swapped][-1]
    assert isinstance(final, Completed)
    assert final.result.finish_reason is FinishReason.CANCELLED
    assert len(final.result.token_ids) == before
    assert h.engine.queue_depth == 0
    # Its slot is not taken back later: the one left running and the quiet one finish alone.
    h.rounds(100)
    assert stats(h).resumptions == 0


def test_preempted_work_whose_deadline_passes_fails_as_a_generation_deadline() -> None:
    h = Harness(slots=2, queue=16, copies_rows=True)
    swapped = swap_one_out(h, deadline=h.clock() + 10.0)
    h.clock.advance(11.0)
    h.rounds(1)
    final = h.events[swapped][-1]
    assert isinstance(final, Failed)
    assert final.error.kind is ErrorKind.DEADLINE_EXCEEDED
    assert "during generation" in final.error.message
    assert final.completion_tokens > 0


def test_shares_within_a_priority_count_only_the_slots_more_urgent_work_leaves() -> None:
    h = Harness(slots=4, queue=32, copies_rows=True, reserved=0)
    h.submit("i0", QUIET, Priority.INTERACTIVE, tokens=200)
    h.submit("i1", QUIET, Priority.INTERACTIVE, tokens=200)
    h.submit("f0", FLOOD, tokens=200)
    h.submit("f1", FLOOD, tokens=200)
    h.rounds(3)
    other = Caller("other")
    h.submit("o0", other, tokens=200)
    h.rounds(1)
    # DEFAULT has 2 slots left by INTERACTIVE work: one each for flood and other.
    assert h.started[-1] == "o0"
    assert running(h) - {"f0", "f1"} == {"i0", "i1", "o0"} and len(running(h)) == 4

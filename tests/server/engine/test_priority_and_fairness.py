"""Priorities and callers in the scheduler, round by round.

An engine that was never started is driven through `Engine.run_round` with the fake runner and
manual clock of tests/support/fake_runner.py (what is checked is the order of admission, not
what a model computes), so "within one step" is an exact count of rounds.
"""

from __future__ import annotations

import pytest

from tests.support.callers_harness import FLOOD, QUIET, Harness
from tokenwire.server.engine.errors import ErrorKind, GenerationError
from tokenwire.server.engine.types import Caller, Completed, Priority


def test_batch_work_never_holds_an_interactive_request_beyond_the_next_round() -> None:
    h = Harness(slots=4, queue=32)
    for i in range(20):
        h.submit(f"batch{i}", FLOOD, Priority.BATCH, tokens=1000)
    h.rounds(3)
    assert h.started == ["batch0", "batch1", "batch2"]  # one slot stays free for the others
    for step in range(5):
        h.submit(f"interactive{step}", QUIET, Priority.INTERACTIVE, tokens=2)
        h.rounds(1)
        assert h.started[-1] == f"interactive{step}", "admitted in the very next round"
    assert len([r for r in h.started if r.startswith("batch")]) == 3


def test_a_higher_priority_is_admitted_before_a_lower_one_already_waiting() -> None:
    h = Harness(slots=2, queue=16, reserved=0)
    for i in range(4):
        h.submit(f"default{i}", FLOOD, tokens=3)
    h.rounds(1)
    assert h.started == ["default0", "default1"]
    h.submit("batch", QUIET, Priority.BATCH, tokens=3)
    h.submit("interactive", QUIET, Priority.INTERACTIVE, tokens=3)
    h.rounds(20)
    assert h.started[2] == "interactive"  # ahead of default2, which waited longer
    assert h.started[-1] == "batch"


def test_within_a_priority_callers_take_turns_whatever_order_they_queued_in() -> None:
    h = Harness(slots=1, queue=64, reserved=0)
    for i in range(10):
        h.submit(f"f{i}", FLOOD, tokens=1)
    for i in range(3):
        h.submit(f"q{i}", QUIET, tokens=1)
    h.rounds(30)
    assert h.started[:8] == ["f0", "q0", "f1", "q1", "f2", "q2", "f3", "f4"]


def test_a_caller_over_its_share_is_refused_with_a_retry_hint_while_another_still_gets_in() -> None:
    h = Harness(slots=2, queue=8)
    h.submit("f0", FLOOD)
    h.submit("f1", FLOOD)
    h.rounds(1)  # both running
    for i in range(8):
        h.submit(f"queued{i}", FLOOD)
    with pytest.raises(GenerationError) as full:
        h.submit("one-too-many", FLOOD)
    assert full.value.reason == "QUEUE_FULL"  # alone, the caller had the whole queue

    h.submit("quiet0", QUIET)  # under its share (half of 8): in, although the queue is full
    with pytest.raises(GenerationError) as over:
        h.submit("flood-again", FLOOD)
    assert over.value.kind is ErrorKind.RESOURCE_EXHAUSTED
    assert over.value.reason == "CALLER_OVER_SHARE"
    assert over.value.retry_after is not None and over.value.retry_after > 0
    for i in range(1, 4):
        h.submit(f"quiet{i}", QUIET)
    with pytest.raises(GenerationError) as quiet_full:
        h.submit("quiet4", QUIET)  # now at its share of 4
    assert quiet_full.value.reason == "CALLER_OVER_SHARE"
    assert h.engine.queue_depth == 12  # 8 + 4: over the size by the quiet caller's share, bounded
    # Turns alternate from here, so the quiet caller is not stuck behind the flood.
    h.rounds(200)
    assert h.started.index("quiet0") < h.started.index("queued2")


def test_a_caller_at_its_own_queue_limit_is_refused_naming_it() -> None:
    h = Harness(slots=1, queue=16)
    limited = Caller("nightly", max_queued=2)
    h.submit("running", limited)
    h.rounds(1)
    h.submit("w0", limited)
    h.submit("w1", limited)
    with pytest.raises(GenerationError) as refused:
        h.submit("w2", limited)
    assert refused.value.reason == "CALLER_QUEUE_FULL" and "'nightly'" in refused.value.message
    h.submit("other", QUIET)


def test_requests_of_every_caller_still_complete() -> None:
    h = Harness(slots=2, queue=16)
    for i in range(4):
        h.submit(f"f{i}", FLOOD, Priority.BATCH, tokens=2)
        h.submit(f"q{i}", QUIET, Priority.INTERACTIVE, tokens=2)
    h.rounds(40)
    done = {rid for rid, events in h.events.items() if isinstance(events[-1], Completed)}
    assert done == {f"f{i}" for i in range(4)} | {f"q{i}" for i in range(4)}


def test_a_quieter_caller_s_prompt_is_worked_on_before_a_flood_s_prompts_that_came_first() -> None:
    h = Harness(slots=4, queue=16, prompt_tokens=16, chunk=4)
    for i in range(3):
        h.submit(f"f{i}", FLOOD, tokens=100)
    h.rounds(1)  # f0 prefilled at full speed; f1 and f2 then get one chunk a round
    assert h.tokens_of("f0") > 0 and h.tokens_of("f1") == h.tokens_of("f2") == 0
    calls_before = len(h.runner.prefills)
    h.submit("q0", QUIET, tokens=2)
    h.rounds(4)
    since = [(c.seq_id, c.start) for c in h.runner.prefills[calls_before:]]
    # All four of its chunks, one a round, ahead of the flood's unfinished prompts.
    assert since == [(h.keys["q0"], start) for start in (0, 4, 8, 12)]
    assert h.tokens_of("q0") == 2  # its first token at the last chunk, its second that round
    assert h.tokens_of("f1") == h.tokens_of("f2") == 0

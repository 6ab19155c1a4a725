"""The waiting queue's order: priority first, then weighted turns between callers."""

from __future__ import annotations

from dataclasses import dataclass

from tokenwire.server.engine.fair_queue import FairQueue
from tokenwire.server.engine.types import Caller, Priority

SEARCH = Caller("search", weight=3)
REPORTS = Caller("reports")
FLOOD = Caller("flood")


@dataclass(eq=False)
class Entry:
    name: str
    caller: Caller
    priority: Priority = Priority.DEFAULT
    ready: bool = True
    work: int = 1
    queued_tokens: int = 0


def drain(queue: FairQueue[Entry]) -> list[str]:
    order = []
    while (entry := queue.pop()) is not None:
        order.append(entry.name)
    return order


def test_a_more_urgent_priority_always_goes_first() -> None:
    queue: FairQueue[Entry] = FairQueue()
    for i in range(3):
        queue.push(Entry(f"batch{i}", REPORTS, Priority.BATCH))
    queue.push(Entry("default", REPORTS))
    queue.push(Entry("interactive", FLOOD, Priority.INTERACTIVE))
    assert drain(queue) == ["interactive", "default", "batch0", "batch1", "batch2"]
    assert len(queue) == 0


def test_callers_take_turns_in_proportion_to_their_weights() -> None:
    queue: FairQueue[Entry] = FairQueue()
    for i in range(8):
        queue.push(Entry(f"r{i}", REPORTS))
    for i in range(8):
        queue.push(Entry(f"s{i}", SEARCH))
    first_eight = drain(queue)[:8]
    # Weight 3 against 1: three of every four turns go to search while both wait.
    assert sum(name.startswith("s") for name in first_eight) == 6
    assert [name for name in first_eight if name.startswith("r")] == ["r0", "r1"]


def test_a_flooding_caller_does_not_delay_another_beyond_its_turn() -> None:
    queue: FairQueue[Entry] = FairQueue()
    for i in range(50):
        queue.push(Entry(f"f{i}", FLOOD))
    queue.pop()
    queue.push(Entry("late", REPORTS))
    # The newcomer joins at the current virtual time: it is served next or right after.
    assert drain(queue).index("late") <= 1


def test_an_idle_caller_earns_no_credit_for_later() -> None:
    queue: FairQueue[Entry] = FairQueue()
    for i in range(20):
        queue.push(Entry(f"f{i}", FLOOD))
    for _ in range(10):
        queue.pop()
    for i in range(4):
        queue.push(Entry(f"b{i}", REPORTS))
    # Equal weights: strict alternation from now on, not four reports in a row.
    assert drain(queue)[:6] == ["b0", "f10", "b1", "f11", "b2", "f12"]


def test_an_entry_not_ready_yet_lets_the_ready_ones_go_first_and_keeps_its_place() -> None:
    queue: FairQueue[Entry] = FairQueue()
    compiling = Entry("compiling", REPORTS, ready=False)
    queue.push(compiling)
    queue.push(Entry("next", REPORTS))
    assert queue.pop() is not None and len(queue) == 1
    assert queue.pop() is None
    compiling.ready = True
    assert queue.pop() is compiling


def test_pop_skips_what_the_caller_disallows_and_remove_takes_out_any_entry() -> None:
    queue: FairQueue[Entry] = FairQueue()
    batch = Entry("batch", REPORTS, Priority.BATCH)
    queue.push(batch)
    queue.push(Entry("default", SEARCH))
    assert queue.pop(lambda e: e.priority is not Priority.BATCH) is not None
    assert queue.pop(lambda e: e.priority is not Priority.BATCH) is None
    queue.remove(batch)
    assert len(queue) == 0 and queue.queued_by("reports") == 0


def test_shares_split_the_queue_by_weight_among_the_callers_queueing() -> None:
    queue: FairQueue[Entry] = FairQueue()
    assert queue.share(FLOOD, 64) == 64  # alone, a caller may use it all
    queue.push(Entry("s", SEARCH))
    assert queue.share(FLOOD, 64) == 16  # weights 1 and 3
    assert queue.share(SEARCH, 64) == 64  # the only one queueing
    queue.push(Entry("f", FLOOD))
    assert queue.share(SEARCH, 64) == 48
    assert queue.queued_by("search") == 1


def test_peek_names_what_pop_returns_and_leaves_it_queued() -> None:
    queue: FairQueue[Entry] = FairQueue()
    for i in range(3):
        queue.push(Entry(f"r{i}", REPORTS))
        queue.push(Entry(f"f{i}", FLOOD))
    only_flood = lambda e: e.caller is FLOOD  # noqa: E731
    peeked = queue.peek(only_flood)
    assert peeked is not None and peeked.name == "f0"
    assert len(queue) == 6
    assert queue.pop(only_flood) is peeked


def test_taking_an_entry_out_of_turn_uses_its_caller_s_turn() -> None:
    queue: FairQueue[Entry] = FairQueue()
    entries = {}
    for i in range(4):
        for caller in (REPORTS, FLOOD):
            entries[f"{caller.name[0]}{i}"] = entry = Entry(f"{caller.name[0]}{i}", caller)
            queue.push(entry)
    queue.take(entries["f0"])  # flood's turn, taken before reports had its own
    assert drain(queue)[:3] == ["r0", "r1", "f1"]


def test_work_pushed_back_to_the_front_goes_before_its_caller_s_other_requests() -> None:
    queue: FairQueue[Entry] = FairQueue()
    queue.push(Entry("f1", FLOOD))
    queue.push_front(Entry("f0", FLOOD))
    assert drain(queue) == ["f0", "f1"]
    assert queue.queued_by("flood") == 0


def test_callers_at_a_priority_are_those_with_a_ready_request_there() -> None:
    queue: FairQueue[Entry] = FairQueue()
    queue.push(Entry("s", SEARCH))
    queue.push(Entry("r", REPORTS, ready=False))
    queue.push(Entry("f", FLOOD, Priority.BATCH))
    assert queue.callers_at(Priority.DEFAULT) == {"search": 3}
    assert queue.callers_at(Priority.BATCH) == {"flood": 1}


def test_callers_share_turns_by_the_work_they_ask_for_not_by_requests() -> None:
    queue: FairQueue[Entry] = FairQueue()
    long_prompts, short_prompts = Caller("long"), Caller("short")
    for i in range(20):
        queue.push(Entry(f"l{i}", long_prompts, work=400))
        queue.push(Entry(f"s{i}", short_prompts, work=100))
    first_twenty = drain(queue)[:20]
    # Each long request asks four times a short one's work: four short turns for every long one.
    assert sum(name.startswith("s") for name in first_twenty) == 16
    assert sum(name.startswith("l") for name in first_twenty) == 4


def test_weights_scale_the_work_a_caller_is_served() -> None:
    queue: FairQueue[Entry] = FairQueue()
    for i in range(12):
        queue.push(Entry(f"s{i}", SEARCH, work=300))  # weight 3, three times the work
        queue.push(Entry(f"r{i}", REPORTS, work=100))
    first_twelve = drain(queue)[:12]
    # Work over weight is equal for both, so they alternate.
    assert sum(name.startswith("s") for name in first_twelve) == 6


def test_queued_tokens_are_counted_per_caller_and_in_all_until_each_entry_leaves() -> None:
    queue: FairQueue[Entry] = FairQueue()
    a = Entry("a", FLOOD, queued_tokens=300)
    b = Entry("b", FLOOD, queued_tokens=200)
    c = Entry("c", REPORTS, queued_tokens=50)
    for entry in (a, b, c):
        queue.push(entry)
    assert (queue.queued_tokens, queue.queued_tokens_by("flood"), queue.queued_tokens_by("reports")) == (
        550,
        500,
        50,
    )

    a.queued_tokens = 0  # what it is when it leaves does not matter: what it added is taken back
    queue.take(a)
    assert (queue.queued_tokens, queue.queued_tokens_by("flood")) == (250, 200)
    queue.remove(c)
    assert (queue.queued_tokens, queue.queued_tokens_by("reports")) == (200, 0)
    queue.clear()
    assert (queue.queued_tokens, queue.queued_tokens_by("flood")) == (0, 0)

"""The scheduler's plans, from hand-made requests and clock readings: no runner, no tokenizer, no thread.

Each test builds requests, asks `Scheduler.schedule` for a plan and, where a round's result
matters, hands back a `RoundOutcome` written by hand, as the engine core would: the plan's
progress counts unless the outcome says otherwise, and a request the core ends is handed back
with `Scheduler.finish`.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import replace
from typing import cast

import pytest

from tokenwire.server.engine.errors import ErrorKind, GenerationError
from tokenwire.server.engine.pacing import MIN_PACED_CHUNK
from tokenwire.server.engine.plan import Abort, Entry, Finished, RoundOutcome, RoundPlan, Verification
from tokenwire.server.engine.prefix_cache import PrefixLease
from tokenwire.server.engine.request import CompletionSet, IllegalTransitionError, Request, RequestStatus
from tokenwire.server.engine.scheduler import PrefixLookup, Scheduler, SchedulerConfig
from tokenwire.server.engine.speculation import NEIGHBOUR_SHARE, SpeculationSettings
from tokenwire.server.engine.types import (
    AbortReason,
    Caller,
    EngineEvent,
    FinishReason,
    GenerationRequest,
    Priority,
    StopConditions,
)
from tokenwire.server.sampling.constraint import CompiledFormat
from tokenwire.server.sampling.params import SamplingParams

NOW = 100.0


def ignore(_: EngineEvent) -> None:
    pass


class Requests:
    """Numbers requests as the engine does and remembers them by name."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.by_name: dict[str, Request] = {}

    def add(
        self,
        name: str,
        *,
        prompt: int = 8,
        new_tokens: int = 16,
        caller: Caller | None = None,
        priority: Priority = Priority.DEFAULT,
        deadline: float | None = None,
        response_format: Future[CompiledFormat] | None = None,
        group: CompletionSet | None = None,
    ) -> Request:
        spec = GenerationRequest(
            request_id=name,
            model="m",
            prompt_ids=tuple(range(1, prompt + 1)),
            sampling=SamplingParams(),
            stopping=StopConditions(max_new_tokens=new_tokens),
            received_at=NOW,
            deadline=deadline,
            caller=caller or Caller("anonymous"),
            priority=priority,
        )
        request = Request(len(self.by_name) + 1, spec, ignore, response_format, group=group)
        self.scheduler.add(request)
        self.by_name[name] = request
        return request

    def add_group(self, *names: str, shares_prompt: bool, prompt: int = 8) -> CompletionSet:
        """The completions of one request (n = len(names)), one record each, as the engine makes them."""
        first = len(self.by_name) + 1
        group = CompletionSet(tuple(range(first, first + len(names))), shares_prompt=shares_prompt)
        for name in names:
            self.add(name, prompt=prompt, group=group)
        return group

    def names(self, keys: tuple[int, ...] | list[int]) -> list[str]:
        by_key = {r.key: name for name, r in self.by_name.items()}
        return [by_key[key] for key in keys]

    def admitted(self, plan: RoundPlan) -> list[str]:
        return self.names([a.key for a in plan.admitted])

    def prompted(self, plan: RoundPlan) -> list[str]:
        """The requests with prompt chunks in the plan, in the order their chunks run."""
        return self.names(list(dict.fromkeys(c.key for c in plan.prompts)))

    def chunks(self, plan: RoundPlan, name: str) -> list[tuple[int, int]]:
        """(start, length) of each of a request's chunks in the plan."""
        key = self.by_name[name].key
        return [(c.start, c.length) for c in plan.prompts if c.key == key]

    def decoded(self, plan: RoundPlan) -> list[str]:
        return self.names([row.key for row in plan.decode])

    def end(self, name: str, service_seconds: float | None = 1.0) -> None:
        """The core ends a request: it hands the record back and reports its service time."""
        request = self.by_name[name]
        self.scheduler.finish(request)
        self.scheduler.update(RoundOutcome(finished=[Finished(request.key, service_seconds)]))


def scheduler(
    *,
    slots: int = 2,
    queue: int = 8,
    chunk: int = 256,
    stall_free: bool = True,
    reserved: int = 1,
    preemption: bool = True,
    queued_tokens: int = 0,
    speculation: SpeculationSettings | None = None,
    look_up_prefix: PrefixLookup | None = None,
) -> tuple[Scheduler, Requests]:
    built = Scheduler(
        SchedulerConfig(
            slots=slots,
            max_queue_size=queue,
            prefill_chunk_size=chunk,
            stall_free=stall_free,
            max_step_seconds=None,
            batch_reserved_slots=reserved,
            preemption=preemption,
            max_queued_tokens=queued_tokens,
            context_length=256,
            speculation=speculation or SpeculationSettings(0, 1),
            prefix_block_tokens=16 if look_up_prefix is not None else 0,
        ),
        look_up_prefix=look_up_prefix,
    )
    return built, Requests(built)


def run_as_planned(s: Scheduler) -> None:
    """The outcome of a round that ran as planned: every chunk, every decode row."""
    s.update(RoundOutcome())


# -- admission ---------------------------------------------------------------------------------


def test_free_slots_go_to_waiting_requests_in_arrival_order() -> None:
    s, r = scheduler(slots=2)
    for name in ("a", "b", "c"):
        r.add(name)

    plan = s.schedule(NOW)

    assert r.admitted(plan) == ["a", "b"]
    assert {a.entry for a in plan.admitted} == {Entry.NEW}
    assert [r.by_name[n].status for n in "abc"] == [
        RequestStatus.PREFILLING,
        RequestStatus.PREFILLING,
        RequestStatus.WAITING,
    ]
    assert r.by_name["a"].started_at == NOW and r.by_name["c"].started_at is None
    assert s.queue_depth == 1


def test_with_nothing_decoding_the_prompt_budget_is_unbounded_and_paced_once_a_stream_decodes() -> None:
    s, r = scheduler(chunk=256)
    r.add("a", prompt=600)
    r.add("b", prompt=100)

    plan = s.schedule(NOW)

    assert r.prompted(plan) == ["a", "b"]
    # Nothing decodes: the whole of a's prompt, in chunks of at most 256.
    assert r.chunks(plan, "a") == [(0, 256), (256, 256), (512, 88)]
    # a decodes from then on: nothing measured yet, so the smallest paced chunk, whose time
    # teaches the cost.
    assert r.chunks(plan, "b") == [(0, MIN_PACED_CHUNK)]
    assert r.decoded(plan) == ["a"], "its first token comes this round: it decodes in the step"


def test_a_request_waiting_for_a_slot_bounds_the_prompt_work_even_with_nothing_decoding() -> None:
    # Long prompts in both slots, nothing decoding, a third request waiting: an unbounded round
    # would run a whole prompt before the waiting one could be given a slot.
    s, r = scheduler(slots=2, reserved=0)
    for name in ("long0", "long1", "waiting"):
        r.add(name, prompt=1000)

    plan = s.schedule(NOW)

    assert r.admitted(plan) == ["long0", "long1"] and plan.decode == ()
    assert [c.length for c in plan.prompts] == [MIN_PACED_CHUNK]
    run_as_planned(s)
    r.end("waiting", None)
    unbounded = s.schedule(NOW)
    chunks = r.chunks(unbounded, "long0")
    assert chunks[0][0] == MIN_PACED_CHUNK and sum(n for _, n in chunks) == 1000 - MIN_PACED_CHUNK, (
        "nothing waits any more: the whole rest of the prompt"
    )


def test_a_prompt_done_decodes_in_the_next_round_and_bounds_prompt_work() -> None:
    s, r = scheduler(slots=2)
    r.add("a")
    s.schedule(NOW)
    run_as_planned(s)
    s.update(RoundOutcome(prompt_chunks=[(100, 0.1)], decode_seconds=0.02))
    r.add("b", prompt=300)

    plan = s.schedule(NOW + 1)

    assert r.by_name["a"].status is RequestStatus.DECODING
    assert r.decoded(plan) == ["a"]
    assert r.admitted(plan) == ["b"]
    # Twice the 20 ms step, less the step itself, at 1 ms a prompt token.
    assert r.chunks(plan, "b") == [(0, 20)]


def test_without_stall_free_pacing_a_round_runs_one_chunk_while_streams_decode() -> None:
    s, r = scheduler(chunk=64, stall_free=False)
    r.add("a")
    s.schedule(NOW)
    run_as_planned(s)
    r.add("b", prompt=300)

    assert r.chunks(s.schedule(NOW), "b") == [(0, 64)]


def test_the_plan_s_progress_counts_once_the_round_is_back_and_a_skipped_request_s_does_not() -> None:
    s, r = scheduler(slots=2, chunk=6, stall_free=False)
    a = r.add("a", prompt=20)
    b = r.add("b", prompt=20)
    plan = s.schedule(NOW)
    assert r.chunks(plan, "a") == [(0, 6), (6, 6), (12, 6), (18, 2)] and a.computed_tokens == 0

    s.update(RoundOutcome(skipped={b.key}))  # a copy into b's slot failed: it starts over
    assert (a.status, a.computed_tokens) == (RequestStatus.DECODING, 21), "20 prompt positions and a token"
    assert (b.status, b.computed_tokens) == (RequestStatus.PREFILLING, 0)

    again = s.schedule(NOW + 1)
    assert r.decoded(again) == ["a"] and r.chunks(again, "b") == [(0, 6)], "a decodes: one chunk a round"
    run_as_planned(s)
    assert (a.computed_tokens, b.computed_tokens) == (22, 6)
    assert s.occupancy().kv_positions_used == 28


def test_batch_requests_leave_the_reserved_slots_to_the_others() -> None:
    s, r = scheduler(slots=2, reserved=1)
    r.add("b1", priority=Priority.BATCH)
    r.add("b2", priority=Priority.BATCH)

    plan = s.schedule(NOW)

    assert r.admitted(plan) == ["b1"]
    r.add("i", priority=Priority.INTERACTIVE)
    assert r.admitted(s.schedule(NOW)) == ["i"]


def test_a_request_waits_for_its_format_and_lets_the_next_go_first() -> None:
    s, r = scheduler(slots=1)
    compiling: Future[CompiledFormat] = Future()
    r.add("formatted", response_format=compiling)
    r.add("plain")

    assert r.by_name["formatted"].status is RequestStatus.WAITING_FOR_FORMAT
    assert r.admitted(s.schedule(NOW)) == ["plain"]
    run_as_planned(s)
    r.end("plain")
    assert not s.has_work()  # a slot is free, but nothing waiting can take it yet

    compiling.set_result(cast(CompiledFormat, object()))
    assert s.has_work()
    assert r.admitted(s.schedule(NOW)) == ["formatted"]


def test_a_format_that_failed_to_compile_ends_its_request_with_the_error() -> None:
    s, r = scheduler(slots=1)
    failed: Future[CompiledFormat] = Future()
    failed.set_exception(GenerationError(ErrorKind.INVALID_ARGUMENT, "bad schema", reason="BAD_FORMAT"))
    request = r.add("formatted", response_format=failed)

    plan = s.schedule(NOW)

    assert plan.admitted == ()
    [ending] = plan.endings
    assert ending.key == request.key and isinstance(ending.end, GenerationError)
    assert ending.end.kind is ErrorKind.INVALID_ARGUMENT


# -- fair shares -------------------------------------------------------------------------------


def test_the_quiet_caller_s_prompt_gets_the_budget_before_a_flood_s() -> None:
    s, r = scheduler(slots=4, stall_free=False)  # a whole chunk a round: every prompt gets some
    flood, quiet = Caller("flood"), Caller("quiet")
    for i in range(3):
        r.add(f"f{i}", caller=flood)
    r.add("q", caller=quiet)

    plan = s.schedule(NOW)

    assert r.admitted(plan) == ["f0", "q", "f1", "f2"]  # fair turns
    assert r.prompted(plan) == ["q", "f0", "f1", "f2"]  # fewest slots for its weight first


def test_a_full_queue_refuses_a_caller_over_its_share_but_not_one_under_it() -> None:
    s, r = scheduler(slots=1, queue=2)
    flood = Caller("flood")
    for i in range(3):
        r.add(f"f{i}", caller=flood)
    s.schedule(NOW)

    refused = s.refusal(flood, live=3)
    assert refused is not None and refused.reason == "QUEUE_FULL"
    # Two waiting and itself, one slot: three batches of one second's service each.
    assert refused.retry_after == pytest.approx(3.0)
    assert s.refusal(Caller("quiet"), live=3) is None

    r.add("q", caller=Caller("quiet"))
    over = s.refusal(flood, live=4)
    assert over is not None and over.reason == "CALLER_OVER_SHARE"


def test_prompt_tokens_over_the_queued_token_bound_are_refused_naming_tokens() -> None:
    s, r = scheduler(slots=1, queue=8, queued_tokens=100)
    flood, quiet = Caller("flood"), Caller("quiet")
    r.add("running", prompt=8, caller=flood)
    s.schedule(NOW)
    r.add("f0", prompt=60, caller=flood)

    assert s.refusal(flood, live=2, prompt_tokens=40) is None  # 100 waiting: at the bound, not over
    refused = s.refusal(flood, live=2, prompt_tokens=41)
    assert refused is not None
    assert refused.kind is ErrorKind.RESOURCE_EXHAUSTED and refused.reason == "QUEUED_TOKENS_FULL"
    assert "60 prompt tokens" in str(refused) and "--max-queued-tokens" in str(refused)
    # One waiting and itself, one slot: two batches of one second's service each.
    assert refused.retry_after == pytest.approx(2.0)
    # A caller under its share of the tokens (half of 100 with two callers) still gets in.
    assert s.refusal(quiet, live=2, prompt_tokens=90) is None

    r.add("q", prompt=90, caller=quiet)
    over = s.refusal(flood, live=3, prompt_tokens=10)
    assert over is not None and over.reason == "CALLER_OVER_TOKEN_SHARE"
    # Past twice the bound, even a caller under its share waits.
    assert s.refusal(Caller("third"), live=3, prompt_tokens=50) is None
    full = s.refusal(Caller("third"), live=3, prompt_tokens=51)
    assert full is not None and full.reason == "QUEUED_TOKENS_FULL"


def test_the_token_bound_never_refuses_a_request_with_a_free_slot_or_an_empty_queue() -> None:
    s, r = scheduler(slots=2, queue=8, queued_tokens=100)
    assert s.refusal(Caller("a"), live=0, prompt_tokens=5000) is None  # a free slot
    r.add("running", prompt=8)
    r.add("also running", prompt=8)
    s.schedule(NOW)
    # Nothing waits ahead of it: refusing a prompt longer than the bound would refuse it forever.
    assert s.refusal(Caller("a"), live=2, prompt_tokens=5000) is None
    assert scheduler(slots=1, queue=8)[0].refusal(Caller("a"), live=1, prompt_tokens=10**6) is None


def test_a_caller_sending_long_prompts_gets_fewer_turns_than_one_sending_short_ones_in_proportion() -> None:
    s, r = scheduler(slots=1, queue=64)
    long_prompts, short_prompts = Caller("long"), Caller("short")
    for i in range(10):
        r.add(f"l{i}", prompt=400, new_tokens=16, caller=long_prompts)  # 416 tokens of work
        r.add(f"s{i}", prompt=88, new_tokens=16, caller=short_prompts)  # 104: a quarter of it
    turns = []
    for _ in range(10):
        plan = s.schedule(NOW)
        run_as_planned(s)
        turns.extend(r.admitted(plan))
        for name in r.admitted(plan):
            r.end(name)

    assert sum(name.startswith("s") for name in turns) == 8
    assert sum(name.startswith("l") for name in turns) == 2


def test_prompt_work_goes_first_to_the_caller_holding_the_least_work_for_its_weight() -> None:
    s, r = scheduler(slots=3, stall_free=False)  # a whole chunk a round: every prompt gets some
    long_prompts, short_prompts = Caller("long"), Caller("short")
    r.add("long", prompt=1000, caller=long_prompts)
    r.add("short0", prompt=50, caller=short_prompts)
    r.add("short1", prompt=50, caller=short_prompts)

    plan = s.schedule(NOW)

    # Two short prompts hold less work than one long one, though they hold more slots.
    assert r.prompted(plan) == ["short0", "short1", "long"]


def test_a_caller_s_own_queue_limit_refuses_before_the_queue_is_full() -> None:
    s, r = scheduler(slots=1, queue=8)
    limited = Caller("limited", max_queued=1)
    r.add("a", caller=limited)

    refused = s.refusal(limited, live=1)
    assert refused is not None and refused.reason == "CALLER_QUEUE_FULL"


def test_service_times_set_the_retry_hint() -> None:
    s, r = scheduler(slots=1, queue=1)
    r.add("a")
    s.schedule(NOW)
    run_as_planned(s)
    r.end("a", service_seconds=6.0)

    assert len(s) == 0
    assert s.retry_after() == pytest.approx(0.8 * 1.0 + 0.2 * 6.0)


# -- preemption --------------------------------------------------------------------------------


def decoding(s: Scheduler, r: Requests, *names: str, **kwargs: object) -> None:
    for name in names:
        r.add(name, **kwargs)  # type: ignore[arg-type]
    s.schedule(NOW)
    run_as_planned(s)


def test_batch_work_gives_its_slot_to_more_urgent_work() -> None:
    s, r = scheduler(slots=1, reserved=0)
    decoding(s, r, "batch", priority=Priority.BATCH)
    r.add("urgent", priority=Priority.INTERACTIVE)

    plan = s.schedule(NOW)

    assert plan.preemption is not None
    assert r.names((plan.preemption.victim, plan.preemption.beneficiary)) == ["batch", "urgent"]
    assert plan.preemption.positions == r.by_name["batch"].computed_tokens
    assert plan.preemption.if_kept is not None and plan.preemption.if_kept.key == r.by_name["batch"].key
    assert r.admitted(plan) == ["urgent"]
    assert r.by_name["batch"].status is RequestStatus.SWAPPED_OUT
    assert r.decoded(plan) == ["urgent"], "its prompt is done this round: it decodes in the step"


def test_a_caller_over_its_share_gives_a_slot_to_a_caller_under_it() -> None:
    s, r = scheduler(slots=2, reserved=0)
    decoding(s, r, "f0", "f1", caller=Caller("flood"))
    r.add("q", caller=Caller("quiet"))

    plan = s.schedule(NOW)

    assert plan.preemption is not None
    assert r.names((plan.preemption.beneficiary,)) == ["q"]
    assert r.by_name[r.names((plan.preemption.victim,))[0]].caller.name == "flood"


def test_no_preemption_when_the_waiting_caller_already_holds_its_share() -> None:
    s, r = scheduler(slots=2, reserved=0)
    decoding(s, r, "a", caller=Caller("a"))
    decoding(s, r, "b", caller=Caller("b"))
    r.add("a2", caller=Caller("a"))

    assert s.schedule(NOW).preemption is None


def test_a_swapped_out_generation_resumes_when_its_turn_comes() -> None:
    s, r = scheduler(slots=1, reserved=0)
    decoding(s, r, "batch", priority=Priority.BATCH)
    r.add("urgent", priority=Priority.INTERACTIVE)
    s.schedule(NOW)
    run_as_planned(s)
    r.end("urgent")

    plan = s.schedule(NOW)

    assert r.admitted(plan) == ["batch"] and plan.admitted[0].entry is Entry.RESUMED
    assert r.by_name["batch"].status is RequestStatus.DECODING
    assert r.decoded(plan) == ["batch"]  # it decodes on: no prompt to run again
    assert plan.prompts == ()


def test_a_failed_swap_leaves_the_victim_decoding_and_its_beneficiary_waiting() -> None:
    s, r = scheduler(slots=1, reserved=0)
    decoding(s, r, "batch", priority=Priority.BATCH)
    r.add("urgent", priority=Priority.INTERACTIVE)
    s.schedule(NOW)

    batch = r.by_name["batch"]
    positions = batch.computed_tokens
    s.update(RoundOutcome(preemption_failed=True, skipped={r.by_name["urgent"].key}))

    assert batch.status is RequestStatus.DECODING and batch.computed_tokens == positions + 1, "it decoded on"
    assert r.by_name["urgent"].status is RequestStatus.WAITING and r.by_name["urgent"].started_at is None
    assert r.by_name["urgent"].computed_tokens == 0, "its planned prompt did not run"
    assert s.queue_depth == 1 and [x.key for x in s.running()] == [batch.key]


def a_prompt_mid_prefill_and_a_quiet_caller(s: Scheduler, r: Requests) -> RoundPlan:
    """flood's f0 decodes (its 100-token prompt in) and f1, as long, has 40 of its tokens in;
    quiet's q arrives."""
    decoding(s, r, "f0", prompt=100, caller=Caller("flood"))
    # 20 ms a step, 0.5 ms a prompt token: rounds of twice the step give f1 40 tokens of prompt.
    s.update(RoundOutcome(prompt_chunks=[(100, 0.05)], decode_seconds=0.02))
    r.add("f1", prompt=100, caller=Caller("flood"))
    assert r.chunks(s.schedule(NOW), "f1") == [(0, 40)]
    run_as_planned(s)
    r.add("q", caller=Caller("quiet"))
    return s.schedule(NOW + 1)


def test_a_prompt_mid_prefill_is_preempted_and_resumes_its_prefill_where_it_stopped() -> None:
    s, r = scheduler(slots=2, reserved=0)
    plan = a_prompt_mid_prefill_and_a_quiet_caller(s, r)
    f1 = r.by_name["f1"]

    assert plan.preemption is not None
    assert r.names((plan.preemption.victim, plan.preemption.beneficiary)) == ["f1", "q"]
    assert plan.preemption.positions == 40 and plan.preemption.if_kept is None, "mid-prompt: no token"
    assert f1.status is RequestStatus.SWAPPED_OUT and f1.queued_tokens == 60
    assert r.prompted(plan) == ["q"]

    run_as_planned(s)
    r.end("q")
    resumed = s.schedule(NOW + 2)

    assert r.admitted(resumed) == ["f1"] and resumed.admitted[0].entry is Entry.RESUMED
    assert f1.status is RequestStatus.PREFILLING and f1.started_at == NOW, "it keeps its first start"
    assert r.prompted(resumed) == ["f1"] and r.chunks(resumed, "f1")[0][0] == 40
    assert r.decoded(resumed) == ["f0"]


def test_a_failed_swap_of_a_prompt_mid_prefill_leaves_it_prefilling_and_nothing_to_decode() -> None:
    s, r = scheduler(slots=2, reserved=0)
    a_prompt_mid_prefill_and_a_quiet_caller(s, r)

    s.update(RoundOutcome(preemption_failed=True, skipped={r.by_name["q"].key}))

    f1 = r.by_name["f1"]
    assert f1.status is RequestStatus.PREFILLING and f1.computed_tokens == 40
    assert r.by_name["q"].status is RequestStatus.WAITING and r.by_name["q"].started_at is None
    plan = s.schedule(NOW + 2, admit=False)
    assert r.prompted(plan) == ["f1"] and r.decoded(plan) == ["f0"]


# -- endings -----------------------------------------------------------------------------------


def test_deadlines_end_queued_and_running_requests_where_they_are() -> None:
    s, r = scheduler(slots=1)
    decoding(s, r, "running", deadline=NOW + 5)
    r.add("queued", deadline=NOW + 3)

    assert s.schedule(NOW + 2).endings == ()
    plan = s.schedule(NOW + 5)

    messages = {r.names((e.key,))[0]: e.end for e in plan.endings}
    assert set(messages) == {"running", "queued"}
    assert all(isinstance(end, GenerationError) for end in messages.values())
    assert "during generation" in str(messages["running"]) and "in the queue" in str(messages["queued"])
    assert s.queue_depth == 0 and s.running() == []


def test_aborts_end_each_request_once_and_ignore_unknown_keys() -> None:
    s, r = scheduler(slots=1)
    decoding(s, r, "running")
    queued = r.add("queued")
    running = r.by_name["running"]
    aborts = [
        Abort(running.key, AbortReason.CANCELLED, requested_at_step=3),
        Abort(running.key, AbortReason.DISCONNECTED, requested_at_step=3),
        Abort(queued.key, AbortReason.DEADLINE, requested_at_step=3),
        Abort(999, AbortReason.CANCELLED, requested_at_step=3),
    ]

    plan = s.schedule(NOW, aborts)

    assert [(e.key, e.end) for e in plan.endings if not isinstance(e.end, GenerationError)] == [
        (running.key, FinishReason.CANCELLED)
    ]
    assert len(plan.endings) == 2 and plan.endings[0].abort == aborts[0]
    assert plan.admitted == () and plan.decode == ()
    assert len(s) == 0 and running.status is RequestStatus.FINISHED, "ending a request drops its record"


def test_a_stopping_server_admits_nothing_new() -> None:
    s, r = scheduler(slots=2)
    r.add("a")

    plan = s.schedule(NOW, admit=False)

    assert plan.admitted == () and r.by_name["a"].status is RequestStatus.WAITING


# -- per-request counts: cached prefixes, drafts, forks --------------------------------------


class PrefixLookups:
    """Stands in for the prefix cache's lookup: says how many prompt tokens each request finds."""

    def __init__(self, found: dict[str, int]) -> None:
        self.found = found
        self.asked: list[str] = []

    def __call__(self, request: Request) -> int:
        name = request.submitted.request_id
        self.asked.append(name)
        request.kv.prefix = cast(PrefixLease, object())  # looked up: the lease is the cache's
        return self.found.get(name, 0)


def with_prefix_cache(
    found: dict[str, int], **kwargs: int | bool
) -> tuple[Scheduler, Requests, PrefixLookups]:
    lookups = PrefixLookups(found)
    s, r = scheduler(look_up_prefix=lookups, **kwargs)  # type: ignore[arg-type]
    return s, r, lookups


def test_a_prompt_s_cached_prefix_is_copied_in_first_and_costs_no_prompt_budget() -> None:
    s, r, lookups = with_prefix_cache({"b": 64}, slots=2)
    r.add("a")
    s.schedule(NOW)
    run_as_planned(s)
    s.update(RoundOutcome(prompt_chunks=[(100, 0.1)], decode_seconds=0.02))  # budget: 20 tokens
    r.add("b", prompt=100)

    plan = s.schedule(NOW + 1)

    [chunk] = [c for c in plan.prompts if c.key == r.by_name["b"].key]
    assert (chunk.cached, chunk.start, chunk.length) == (64, 64, 20)
    run_as_planned(s)
    assert r.by_name["b"].computed_tokens == 84
    s.schedule(NOW + 2)
    assert lookups.asked == ["a", "b"], "each prompt is looked up once, before its first chunk"


def test_a_prompt_sharing_a_prefix_being_prefilled_in_the_same_round_waits_to_find_it_cached() -> None:
    s, r, lookups = with_prefix_cache({}, slots=3, stall_free=False)  # whole prompts each round
    system = tuple(range(1, 49))  # three blocks of 16
    first = r.add("first", prompt=60)
    second = r.add("second", prompt=60)
    other = r.add("other", prompt=60, caller=Caller("someone else"))
    for request, tail in ((first, 900), (second, 800), (other, 700)):
        # The same system prompt, then each its own question.
        request.submitted = replace(request.submitted, prompt_ids=system + tuple(range(tail, tail + 12)))

    plan = s.schedule(NOW)

    # "other" first (its caller holds less work); "second" waits for first's blocks, while
    # another tenant would never find them anyway.
    assert r.prompted(plan) == ["other", "first"]
    assert lookups.asked == ["other", "first"]
    run_as_planned(s)
    lookups.found["second"] = 48
    again = s.schedule(NOW + 1)
    [chunk] = [c for c in again.prompts if c.key == second.key]
    assert chunk.cached == 48 and lookups.asked[-1] == "second"


def test_decode_rows_carry_the_drafts_each_may_verify() -> None:
    s, r = scheduler(slots=4, reserved=0, speculation=SpeculationSettings(tokens=4, max_batch=2))
    r.add("long", new_tokens=40)
    r.add("short", new_tokens=2)

    first = s.schedule(NOW)

    # Two rows and nothing measured yet: a plain step first, to learn what one costs.
    assert [row.max_drafts for row in first.decode] == [0, 0]
    s.update(RoundOutcome(step_seconds=0.02))
    # Then each may verify what its room allows: a step gains at most drafts + 1 tokens, and
    # "short" has two left (no core wrote its output here), so one draft.
    assert [(row.key, row.max_drafts) for row in s.schedule(NOW).decode] == [
        (r.by_name["long"].key, 4),
        (r.by_name["short"].key, 1),
    ]
    run_as_planned(s)
    r.add("third", new_tokens=40)
    assert {row.max_drafts for row in s.schedule(NOW).decode} == {0}, "three rows: too many to speculate"


def test_the_completions_of_a_group_copy_its_prompt_once_it_is_kept() -> None:
    s, r = scheduler(slots=4)
    group = r.add_group("c0", "c1", "c2", shares_prompt=True, prompt=30)
    source, first, second = (r.by_name[name] for name in ("c0", "c1", "c2"))

    plan = s.schedule(NOW)

    assert r.admitted(plan) == ["c0"], "the others wait for the prompt"
    [chunk] = plan.prompts
    assert chunk.keep_for_group and chunk.end == 30
    s.update(RoundOutcome(prompts_kept={source.key: True}))
    assert group.ready and first.ready

    plan = s.schedule(NOW + 1)

    assert [(a.key, a.entry) for a in plan.admitted] == [
        (first.key, Entry.FORKED),
        (second.key, Entry.FORKED),
    ]
    assert plan.prompts == () and r.decoded(plan) == ["c0", "c1", "c2"]
    run_as_planned(s)
    assert first.status is RequestStatus.DECODING and first.computed_tokens == 31


def test_a_group_s_prompt_not_kept_leaves_its_completions_to_prefill_it_themselves() -> None:
    s, r = scheduler(slots=4)
    r.add_group("c0", "c1", shares_prompt=True, prompt=30)
    source, follower = r.by_name["c0"], r.by_name["c1"]
    s.schedule(NOW)

    s.update(RoundOutcome(prompts_kept={source.key: False}))

    plan = s.schedule(NOW + 1)
    assert [(a.key, a.entry) for a in plan.admitted] == [(follower.key, Entry.NEW)]
    assert r.chunks(plan, "c1")[0][0] == 0


# -- the record's state machine ----------------------------------------------------------------


def test_an_illegal_transition_is_refused_and_leaves_the_status_as_it_was() -> None:
    s, r = scheduler(slots=1)
    request = r.add("a")

    with pytest.raises(IllegalTransitionError, match="cannot go from waiting to decoding"):
        request.transition(RequestStatus.DECODING)
    assert request.status is RequestStatus.WAITING

    s.schedule(NOW)
    s.finish(request)
    with pytest.raises(IllegalTransitionError, match="from finished"):
        request.transition(RequestStatus.WAITING)
    assert request.status is RequestStatus.FINISHED and len(s) == 0


def test_finishing_a_completion_keeps_the_ticket_reaching_the_others() -> None:
    s, r = scheduler(slots=4)
    group = r.add_group("c0", "c1", "c2", shares_prompt=False)
    requests = [r.by_name[f"c{i}"] for i in range(3)]
    s.schedule(NOW)

    s.finish(requests[0])

    assert s.live_keys_of(requests[0].key) == [requests[1].key, requests[2].key]
    s.finish(requests[1])
    s.finish(requests[2])
    assert s.live_keys_of(requests[0].key) == [] and group.ended == {x.key for x in requests}


def test_a_row_verifies_drafts_beside_a_neighbour_only_as_often_as_its_share_of_the_steps_pays_for() -> None:
    s, r = scheduler(slots=4, reserved=0, speculation=SpeculationSettings(tokens=4, max_batch=2))
    r.add("speculating", new_tokens=200, caller=Caller("a"))
    r.add("neighbour", new_tokens=200, caller=Caller("b"))
    s.schedule(NOW)
    run_as_planned(s)
    speculating, neighbour = r.by_name["speculating"], r.by_name["neighbour"]
    neighbour.drafting.paused_for = 10**6  # it never drafts: it only shares the steps
    s.update(RoundOutcome(step_seconds=0.020))  # a plain step: 20 ms
    # A verification of 4 drafts (5 positions) that cost 25 ms more than a plain step.
    s.schedule(NOW)
    s.update(
        RoundOutcome(verified={speculating.key: Verification(drafted=4, accepted=4)}, step_seconds=0.045)
    )

    steps, verifications = 60, 0
    for _ in range(steps):
        plan = s.schedule(NOW)
        [row] = [row for row in plan.decode if row.key == speculating.key]
        verified = {speculating.key: Verification(4, 4)} if row.max_drafts else {}
        verifications += bool(verified)
        s.update(RoundOutcome(verified=verified, step_seconds=0.045 if verified else 0.020))

    # Each verification adds 25 ms to the neighbour's step; together they add at most the
    # share of the plain steps' time (and one verification's credit held at the start).
    allowance = NEIGHBOUR_SHARE * 0.020 * steps
    assert verifications * 0.025 <= allowance + 0.025
    assert verifications >= allowance // 0.025 - 1, "and it still verifies as often as that pays for"


def test_a_row_alone_in_its_step_verifies_every_step() -> None:
    s, r = scheduler(slots=4, reserved=0, speculation=SpeculationSettings(tokens=4, max_batch=2))
    r.add("alone", new_tokens=200)
    s.schedule(NOW)
    run_as_planned(s)
    alone = r.by_name["alone"]
    s.update(RoundOutcome(step_seconds=0.020))
    for _ in range(5):
        [row] = s.schedule(NOW).decode
        assert row.max_drafts == 4
        s.update(RoundOutcome(verified={alone.key: Verification(4, 4)}, step_seconds=0.045))


def test_drafts_a_verification_rejects_are_charged_to_its_caller_s_turns() -> None:
    s, r = scheduler(slots=1, reserved=0, speculation=SpeculationSettings(tokens=4, max_batch=2))
    wasteful, other = Caller("wasteful"), Caller("other")
    r.add("running", new_tokens=200, caller=wasteful)
    s.schedule(NOW)
    run_as_planned(s)
    r.add("w2", caller=wasteful)
    r.add("o2", caller=other)
    r.add("w3", caller=wasteful)
    r.add("o3", caller=other)
    running = r.by_name["running"]
    for _ in range(10):  # every draft rejected: 40 tokens of work no turn paid for
        s.schedule(NOW, admit=False)
        s.update(RoundOutcome(verified={running.key: Verification(4, 0)}, decode_seconds=0.02))
    s.finish(running)

    order = []
    for _ in range(4):
        plan = s.schedule(NOW)
        order.extend(r.admitted(plan))
        for name in r.admitted(plan):
            s.finish(r.by_name[name])
    # 40 tokens put wasteful's turn behind other's two requests of 24; without the charge the
    # turns would alternate from wasteful's w2: w2, o2, w3, o3.
    assert order == ["o2", "o3", "w2", "w3"]

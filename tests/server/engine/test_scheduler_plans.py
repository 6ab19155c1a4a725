"""The scheduler's plans, from hand-made requests and clock readings: no runner, no tokenizer, no thread.

Each test builds requests, asks `Scheduler.schedule` for a plan and, where a round's result
matters, hands back a `RoundOutcome` written by hand, as the engine core would.
"""

from __future__ import annotations

import math
from concurrent.futures import Future
from typing import cast

import pytest

from tokenwire.server.engine.errors import ErrorKind, GenerationError
from tokenwire.server.engine.pacing import MIN_PACED_CHUNK
from tokenwire.server.engine.plan import Abort, Finished, RoundOutcome, RoundPlan
from tokenwire.server.engine.request import Request, RequestStatus
from tokenwire.server.engine.scheduler import Scheduler, SchedulerConfig
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
        request = Request(len(self.by_name) + 1, spec, ignore, response_format)
        self.scheduler.add(request)
        self.by_name[name] = request
        return request

    def names(self, keys: tuple[int, ...]) -> list[str]:
        by_key = {r.key: name for name, r in self.by_name.items()}
        return [by_key[key] for key in keys]


def scheduler(
    *,
    slots: int = 2,
    queue: int = 8,
    chunk: int = 256,
    stall_free: bool = True,
    reserved: int = 1,
    preemption: bool = True,
    queued_tokens: int = 0,
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
        )
    )
    return built, Requests(built)


def prefill_all(s: Scheduler, plan: RoundPlan) -> None:
    """The outcome of a round that ran every planned prompt to its first token."""
    s.update(
        RoundOutcome(
            prompt_positions={key: plan.requests[key].prompt_remaining for key in plan.prompts.order},
            first_tokens=list(plan.prompts.order),
        )
    )


# -- admission ---------------------------------------------------------------------------------


def test_free_slots_go_to_waiting_requests_in_arrival_order() -> None:
    s, r = scheduler(slots=2)
    for name in ("a", "b", "c"):
        r.add(name)

    plan = s.schedule(NOW)

    assert r.names(plan.admitted) == ["a", "b"]
    assert [r.by_name[n].status for n in "abc"] == [
        RequestStatus.PREFILLING,
        RequestStatus.PREFILLING,
        RequestStatus.WAITING,
    ]
    assert r.by_name["a"].started_at == NOW and r.by_name["c"].started_at is None
    assert s.queue_depth == 1


def test_with_nothing_decoding_the_prompt_budget_is_unbounded_and_paced_once_a_stream_decodes() -> None:
    s, r = scheduler()
    r.add("a")
    r.add("b")

    plan = s.schedule(NOW)

    assert r.names(plan.prompts.order) == ["a", "b"]
    assert math.isinf(plan.prompts.budget)
    # Nothing measured yet: the smallest paced chunk, whose time teaches the cost.
    assert plan.prompts.paced_budget == MIN_PACED_CHUNK
    assert plan.decode == ()


def test_a_request_waiting_for_a_slot_bounds_the_prompt_work_even_with_nothing_decoding() -> None:
    # Long prompts in both slots, nothing decoding, a third request waiting: an unbounded round
    # would run a whole prompt before the waiting one could be given a slot.
    s, r = scheduler(slots=2, reserved=0)
    for name in ("long0", "long1", "waiting"):
        r.add(name, prompt=1000)

    plan = s.schedule(NOW)

    assert r.names(plan.admitted) == ["long0", "long1"] and plan.decode == ()
    assert plan.prompts.budget == MIN_PACED_CHUNK
    s.update(RoundOutcome(finished=[Finished(r.by_name["waiting"].key, None)]))
    assert math.isinf(s.schedule(NOW).prompts.budget), "nothing waits any more"


def test_a_prompt_done_decodes_in_the_next_round_and_bounds_prompt_work() -> None:
    s, r = scheduler(slots=2)
    r.add("a")
    prefill_all(s, s.schedule(NOW))
    s.update(RoundOutcome(prompt_chunks=[(100, 0.1)], decode_seconds=0.02))
    r.add("b", prompt=300)

    plan = s.schedule(NOW + 1)

    assert r.by_name["a"].status is RequestStatus.DECODING
    assert r.names(plan.decode) == ["a"]
    assert r.names(plan.admitted) == ["b"]
    # Twice the 20 ms step, less the step itself, at 1 ms a prompt token.
    assert plan.prompts.budget == 20


def test_without_stall_free_pacing_a_round_runs_one_chunk_while_streams_decode() -> None:
    s, r = scheduler(chunk=64, stall_free=False)
    r.add("a")
    prefill_all(s, s.schedule(NOW))
    r.add("b", prompt=300)

    assert s.schedule(NOW).prompts.budget == 64


def test_progress_and_first_tokens_come_back_from_the_outcome() -> None:
    s, r = scheduler(slots=1)
    a = r.add("a", prompt=10)
    s.schedule(NOW)

    s.update(RoundOutcome(prompt_positions={a.key: 6}))
    assert (a.status, a.computed_tokens, a.prompt_remaining) == (RequestStatus.PREFILLING, 6, 4)

    s.update(RoundOutcome(prompt_positions={a.key: 4}, first_tokens=[a.key]))
    s.update(RoundOutcome(decoded=[a.key]))
    assert (a.status, a.computed_tokens, a.generated_tokens) == (RequestStatus.DECODING, 11, 2)
    assert s.occupancy().kv_positions_used == 11


def test_batch_requests_leave_the_reserved_slots_to_the_others() -> None:
    s, r = scheduler(slots=2, reserved=1)
    r.add("b1", priority=Priority.BATCH)
    r.add("b2", priority=Priority.BATCH)

    plan = s.schedule(NOW)

    assert r.names(plan.admitted) == ["b1"]
    r.add("i", priority=Priority.INTERACTIVE)
    assert r.names(s.schedule(NOW).admitted) == ["i"]


def test_a_request_waits_for_its_format_and_lets_the_next_go_first() -> None:
    s, r = scheduler(slots=1)
    compiling: Future[CompiledFormat] = Future()
    r.add("formatted", response_format=compiling)
    r.add("plain")

    assert r.by_name["formatted"].status is RequestStatus.WAITING_FOR_FORMAT
    assert r.names(s.schedule(NOW).admitted) == ["plain"]
    s.update(RoundOutcome(finished=[Finished(r.by_name["plain"].key, 1.0)]))
    assert not s.has_work()  # a slot is free, but nothing waiting can take it yet

    compiling.set_result(cast(CompiledFormat, object()))
    assert s.has_work()
    assert r.names(s.schedule(NOW).admitted) == ["formatted"]


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
    s, r = scheduler(slots=4)
    flood, quiet = Caller("flood"), Caller("quiet")
    for i in range(3):
        r.add(f"f{i}", caller=flood)
    r.add("q", caller=quiet)

    plan = s.schedule(NOW)

    assert r.names(plan.admitted) == ["f0", "q", "f1", "f2"]  # fair turns
    assert r.names(plan.prompts.order) == ["q", "f0", "f1", "f2"]  # fewest slots for its weight first


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
        turns.extend(r.names(plan.admitted))
        s.update(RoundOutcome(finished=[Finished(key, service_seconds=1.0) for key in plan.admitted]))

    assert sum(name.startswith("s") for name in turns) == 8
    assert sum(name.startswith("l") for name in turns) == 2


def test_prompt_work_goes_first_to_the_caller_holding_the_least_work_for_its_weight() -> None:
    s, r = scheduler(slots=3)
    long_prompts, short_prompts = Caller("long"), Caller("short")
    r.add("long", prompt=1000, caller=long_prompts)
    r.add("short0", prompt=50, caller=short_prompts)
    r.add("short1", prompt=50, caller=short_prompts)

    plan = s.schedule(NOW)

    # Two short prompts hold less work than one long one, though they hold more slots.
    assert r.names(plan.prompts.order) == ["short0", "short1", "long"]


def test_a_caller_s_own_queue_limit_refuses_before_the_queue_is_full() -> None:
    s, r = scheduler(slots=1, queue=8)
    limited = Caller("limited", max_queued=1)
    r.add("a", caller=limited)

    refused = s.refusal(limited, live=1)
    assert refused is not None and refused.reason == "CALLER_QUEUE_FULL"


def test_service_times_set_the_retry_hint() -> None:
    s, r = scheduler(slots=1, queue=1)
    a = r.add("a")
    s.schedule(NOW)
    s.update(RoundOutcome(finished=[Finished(a.key, service_seconds=6.0)]))

    assert len(s) == 0
    assert s.retry_after() == pytest.approx(0.8 * 1.0 + 0.2 * 6.0)


# -- preemption --------------------------------------------------------------------------------


def decoding(s: Scheduler, r: Requests, *names: str, **kwargs: object) -> None:
    for name in names:
        r.add(name, **kwargs)  # type: ignore[arg-type]
    prefill_all(s, s.schedule(NOW))


def test_batch_work_gives_its_slot_to_more_urgent_work() -> None:
    s, r = scheduler(slots=1, reserved=0)
    decoding(s, r, "batch", priority=Priority.BATCH)
    r.add("urgent", priority=Priority.INTERACTIVE)

    plan = s.schedule(NOW)

    assert plan.preemption is not None
    assert r.names((plan.preemption.victim, plan.preemption.beneficiary)) == ["batch", "urgent"]
    assert plan.preemption.positions == r.by_name["batch"].computed_tokens
    assert r.names(plan.admitted) == ["urgent"]
    assert r.by_name["batch"].status is RequestStatus.SWAPPED_OUT
    assert plan.decode == ()


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
    prefill_all(s, s.schedule(NOW))
    urgent = r.by_name["urgent"]
    s.update(RoundOutcome(finished=[Finished(urgent.key, 1.0)]))

    plan = s.schedule(NOW)

    assert r.names(plan.admitted) == ["batch"]
    assert r.by_name["batch"].status is RequestStatus.DECODING
    assert r.names(plan.decode) == ["batch"]  # it decodes on: no prompt to run again
    assert plan.prompts.order == ()


def test_a_failed_swap_leaves_the_victim_decoding_and_its_beneficiary_waiting() -> None:
    s, r = scheduler(slots=1, reserved=0)
    decoding(s, r, "batch", priority=Priority.BATCH)
    r.add("urgent", priority=Priority.INTERACTIVE)
    s.schedule(NOW)

    s.update(RoundOutcome(preemption_failed=True))

    assert r.by_name["batch"].status is RequestStatus.DECODING
    assert r.by_name["urgent"].status is RequestStatus.WAITING and r.by_name["urgent"].started_at is None
    assert s.queue_depth == 1 and [x.key for x in s.running()] == [r.by_name["batch"].key]


def a_prompt_mid_prefill_and_a_quiet_caller(s: Scheduler, r: Requests) -> RoundPlan:
    """flood's f0 decodes (its 100-token prompt in) and f1, as long, has 40 of its tokens in;
    quiet's q arrives."""
    decoding(s, r, "f0", prompt=100, caller=Caller("flood"))
    r.add("f1", prompt=100, caller=Caller("flood"))
    s.schedule(NOW)
    s.update(RoundOutcome(prompt_positions={r.by_name["f1"].key: 40}))
    r.add("q", caller=Caller("quiet"))
    return s.schedule(NOW + 1)


def test_a_prompt_mid_prefill_is_preempted_and_resumes_its_prefill_where_it_stopped() -> None:
    s, r = scheduler(slots=2, reserved=0)
    plan = a_prompt_mid_prefill_and_a_quiet_caller(s, r)
    f1 = r.by_name["f1"]

    assert plan.preemption is not None
    assert r.names((plan.preemption.victim, plan.preemption.beneficiary)) == ["f1", "q"]
    assert plan.preemption.positions == 40 and plan.preemption.prefilling
    assert f1.status is RequestStatus.SWAPPED_OUT and f1.queued_tokens == 60
    assert r.names(plan.prompts.order) == ["q"]

    s.update(RoundOutcome(finished=[Finished(r.by_name["q"].key, 1.0)]))
    resumed = s.schedule(NOW + 2)

    assert r.names(resumed.admitted) == ["f1"]
    assert f1.status is RequestStatus.PREFILLING and f1.started_at == NOW, "it keeps its first start"
    assert r.names(resumed.prompts.order) == ["f1"] and f1.prompt_remaining == 60
    assert r.names(resumed.decode) == ["f0"]


def test_a_failed_swap_of_a_prompt_mid_prefill_leaves_it_prefilling_and_nothing_to_decode() -> None:
    s, r = scheduler(slots=2, reserved=0)
    a_prompt_mid_prefill_and_a_quiet_caller(s, r)

    s.update(RoundOutcome(preemption_failed=True))

    f1 = r.by_name["f1"]
    assert f1.status is RequestStatus.PREFILLING and f1.computed_tokens == 40
    assert r.by_name["q"].status is RequestStatus.WAITING and r.by_name["q"].started_at is None
    plan = s.schedule(NOW + 2, admit=False)
    assert r.names(plan.prompts.order) == ["f1"] and r.names(plan.decode) == ["f0"]


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


def test_a_stopping_server_admits_nothing_new() -> None:
    s, r = scheduler(slots=2)
    r.add("a")

    plan = s.schedule(NOW, admit=False)

    assert plan.admitted == () and r.by_name["a"].status is RequestStatus.WAITING

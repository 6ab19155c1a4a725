"""The scheduler round by round: admission, prefill budgeting, deadlines, aborts and retry hints.

These drive an engine that was never started through `Engine.run_round`, with a fake runner
(fixed logits, every call recorded; no ONNX Runtime: the promises tested are about the order of
runner calls, not about what a model computes) and a manual clock, so every assertion is exact.
The real runners and a real server are exercised by the other engine and API tests.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import pytest

from tests.support.fake_runner import FixedLogitsRunner, ManualClock, PrefillCall
from tokenwire.server.engine.engine import AdmissionCheck, Engine, EngineConfig
from tokenwire.server.engine.errors import ErrorKind, GenerationError
from tokenwire.server.engine.types import (
    AbortReason,
    Completed,
    EngineEvent,
    EventSink,
    Failed,
    FinishReason,
    GenerationRequest,
    Outcome,
    RequestTicket,
    Started,
    StopConditions,
    TokensGenerated,
)
from tokenwire.server.model_tools.tiny_tokenizer import build_byte_level_tokenizer
from tokenwire.server.sampling.params import SamplingParams
from tokenwire.server.text.tokenizer import Tokenizer

TOKENIZER = Tokenizer(build_byte_level_tokenizer(300))
TOKEN = TOKENIZER.encode("a", add_special_tokens=False)[0]


@dataclass
class Events:
    """Every event each request received, in order."""

    by_request: dict[str, list[EngineEvent]] = field(default_factory=lambda: defaultdict(list))
    order: list[tuple[str, EngineEvent]] = field(default_factory=list)

    def sink(self, request_id: str) -> EventSink:
        def receive(event: EngineEvent) -> None:
            self.by_request[request_id].append(event)
            self.order.append((request_id, event))

        return receive

    def started(self) -> list[str]:
        return [rid for rid, event in self.order if isinstance(event, Started)]

    def tokens(self, request_id: str) -> int:
        return sum(len(e.token_ids) for e in self.by_request[request_id] if isinstance(e, TokensGenerated))

    def final(self, request_id: str) -> EngineEvent | None:
        finals = [e for e in self.by_request[request_id] if isinstance(e, Completed | Failed)]
        assert len(finals) <= 1, finals
        return finals[0] if finals else None


@dataclass
class Bench:
    engine: Engine
    runner: FixedLogitsRunner
    clock: ManualClock
    events: Events

    def submit(
        self, request_id: str, *, prompt: int = 4, tokens: int = 10, deadline_in: float | None = None
    ) -> RequestTicket:
        now = self.clock()
        request = GenerationRequest(
            request_id=request_id,
            model="fake",
            prompt_ids=(TOKEN,) * prompt,
            sampling=SamplingParams(),
            stopping=StopConditions(max_new_tokens=tokens),
            received_at=now,
            deadline=None if deadline_in is None else now + deadline_in,
        )
        return self.engine.submit(request, self.events.sink(request_id))

    def rounds(self, count: int) -> None:
        for _ in range(count):
            self.engine.run_round()


def bench(
    *,
    slots: int = 4,
    queue: int = 8,
    chunk: int = 256,
    step_seconds: float = 0.0,
    token_seconds: float = 0.0,
    check_accepting: AdmissionCheck | None = None,
    stall_free: bool = True,
    max_step_seconds: float | None = None,
) -> Bench:
    clock = ManualClock()
    runner = FixedLogitsRunner(
        vocab_size=TOKENIZER.vocab_size,
        token=TOKEN,
        slots=slots,
        clock=clock,
        step_seconds=step_seconds,
        prefill_token_seconds=token_seconds,
    )
    config = EngineConfig(
        max_batch_size=slots,
        max_queue_size=queue,
        prefill_chunk_size=chunk,
        stall_free=stall_free,
        max_step_ms=0.0 if max_step_seconds is None else max_step_seconds * 1000,
    )
    engine = Engine(runner, TOKENIZER, config, clock=clock, check_accepting=check_accepting)
    return Bench(engine, runner, clock, Events())


# -- admission ---------------------------------------------------------------------------------


def test_requests_are_admitted_first_in_first_out_as_slots_free() -> None:
    b = bench(slots=2)
    tickets = [b.submit("short", tokens=3), b.submit("long", tokens=20), b.submit("c"), b.submit("d")]
    assert [t.queue_position for t in tickets] == [0, 1, 2, 3]

    b.rounds(1)
    assert b.events.started() == ["short", "long"]
    assert b.engine.queue_depth == 2

    b.rounds(1)  # "short" ends with its third token; its slot goes to the next in line only
    assert isinstance(b.events.final("short"), Completed)
    b.rounds(1)
    assert b.events.started() == ["short", "long", "c"]
    assert b.engine.queue_depth == 1
    assert [call.seq_id for call in b.runner.prefills] == [tickets[0].key, tickets[1].key, tickets[2].key]


def test_a_refusing_admission_check_queues_nothing() -> None:
    draining = GenerationError(ErrorKind.UNAVAILABLE, "draining", reason="DRAINING")

    def check() -> None:
        raise draining

    b = bench(check_accepting=check)
    with pytest.raises(GenerationError) as refused:
        b.submit("late")
    assert refused.value is draining
    assert b.engine.live_count == 0 and b.engine.queue_depth == 0


# -- prefill budgeting -------------------------------------------------------------------------


def test_with_nothing_decoding_every_waiting_prompt_is_prefilled_in_one_round() -> None:
    b = bench(chunk=4)
    first, second = b.submit("x", prompt=10), b.submit("y", prompt=6)

    b.rounds(1)

    assert b.runner.prefills == [
        PrefillCall(first.key, 0, 4),
        PrefillCall(first.key, 4, 4),
        PrefillCall(first.key, 8, 2),
        PrefillCall(second.key, 0, 4),
        PrefillCall(second.key, 4, 2),
    ]
    # Both got their first token from prefill and decoded together in the same round.
    assert b.runner.decodes == [(first.key, second.key)]


def test_without_stall_free_pacing_a_long_prompt_gets_one_chunk_per_round() -> None:
    b = bench(chunk=4, stall_free=False)
    running = b.submit("running", prompt=3, tokens=50)
    b.rounds(1)
    long = b.submit("long", prompt=10)

    for expected in (PrefillCall(long.key, 0, 4), PrefillCall(long.key, 4, 4)):
        before = len(b.runner.prefills)
        b.rounds(1)
        assert b.runner.prefills[before:] == [expected]
        assert b.runner.decodes[-1] == (running.key,)  # the running stream still stepped
        assert b.events.tokens("long") == 0

    b.rounds(1)
    assert b.runner.prefills[-1] == PrefillCall(long.key, 8, 2)
    assert b.runner.decodes[-1] == (running.key, long.key)
    assert b.events.tokens("long") == 2  # one from its prefill, one from the shared step


# -- stall-free pacing -------------------------------------------------------------------------
# A decode step takes 20 ms and a prompt token 1 ms on the manual clock (plus no fixed cost),
# so the automatic target is 2 steps, 40 ms: 20 prompt tokens and one step per round.

DECODE = 0.020
TOKEN_COST = 0.001


def paced_bench(**overrides: object) -> Bench:
    settings: dict[str, object] = {"chunk": 256, "token_seconds": TOKEN_COST}
    settings.update(overrides)
    b = bench(**settings)  # type: ignore[arg-type]
    b.runner.step_seconds = 0.0
    return b


def run_round_timed(b: Bench) -> tuple[float, list[PrefillCall], int]:
    """One round: how long it took, its prefill calls, and its decode steps."""
    began, prefills, decodes = b.clock(), len(b.runner.prefills), len(b.runner.decodes)
    b.rounds(1)
    return b.clock() - began, b.runner.prefills[prefills:], len(b.runner.decodes) - decodes


def decode_costs(b: Bench, seconds: float) -> None:
    """Make every decode step take `seconds` (prefill calls keep their per-token cost)."""

    def step() -> None:
        b.clock.advance(seconds)

    b.runner.during_decode = step


def test_while_a_stream_decodes_each_round_keeps_to_the_step_target() -> None:
    b = paced_bench()
    decode_costs(b, DECODE)
    b.submit("running", prompt=3, tokens=200)
    b.rounds(2)  # the stream decodes; the pacer has measured a step and a (3-token) prompt
    long = b.submit("long", prompt=300, tokens=5)

    rounds = []
    while b.events.tokens("long") == 0:
        rounds.append(run_round_timed(b))
    # Each round: 20 prompt tokens (40 ms target - 20 ms step) and the stream's step.
    assert [len(calls) for _, calls, _ in rounds] == [1] * len(rounds) == [1] * 15
    assert [calls[0].tokens for _, calls, _ in rounds] == [20] * 15
    assert all(seconds == pytest.approx(2 * DECODE) for seconds, _, _ in rounds)
    assert all(steps == 1 for _, _, steps in rounds)  # the running stream got a token every round
    assert {call.seq_id for _, calls, _ in rounds for call in calls} == {long.key}


def test_a_fixed_max_step_sets_the_round_s_prompt_budget() -> None:
    b = paced_bench(max_step_seconds=0.1)
    decode_costs(b, DECODE)
    b.submit("running", prompt=3, tokens=200)
    b.rounds(2)
    b.submit("long", prompt=400, tokens=5)
    b.rounds(2)  # the first chunk teaches the prompt cost

    seconds, calls, steps = run_round_timed(b)
    assert [call.tokens for call in calls] == [80]  # 100 ms target - 20 ms step = 80 tokens
    assert seconds == pytest.approx(0.1) and steps == 1


def test_with_nothing_decoding_a_long_prompt_runs_in_whole_chunks_back_to_back() -> None:
    b = paced_bench(chunk=64)
    decode_costs(b, DECODE)
    ticket = b.submit("alone", prompt=200, tokens=5)

    _, calls, steps = run_round_timed(b)

    assert [(c.start, c.tokens) for c in calls] == [(0, 64), (64, 64), (128, 64), (192, 8)]
    assert all(c.seq_id == ticket.key for c in calls)
    assert steps == 1


def test_a_free_slot_is_taken_at_once_while_a_prompt_ahead_is_paced() -> None:
    b = paced_bench()
    decode_costs(b, DECODE)
    b.submit("running", prompt=3, tokens=200)
    b.rounds(2)
    b.submit("long", prompt=300, tokens=5)
    b.rounds(2)
    b.submit("next", prompt=20, tokens=5)

    b.rounds(1)

    assert b.events.started()[-1] == "next"  # admitted into its slot in the first round
    started = b.events.by_request["next"][0]
    assert isinstance(started, Started) and started.queued_seconds == 0.0
    assert b.events.tokens("next") == 0  # its prompt waits behind the one ahead


def test_time_to_first_token_splits_into_queued_paced_and_prefill() -> None:
    b = paced_bench()
    decode_costs(b, DECODE)
    b.submit("running", prompt=3, tokens=200)
    b.rounds(2)
    b.submit("long", prompt=300, tokens=2)
    b.rounds(2)
    b.submit("next", prompt=20, tokens=2)
    while not isinstance(b.events.final("next"), Completed):
        b.rounds(1)

    for name, prompt in (("long", 300), ("next", 20)):
        final = b.events.final(name)
        assert isinstance(final, Completed)
        timing = final.result.timing
        assert timing.time_to_first_token is not None
        assert timing.prefill is not None and timing.paced is not None
        # Its prefill is its own prompt's cost; everything else between start and first token
        # was other requests' work.
        assert timing.prefill == pytest.approx(prompt * TOKEN_COST)
        assert timing.queued + timing.paced + timing.prefill == pytest.approx(timing.time_to_first_token)
        assert timing.paced > 0


# -- deadlines ---------------------------------------------------------------------------------


def test_a_deadline_that_passes_in_the_queue_fails_the_request_without_running_it() -> None:
    b = bench(slots=1)
    b.submit("running", tokens=50)
    waiting = b.submit("waiting", deadline_in=5.0)
    b.rounds(2)
    b.clock.advance(4.0)
    b.rounds(1)
    assert b.events.final("waiting") is None  # not yet: 4 of its 5 seconds passed

    b.clock.advance(2.0)
    b.rounds(1)

    failed = b.events.final("waiting")
    assert isinstance(failed, Failed)
    assert failed.error.kind is ErrorKind.DEADLINE_EXCEEDED and "in the queue" in failed.error.message
    assert failed.outcome is Outcome.DEADLINE
    assert failed.timing.queued == failed.timing.total == 6.0
    assert failed.timing.time_to_first_token is None
    assert waiting.key not in {call.seq_id for call in b.runner.prefills}
    assert b.engine.queue_depth == 0 and b.engine.live_count == 1


def test_a_deadline_that_passes_during_decode_stops_the_sequence_and_frees_its_slot() -> None:
    b = bench(step_seconds=1.0)  # every prefill and decode step takes one second
    ticket = b.submit("timed", prompt=2, tokens=50, deadline_in=3.5)

    b.rounds(1)  # prefill (1 s) and a decode step (1 s): two tokens, 2 s in
    b.rounds(1)  # third token at 3 s
    assert b.events.final("timed") is None
    b.rounds(1)  # starts at 3 s: still in time, so a fourth step runs and ends at 4 s
    b.rounds(1)  # starts at 4 s: past the deadline

    failed = b.events.final("timed")
    assert isinstance(failed, Failed)
    assert failed.error.kind is ErrorKind.DEADLINE_EXCEEDED and "during generation" in failed.error.message
    assert failed.completion_tokens == b.events.tokens("timed") == 4
    assert failed.timing.total == 4.0 and failed.timing.time_to_first_token == 1.0
    assert b.runner.released == [ticket.key]
    assert len(b.runner.decodes) == 3  # no step ran after the deadline


# -- aborts ------------------------------------------------------------------------------------


def test_an_abort_between_steps_lands_before_the_next_step() -> None:
    b = bench()
    kept, cancelled = b.submit("kept", tokens=50), b.submit("cancelled", tokens=50)
    b.rounds(2)
    steps = len(b.runner.decodes)

    b.engine.abort(cancelled.key, AbortReason.CANCELLED)
    assert b.engine.stats.abort_requests == 1  # counted when received, before any round
    b.rounds(1)

    final = b.events.final("cancelled")
    assert isinstance(final, Completed) and final.result.finish_reason is FinishReason.CANCELLED
    assert final.outcome is Outcome.CANCELLED
    assert b.runner.decodes[steps:] == [(kept.key,)]
    assert b.runner.released == [cancelled.key]
    stats = b.engine.stats
    assert (stats.aborted, stats.max_abort_latency_steps, stats.orphaned_steps) == (1, 0, 0)


def test_an_abort_that_arrives_during_a_step_lands_after_that_step_only() -> None:
    b = bench()
    victim = b.submit("victim", tokens=50)
    b.rounds(1)

    def abort_once() -> None:
        b.runner.during_decode = None
        b.engine.abort(victim.key, AbortReason.DISCONNECTED)

    b.runner.during_decode = abort_once
    b.rounds(3)

    assert sum(victim.key in step for step in b.runner.decodes) == 2  # before, and the one in flight
    assert isinstance(b.events.final("victim"), Completed)
    stats = b.engine.stats
    assert (stats.abort_requests, stats.aborted, stats.max_abort_latency_steps, stats.orphaned_steps) == (
        1,
        1,
        1,
        0,
    )


def test_an_abort_in_the_queue_ends_the_request_without_running_it() -> None:
    b = bench(slots=1)
    b.submit("running", tokens=50)
    queued = b.submit("queued")
    b.rounds(1)

    b.engine.abort(queued.key, AbortReason.CANCELLED)
    b.rounds(1)

    final = b.events.final("queued")
    assert isinstance(final, Completed) and final.result.completion_tokens == 0
    assert queued.key not in {call.seq_id for call in b.runner.prefills}
    assert b.engine.stats.aborted == 1


def test_aborts_of_finished_or_unknown_requests_are_ignored() -> None:
    b = bench()
    done = b.submit("done", tokens=1)
    b.rounds(1)
    assert isinstance(b.events.final("done"), Completed)

    b.engine.abort(done.key, AbortReason.CANCELLED)
    b.engine.abort(9999, AbortReason.CANCELLED)
    b.rounds(1)

    assert b.engine.stats.abort_requests == 0 and b.engine.stats.aborted == 0


# -- retry hints -------------------------------------------------------------------------------


def test_a_full_queue_refuses_with_a_retry_hint_from_the_queue_ahead_and_the_service_time() -> None:
    b = bench(slots=1, queue=2)
    b.submit("a", tokens=3)
    b.submit("b", tokens=2)
    b.submit("c", tokens=2)
    with pytest.raises(GenerationError) as full:
        b.submit("refused")
    # Three waiting, one slot, one second per request before anything finished: 4 batches.
    assert full.value.kind is ErrorKind.RESOURCE_EXHAUSTED and full.value.reason == "QUEUE_FULL"
    assert full.value.retry_after == pytest.approx(4.0)

    b.rounds(1)  # "a" starts (b and c wait) and runs 2 s before its last token
    b.clock.advance(2.0)
    b.rounds(1)
    assert isinstance(b.events.final("a"), Completed)
    b.submit("d", tokens=2)
    with pytest.raises(GenerationError) as still_full:
        b.submit("refused")
    # b, c and d wait for the next round: 4 batches of the average service time, which a's
    # 2 s moved to 0.8 * 1 s + 0.2 * 2 s.
    assert still_full.value.retry_after == pytest.approx(4 * 1.2)
    assert b.engine.stats.rejected == 2


def test_retry_hints_are_clamped_to_thirty_seconds() -> None:
    b = bench(slots=1, queue=40)
    for i in range(41):
        b.submit(f"r{i}")
    with pytest.raises(GenerationError) as full:
        b.submit("refused")
    assert full.value.retry_after == 30.0

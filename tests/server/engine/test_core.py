"""The engine core alone: a plan written by hand, carried out on a fake runner, exactly as written.

No scheduler and no engine thread: each test builds request records, moves them to where the
plan finds them (as the scheduler would), hands `EngineCore.execute` a plan and checks the
runner's calls, the events and the outcome. The core decides nothing, so every call it makes is
one the plan names: chunk by chunk, row by row, draft count by draft count; where a copy fails it
leaves that request's work out and says so.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from tests.support.fake_runner import FollowingRunner, ManualClock, PrefillCall, RowCopyingRunner
from tokenwire.server.engine.core import CoreHooks, EngineCore
from tokenwire.server.engine.errors import ErrorKind, GenerationError
from tokenwire.server.engine.kv_reuse import KvReuse
from tokenwire.server.engine.observer import NullObserver
from tokenwire.server.engine.plan import (
    Admission,
    DecodeRow,
    Ending,
    Entry,
    Preemption,
    PromptChunk,
    RoundOutcome,
    RoundPlan,
)
from tokenwire.server.engine.request import CompletionSet, Request, RequestStatus
from tokenwire.server.engine.speculation import SpeculationSettings
from tokenwire.server.engine.stats import EngineStats
from tokenwire.server.engine.types import (
    Completed,
    EngineEvent,
    EventSink,
    Failed,
    FinishReason,
    GenerationRequest,
    Started,
    StopConditions,
    TokensGenerated,
)
from tokenwire.server.model_tools.tiny_tokenizer import build_byte_level_tokenizer
from tokenwire.server.models.runner import ModelRunner
from tokenwire.server.sampling.params import SamplingParams
from tokenwire.server.text.tokenizer import Tokenizer

TOKENIZER = Tokenizer(build_byte_level_tokenizer(300))
A, B, C, D, E, X = (TOKENIZER.encode(ch, add_special_tokens=False)[0] for ch in "abcdeX")
NOW = 100.0


class Bench:
    def __init__(self, runner: ModelRunner, *, speculation: SpeculationSettings | None = None) -> None:
        self.runner = runner
        self.events: dict[int, list[EngineEvent]] = defaultdict(list)
        self.dropped: list[int] = []
        self.kv = KvReuse(runner, prefix_cache_bytes=2**20, prefix_block_tokens=4, swapping=True)
        self.core = EngineCore(
            runner,
            TOKENIZER,
            self.kv,
            stats=EngineStats(),
            observer=NullObserver(),
            masks=None,
            hooks=CoreHooks(
                emit=lambda sink, event: sink(event),
                flush=lambda: None,
                drop=self._drop,
                publish_step=lambda _: None,
            ),
            clock=ManualClock(NOW),
            speculation=speculation or SpeculationSettings(0, 1),
        )

    def _drop(self, request: Request) -> None:
        # What the scheduler does when the core hands a record back.
        request.transition(RequestStatus.FINISHED)
        self.dropped.append(request.key)

    def request(self, key: int, prompt: list[int], *, tokens: int = 8) -> Request:
        submitted = GenerationRequest(
            request_id=f"r{key}",
            model="fake",
            prompt_ids=tuple(prompt),
            sampling=SamplingParams(),
            stopping=StopConditions(max_new_tokens=tokens, ignore_eos=True),
            received_at=NOW,
        )
        return Request(key, submitted, self.sink(key))

    def sink(self, key: int) -> EventSink:
        return self.events[key].append

    def tokens(self, key: int) -> list[int]:
        return [t for e in self.events[key] if isinstance(e, TokensGenerated) for t in e.token_ids]

    def admit(self, *requests: Request) -> RoundPlan:
        """A plan that admits new requests and runs each whole prompt in one chunk."""
        for request in requests:
            request.transition(RequestStatus.PREFILLING)
        return RoundPlan(
            now=NOW,
            admitted=tuple(Admission(r.key, Entry.NEW) for r in requests),
            prompts=tuple(PromptChunk(r.key, 0, r.prompt_length) for r in requests),
            decode=tuple(DecodeRow(r.key) for r in requests),
            requests={r.key: r for r in requests},
        )


def decoding(request: Request, plan_outcome_prompt: int) -> None:
    """As the scheduler leaves a request whose prompt and first step ran."""
    request.computed_tokens = plan_outcome_prompt + 1
    request.transition(RequestStatus.DECODING)


def fixed_runner(**kwargs: object) -> RowCopyingRunner:
    return RowCopyingRunner(vocab_size=TOKENIZER.vocab_size, token=A, **kwargs)  # type: ignore[arg-type]


def test_the_core_runs_each_planned_chunk_and_decodes_the_rows_the_plan_names() -> None:
    runner = fixed_runner()
    bench = Bench(runner)
    first, second = bench.request(1, [B] * 10), bench.request(2, [C] * 3)
    plan = bench.admit(first, second)
    plan = RoundPlan(
        now=NOW,
        admitted=plan.admitted,
        # The first prompt in two chunks, the second's only chunk between them.
        prompts=(PromptChunk(1, 0, 6), PromptChunk(2, 0, 3), PromptChunk(1, 6, 4)),
        decode=(DecodeRow(2), DecodeRow(1)),
        requests=plan.requests,
    )

    outcome = bench.core.execute(plan)

    assert runner.prefills == [PrefillCall(1, 0, 6), PrefillCall(2, 0, 3), PrefillCall(1, 6, 4)]
    assert runner.decodes == [(2, 1)]
    assert outcome.skipped == set() and outcome.finished == []
    assert [tokens for tokens, _ in outcome.prompt_chunks] == [6, 3, 4]
    for key in (1, 2):
        assert isinstance(bench.events[key][0], Started)
        assert bench.tokens(key) == [A, A], "a first token from the prompt, then one from the step"
    # The core leaves every status to the scheduler.
    assert first.status is RequestStatus.PREFILLING and first.computed_tokens == 0


def test_a_prompt_whose_last_chunk_is_not_in_the_plan_gets_no_token_and_no_decode_row() -> None:
    runner = fixed_runner()
    bench = Bench(runner)
    request = bench.request(1, [B] * 10)
    request.transition(RequestStatus.PREFILLING)
    plan = RoundPlan(
        now=NOW,
        admitted=(Admission(1, Entry.NEW),),
        prompts=(PromptChunk(1, 0, 4),),
        requests={1: request},
    )

    bench.core.execute(plan)

    assert runner.prefills == [PrefillCall(1, 0, 4)] and runner.decodes == []
    assert bench.tokens(1) == []


def test_a_failed_swap_out_leaves_the_beneficiary_out_of_the_round_and_the_victim_decoding() -> None:
    runner = fixed_runner()
    bench = Bench(runner)
    victim, beneficiary = bench.request(1, [B] * 4), bench.request(2, [C] * 4)
    bench.core.execute(bench.admit(victim))
    decoding(victim, 4)
    victim.transition(RequestStatus.SWAPPED_OUT)  # the scheduler's plan takes its slot
    beneficiary.transition(RequestStatus.PREFILLING)

    def refuse(seq_id: int, start: int, stop: int) -> np.ndarray:
        raise RuntimeError("no memory to copy into")

    runner.read_kv = refuse  # type: ignore[method-assign]
    outcome = bench.core.execute(
        RoundPlan(
            now=NOW,
            preemption=Preemption(victim=1, positions=5, beneficiary=2, if_kept=DecodeRow(1)),
            admitted=(Admission(2, Entry.NEW),),
            prompts=(PromptChunk(2, 0, 4),),
            decode=(DecodeRow(2),),
            requests={1: victim, 2: beneficiary},
        )
    )

    assert outcome.preemption_failed and outcome.skipped == {2}
    assert [call.seq_id for call in runner.prefills] == [1], "the beneficiary's prompt did not run"
    assert runner.decodes[-1] == (1,), "the victim kept its slot and decoded on"
    assert bench.events[2] == [] and 1 not in runner.released


def test_a_prefix_that_cannot_be_copied_in_leaves_its_request_out_of_the_round() -> None:
    runner = fixed_runner()
    bench = Bench(runner)
    warm = bench.request(1, [B] * 9)
    assert bench.kv.look_up(warm) == 0  # as the scheduler does before a prompt's first chunk
    bench.core.execute(bench.admit(warm))
    bench.core.finish(warm, FinishReason.CANCELLED, NOW)
    again = bench.request(2, [B] * 9)
    assert bench.kv.look_up(again) == 4, "the first block is cached"

    def refuse(seq_id: int, blocks: object) -> int:
        raise RuntimeError("no free KV-cache slot")

    runner.start_from_kv = refuse  # type: ignore[method-assign]
    again.transition(RequestStatus.PREFILLING)
    calls = len(runner.prefills)
    outcome = bench.core.execute(
        RoundPlan(
            now=NOW,
            admitted=(Admission(2, Entry.NEW),),
            prompts=(PromptChunk(2, 4, 5, cached=4),),
            decode=(DecodeRow(2),),
            requests={2: again},
        )
    )

    assert outcome.skipped == {2} and len(runner.prefills) == calls and bench.tokens(2) == []
    assert again.kv.prefix_tokens == 0 and again.kv.caching_stopped, "it prefills from the start next"


def _ended_after_its_first_step(
    end: FinishReason | GenerationError, *, now: float = NOW
) -> tuple[RowCopyingRunner, Bench, RoundOutcome]:
    """Runs request 1's prompt and first decode step, then a plan at `now` that ends it with `end`."""
    runner = fixed_runner()
    bench = Bench(runner)
    request = bench.request(1, [B] * 4)
    bench.core.execute(bench.admit(request))
    decoding(request, 4)
    outcome = bench.core.execute(RoundPlan(now=now, endings=(Ending(1, end),), requests={1: request}))
    return runner, bench, outcome


def test_an_ending_in_the_plan_emits_the_terminal_event_and_hands_the_record_back() -> None:
    runner, bench, outcome = _ended_after_its_first_step(FinishReason.CANCELLED)

    [final] = [e for e in bench.events[1] if isinstance(e, Completed)]
    assert final.result.finish_reason is FinishReason.CANCELLED and final.result.token_ids == (A, A)
    assert bench.dropped == [1] and [f.key for f in outcome.finished] == [1]
    assert runner.released == [1] and runner.decodes == [(1,)], "nothing ran for it this round"


def test_a_request_ended_before_it_started_reports_an_empty_result_timed_from_receipt() -> None:
    runner = fixed_runner()
    bench = Bench(runner)
    request = bench.request(1, [B] * 4)

    bench.core.execute(
        RoundPlan(now=NOW + 2.5, endings=(Ending(1, FinishReason.CANCELLED),), requests={1: request})
    )

    [final] = bench.events[1]
    assert isinstance(final, Completed)
    result = final.result
    assert result.finish_reason is FinishReason.CANCELLED and result.request_id == "r1"
    assert result.text == "" and result.token_ids == () and result.prompt_tokens == 4
    assert result.timing.queued == 2.5 and result.timing.total == 2.5
    assert result.timing.time_to_first_token is None
    assert bench.dropped == [1] and runner.released == [], "it never held a slot"


def test_a_failed_ending_reports_the_tokens_the_request_had_produced() -> None:
    error = GenerationError(ErrorKind.DEADLINE_EXCEEDED, "past its deadline")

    runner, bench, _ = _ended_after_its_first_step(error, now=NOW + 1.0)

    final = bench.events[1][-1]
    assert isinstance(final, Failed) and final.error is error
    assert final.completion_tokens == len(bench.tokens(1)) == 2 and final.prompt_tokens == 4
    assert final.timing.total == 1.0 and final.timing.time_to_first_token == 0.0
    assert bench.dropped == [1] and runner.released == [1]


def test_a_row_verifies_at_most_the_drafts_the_plan_allows_and_none_without_them() -> None:
    cycle = {A: B, B: C, C: D, D: E, E: A}
    runner = FollowingRunner(vocab_size=TOKENIZER.vocab_size, token=X, follows=cycle)
    bench = Bench(runner, speculation=SpeculationSettings(tokens=4, max_batch=2))
    prompt = [A, B, C, D, E, A, B]  # the model continues c d e a ..., which the prompt repeats
    allowed, plain = bench.request(1, prompt, tokens=30), bench.request(2, prompt, tokens=30)
    bench.core.execute(bench.admit(allowed, plain))
    decoding(allowed, len(prompt))
    decoding(plain, len(prompt))

    outcome = bench.core.execute(
        RoundPlan(
            now=NOW,
            decode=(DecodeRow(1, max_drafts=2), DecodeRow(2, max_drafts=0)),
            requests={1: allowed, 2: plain},
        )
    )

    assert runner.runs[-1] == (3, 1), "two drafts after its last token; the other row one token"
    assert outcome.verified[1].drafted == 2 and outcome.verified[1].accepted == 2
    assert 2 not in outcome.verified
    assert bench.tokens(1)[-3:] == [E, A, B] and bench.tokens(2)[-1] == E


def _fork_after_keeping(runner: RowCopyingRunner) -> tuple[Bench, CompletionSet]:
    """Prefill a two-completion group's source (its prompt kept), then fork the follower while
    the source decodes."""
    bench = Bench(runner)
    group = CompletionSet((1, 2), shares_prompt=True)
    source, follower = bench.request(1, [B] * 6), bench.request(2, [B] * 6)
    source.group = follower.group = group
    source.transition(RequestStatus.PREFILLING)
    outcome = bench.core.execute(
        RoundPlan(
            now=NOW,
            admitted=(Admission(1, Entry.NEW),),
            prompts=(PromptChunk(1, 0, 6, keep_for_group=True),),
            decode=(DecodeRow(1),),
            requests={1: source},
        )
    )
    assert outcome.prompts_kept == {1: True} and group.kept is not None
    group.ready = True  # as the scheduler takes the outcome back
    decoding(source, 6)
    follower.transition(RequestStatus.PREFILLING)

    bench.core.execute(
        RoundPlan(
            now=NOW,
            admitted=(Admission(2, Entry.FORKED),),
            decode=(DecodeRow(1), DecodeRow(2)),
            requests={1: source, 2: follower},
        )
    )
    return bench, group


def test_a_forked_completion_copies_the_prompt_slot_to_slot_and_samples_from_the_kept_logits() -> None:
    runner = fixed_runner()
    bench, group = _fork_after_keeping(runner)

    assert runner.copies == [(2, 1, 6)], "slot to slot, from the source that still holds the rows"
    assert runner.loads == [] and [c.seq_id for c in runner.prefills] == [1]
    assert runner.decodes[-1] == (1, 2)
    assert bench.tokens(2) == [A, A] and group.kept is None, "its only follower copied it"


def test_a_fork_whose_slot_copy_fails_copies_the_prompt_kept_in_host_memory() -> None:
    runner = fixed_runner()

    def refuse(seq_id: int, source_id: int, positions: int) -> int:
        raise RuntimeError("the copy graph failed")

    runner.start_from_sequence = refuse  # type: ignore[method-assign]
    bench, group = _fork_after_keeping(runner)

    assert runner.loads == [(2, 6)] and [c.seq_id for c in runner.prefills] == [1]
    assert runner.decodes[-1] == (1, 2)
    assert bench.tokens(2) == [A, A] and group.kept is None

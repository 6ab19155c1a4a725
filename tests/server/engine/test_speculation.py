"""Speculative decoding in the engine, on a model that is fake but decodes and rolls back runs of
tokens (FollowingRunner: after token t it predicts a fixed next token), driven round by round
with a manual clock.

The claims are about the order of the engine's calls and what each token does: drafts come from
the prompt, are verified position by position with the request's own sampling, the positions not
kept are rolled back out of the KV cache, every ending lands where it would without speculation,
and the adaptive rules switch drafting off. Each output is compared with the same request on the
same runner with speculation off.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable
from typing import cast

import pytest

from tests.support.fake_runner import FollowingRunner, ManualClock
from tokenwire.server.engine.engine import Engine, EngineConfig
from tokenwire.server.engine.speculation import (
    ADAPTIVE_WINDOW,
    NEIGHBOUR_SHARE,
    PAUSE_STEPS,
    DraftHistory,
    record_verification,
)
from tokenwire.server.engine.types import (
    Completed,
    EngineEvent,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    StopConditions,
    TokensGenerated,
)
from tokenwire.server.model_tools.tiny_tokenizer import build_byte_level_tokenizer
from tokenwire.server.sampling.params import SamplingParams
from tokenwire.server.text.tokenizer import Tokenizer

TOKENIZER = Tokenizer(build_byte_level_tokenizer(300))
A, B, C, D, E, X = (TOKENIZER.encode(ch, add_special_tokens=False)[0] for ch in "abcdeX")
CYCLE = {A: B, B: C, C: D, D: E, E: A}
"""The fake model's text: a b c d e a b c ..."""


class Bench:
    def __init__(
        self,
        *,
        speculative_tokens: int = 4,
        max_batch: int = 2,
        follows: dict[int, int] | None = None,
        eos: frozenset[int] = frozenset(),
        run_call_seconds: float = 0.0,
        run_position_seconds: float = 0.0,
    ) -> None:
        self.clock = ManualClock()
        self.runner = FollowingRunner(
            vocab_size=TOKENIZER.vocab_size,
            token=X,
            follows=dict(CYCLE if follows is None else follows),
            eos_token_ids=eos,
            clock=self.clock,
            step_seconds=0.01,
            run_call_seconds=run_call_seconds,
            run_position_seconds=run_position_seconds,
        )
        config = EngineConfig(
            max_batch_size=4,
            prefix_cache_mb=0,
            speculative_tokens=speculative_tokens,
            speculative_max_batch=max_batch,
        )
        self.engine = Engine(self.runner, TOKENIZER, config, clock=self.clock)
        self.events: dict[str, list[EngineEvent]] = defaultdict(list)
        self.prompts: dict[str, list[int]] = {}
        self.keys: dict[str, int] = {}

    def submit(
        self,
        request_id: str,
        prompt: list[int],
        *,
        tokens: int = 12,
        sampling: SamplingParams | None = None,
        stop: tuple[str, ...] = (),
        ignore_eos: bool = True,
        logprobs: bool = False,
    ) -> None:
        self.prompts[request_id] = prompt
        request = GenerationRequest(
            request_id=request_id,
            model="fake",
            prompt_ids=tuple(prompt),
            sampling=sampling or SamplingParams(),
            stopping=StopConditions(max_new_tokens=tokens, stop_strings=stop, ignore_eos=ignore_eos),
            received_at=self.clock(),
            logprobs=logprobs,
            top_logprobs=2 if logprobs else 0,
        )
        self.keys[request_id] = self.engine.submit(request, self.events[request_id].append).key

    def done(self, request_id: str) -> bool:
        return any(isinstance(e, Completed) for e in self.events[request_id])

    def run(self, *, after_round: Callable[[], None] | None = None) -> None:
        for _ in range(200):
            if all(self.done(r) for r in self.events):
                return
            self.engine.run_round()
            if after_round is not None:
                after_round()
        raise AssertionError("requests did not finish")

    def result(self, request_id: str) -> GenerationResult:
        final = self.events[request_id][-1]
        assert isinstance(final, Completed)
        return final.result

    def streamed(self, request_id: str) -> list[int]:
        return [t for e in self.events[request_id] if isinstance(e, TokensGenerated) for t in e.token_ids]

    def check_kv_holds_only_kept_tokens(self) -> None:
        """Every decoding sequence's cache holds its prompt and the tokens streamed but the last
        (which the next step appends): nothing rolled back is left."""
        for request_id, key in self.keys.items():
            if not self.done(request_id) and key in self.runner.kv and self.streamed(request_id):
                assert self.runner.kv[key] == [*self.prompts[request_id], *self.streamed(request_id)[:-1]]


def both(prompt: list[int], **kwargs: object) -> tuple[Bench, Bench]:
    """The same request on speculation off and on, run to completion."""
    benches = (Bench(speculative_tokens=0), Bench())
    for bench in benches:
        bench.submit("r", prompt, **kwargs)  # type: ignore[arg-type]
        bench.run(after_round=bench.check_kv_holds_only_kept_tokens)
    return benches


def test_drafts_copied_from_the_prompt_are_accepted_and_give_the_tokens_of_one_token_decoding() -> None:
    off, on = both([A, B, C, D, E, A, B], tokens=12)
    assert on.result("r").token_ids == off.result("r").token_ids
    assert on.result("r").text == off.result("r").text
    assert on.streamed("r") == list(on.result("r").token_ids)
    stats = on.engine.stats
    assert stats.accepted_draft_tokens > 0
    assert stats.accepted_draft_tokens == stats.draft_tokens, "every draft matches the model"
    # 12 tokens: the prefill's, then steps of up to five; without speculation eleven steps.
    assert stats.decode_steps < off.engine.stats.decode_steps
    assert on.result("r").accepted_draft_tokens == stats.accepted_draft_tokens
    assert on.result("r").draft_tokens == stats.draft_tokens


def test_rejected_drafts_are_rolled_back_and_the_model_s_token_is_kept() -> None:
    # The prompt says "b X X X" after b; the model says "b c d e".
    off, on = both([A, B, X, X, X, X, E, A], tokens=6)
    assert on.result("r").token_ids == off.result("r").token_ids
    assert on.runner.rollbacks, "drafts were rejected"
    assert on.engine.stats.accepted_draft_tokens < on.engine.stats.draft_tokens


def test_max_new_tokens_landing_inside_an_accepted_run_ends_the_request_there() -> None:
    for tokens in (2, 3, 4, 7):
        off, on = both([A, B, C, D, E, A], tokens=tokens)
        assert on.result("r").token_ids == off.result("r").token_ids
        assert len(on.result("r").token_ids) == tokens
        assert on.result("r").finish_reason is FinishReason.LENGTH
        # A step never drafts more than the tokens left, less the one the model always adds.
        assert all(length <= tokens for run in on.runner.runs for length in run)


def test_a_stop_string_inside_an_accepted_run_ends_the_request_with_the_text_before_it() -> None:
    off, on = both([A, B, C, D, E, A], tokens=20, stop=("de",))
    assert on.result("r").finish_reason is FinishReason.STOP
    assert on.result("r").text == off.result("r").text == "bc"
    assert on.result("r").token_ids == off.result("r").token_ids


def test_eos_inside_an_accepted_run_ends_the_request_at_it() -> None:
    follows = {**CYCLE}
    benches = (
        Bench(speculative_tokens=0, follows=follows, eos=frozenset({D})),
        Bench(follows=follows, eos=frozenset({D})),
    )
    for bench in benches:
        bench.submit("r", [A, B, C, D, E, A], tokens=20, ignore_eos=False)
        bench.run()
    off, on = benches
    assert on.result("r").finish_reason is FinishReason.EOS
    assert on.result("r").token_ids == off.result("r").token_ids == (B, C, D)


def test_penalties_see_each_accepted_token_before_the_next_position_is_judged() -> None:
    # A frequency penalty of 2 turns the model's pick (logit 1) to another token once that pick
    # has been generated before; the verification must record every kept draft first.
    sampling = SamplingParams(frequency_penalty=2.0, logit_bias=((X, 0.5),))
    off, on = both([A, B, C, D, E, A, B, C, D, E, A], tokens=14, sampling=sampling)
    assert on.result("r").token_ids == off.result("r").token_ids
    assert on.engine.stats.draft_tokens > 0


def test_log_probabilities_come_from_each_verified_position_as_without_speculation() -> None:
    off, on = both([A, B, C, D, E, A], tokens=9, logprobs=True)
    assert on.engine.stats.accepted_draft_tokens > 0
    assert on.result("r").logprobs == off.result("r").logprobs
    assert len(on.result("r").logprobs) == 9


def test_seeded_sampling_gives_the_same_tokens_with_speculation_on_and_off() -> None:
    sampling = SamplingParams(temperature=0.1, seed=5)  # the model's token about 99% of the time
    off, on = both([A, B, C, D, E, A, B], tokens=16, sampling=sampling)
    assert on.result("r").token_ids == off.result("r").token_ids
    assert on.engine.stats.draft_tokens > 0


def test_a_request_whose_drafts_keep_failing_stops_drafting_then_tries_again() -> None:
    # The model counts up (t, t + 1, ...), so its output never repeats itself; the prompt has
    # every pair "t t+1" followed by X, so every draft starts with X, which the model never says.
    chain = list(range(150, 215))
    assert X not in chain
    prompt = [token for t in chain[:-1] for token in (t, t + 1, X)] + [chain[0]]
    bench = Bench(speculative_tokens=2, follows={t: t + 1 for t in chain})
    bench.submit("r", prompt, tokens=60)
    verified: list[bool] = []
    while not bench.done("r"):
        runs_before = len(bench.runner.runs)
        bench.engine.run_round()
        verified.append(len(bench.runner.runs) > runs_before)
    assert bench.engine.stats.accepted_draft_tokens == 0
    first = verified.index(True)
    window_end = first + ADAPTIVE_WINDOW
    assert verified[first:window_end] == [True] * ADAPTIVE_WINDOW
    # A pause, one verification that fails alone, then a pause twice as long.
    assert verified[window_end : window_end + PAUSE_STEPS] == [False] * PAUSE_STEPS
    assert verified[window_end + PAUSE_STEPS]
    second = window_end + PAUSE_STEPS + 1
    assert verified[second : second + 2 * PAUSE_STEPS] == [False] * (2 * PAUSE_STEPS)
    assert verified[second + 2 * PAUSE_STEPS]


def test_a_verification_that_passes_after_a_pause_ends_the_streak() -> None:
    history = DraftHistory()
    for _ in range(ADAPTIVE_WINDOW):
        record_verification(history, drafted=4, accepted=0)
    assert history.paused_for == PAUSE_STEPS
    history.paused_for = 0
    record_verification(history, drafted=4, accepted=0)
    assert history.paused_for == 2 * PAUSE_STEPS
    history.paused_for = 0
    record_verification(history, drafted=4, accepted=3)
    assert history.failures == 0 and history.paused_for == 0
    record_verification(history, drafted=4, accepted=0)
    assert history.paused_for == 0, "judged over a window again"


def test_a_decode_step_with_more_rows_than_the_speculative_batch_does_not_speculate() -> None:
    bench = Bench(max_batch=2)
    prompt = [A, B, C, D, E, A]
    bench.submit("short", prompt, tokens=3)
    bench.submit("long1", prompt, tokens=40)
    bench.submit("long2", prompt, tokens=40)
    bench.engine.run_round()  # all three prefilled and decoding
    while not bench.done("short"):
        before = len(bench.runner.runs)
        bench.engine.run_round()
        assert len(bench.runner.runs) == before, "three rows: plain decode steps"
    bench.run(after_round=bench.check_kv_holds_only_kept_tokens)
    assert bench.runner.runs, "two rows left: they speculate"
    assert bench.engine.stats.accepted_draft_tokens > 0
    off = Bench(speculative_tokens=0)
    for request_id in ("short", "long1", "long2"):
        off.submit(request_id, prompt, tokens=len(bench.result(request_id).token_ids))
    off.run()
    for request_id in ("short", "long1", "long2"):
        assert bench.result(request_id).token_ids == off.result(request_id).token_ids


def test_a_runner_that_cannot_decode_runs_never_gets_any_and_the_log_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    bench = Bench()
    bench.runner.can_decode_runs = False
    with caplog.at_level(logging.INFO, logger="tokenwire.server.engine.engine"):
        bench.engine = Engine(
            bench.runner, TOKENIZER, EngineConfig(max_batch_size=4, speculative_tokens=4), clock=bench.clock
        )
    assert "speculative decoding: off for fake: its graph cannot append several tokens" in caplog.text
    bench.submit("r", [A, B, C, D, E, A], tokens=8)
    bench.run()
    assert bench.runner.runs == []
    assert len(bench.result("r").token_ids) == 8


def test_drafts_never_run_past_the_context_length() -> None:
    bench = Bench()
    bench.runner.context_length = 12
    bench.engine = Engine(
        bench.runner, TOKENIZER, EngineConfig(max_batch_size=4, speculative_tokens=4), clock=bench.clock
    )
    bench.submit("r", [A, B, C, D, E, A, B, C], tokens=50)
    bench.run()
    result = bench.result("r")
    assert result.finish_reason is FinishReason.LENGTH
    assert 8 + len(result.token_ids) == 12
    assert bench.engine.stats.accepted_draft_tokens > 0


@pytest.mark.parametrize("value", [-1, 17])
def test_speculative_tokens_out_of_range_is_refused_at_start_naming_the_flag(value: int) -> None:
    from tokenwire.server import settings_sources
    from tokenwire.server.cli import build_parser
    from tokenwire.server.settings_sources import SettingsError

    args = build_parser().parse_args(["serve", "--speculative-tokens", str(value)])
    with pytest.raises(SettingsError) as raised:
        settings_sources.load(args, {})
    assert any(
        p.startswith("--speculative-tokens: must be between 0 (off) and 16") for p in raised.value.problems
    ), raised.value.problems


def test_a_request_with_a_response_format_does_not_draft() -> None:
    from concurrent.futures import Future

    from tokenwire.server.engine.request import Request
    from tokenwire.server.engine.speculation import SpeculationSettings, draft_limits
    from tokenwire.server.sampling.constraint import CompiledFormat

    def decoding(response_format: Future[CompiledFormat] | None) -> Request:
        request = GenerationRequest(
            request_id="r",
            model="fake",
            prompt_ids=(A, B, C, D, E, A),
            sampling=SamplingParams(),
            stopping=StopConditions(max_new_tokens=20),
            received_at=0.0,
        )
        return Request(1, request, lambda _: None, response_format)

    compiled: Future[CompiledFormat] = Future()
    compiled.set_result(cast(CompiledFormat, object()))  # the rule only asks whether there is one
    rows = [decoding(None), decoding(compiled)]
    settings = SpeculationSettings(tokens=4, max_batch=2)

    assert draft_limits(settings, rows, [True, True], context_length=256) == (4, 0)


def test_a_cancel_lands_at_the_next_step_boundary_with_every_token_of_the_steps_before() -> None:
    from tokenwire.server.engine.types import AbortReason

    bench = Bench()
    bench.submit("r", [A, B, C, D, E, A, B], tokens=40)
    for _ in range(3):  # the prefill, then two steps of accepted drafts
        bench.engine.run_round()
    before = bench.streamed("r")
    assert len(before) > 3, "the steps gained several tokens each"
    bench.engine.abort(bench.keys["r"], AbortReason.CANCELLED)
    bench.engine.run_round()
    result = bench.result("r")
    assert result.finish_reason is FinishReason.CANCELLED
    assert list(result.token_ids) == before == bench.streamed("r")
    assert bench.engine.stats.max_abort_latency_steps <= 1
    assert bench.keys["r"] not in bench.runner.kv, "its KV cache is freed at once"


def test_a_stream_sharing_steps_with_a_speculating_one_is_slowed_by_at_most_its_share() -> None:
    # A verification is a model call of its own: 10 ms, and 1 ms a position, on top of a 10 ms
    # step. Unbounded, the attacker's drafts (its prompt repeats what the model says) would make
    # every step 2.5 times as long for its neighbour (1.6x measured with the budget never
    # applied).
    def neighbour_time_per_token(speculative_tokens: int) -> tuple[float, Bench]:
        bench = Bench(
            speculative_tokens=speculative_tokens, run_call_seconds=0.01, run_position_seconds=0.001
        )
        bench.submit("attacker", [A, B, C, D, E, A, B, C, D, E, A], tokens=120)
        # The neighbour samples (seeded) from the fake model's nearly flat distribution, so its
        # own drafts almost never match and it keeps to plain steps.
        bench.submit("neighbour", [X, X], tokens=60, sampling=SamplingParams(temperature=1.0, seed=7))
        bench.run()
        per_token = bench.result("neighbour").timing.time_per_output_token
        assert per_token is not None
        return per_token, bench

    plain, off = neighbour_time_per_token(0)
    shared, on = neighbour_time_per_token(4)

    assert on.result("neighbour").token_ids == off.result("neighbour").token_ids
    assert on.engine.stats.accepted_draft_tokens > 0, "the attacker still speculates, within its share"
    # The share of a plain step, and a step's rounding at the start and the end of the run.
    assert shared / plain <= 1 + NEIGHBOUR_SHARE + 0.05, (shared, plain)

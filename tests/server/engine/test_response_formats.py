"""Response formats in the engine: compiled off the engine thread, cached, bounded in time, and
never in the way of other requests.

The compiler is the real one (llguidance over the tiny byte-level tokenizer). Where a test needs
a compilation that has not finished yet, a gate holds the real compiler until the test lets it
go, so "still compiling" is a state the test controls rather than a race. The scheduler tests
drive an engine that was never started, with the fake runner and manual clock of
tests/support/fake_runner.py, because what they check is the order of admission.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future

import pytest

from tests.support.fake_runner import FixedLogitsRunner, ManualClock
from tokenwire.server.engine.engine import Engine, EngineConfig
from tokenwire.server.engine.errors import ErrorKind, GenerationError
from tokenwire.server.engine.format_cache import FormatCache, FormatLimits
from tokenwire.server.engine.types import (
    Completed,
    EngineEvent,
    EventSink,
    Failed,
    FinishReason,
    GenerationRequest,
    Started,
    StopConditions,
)
from tokenwire.server.model_tools.tiny_tokenizer import build_byte_level_tokenizer
from tokenwire.server.sampling.constraint import CompiledFormat, FormatCompiler
from tokenwire.server.sampling.params import FormatKind, ResponseFormat, SamplingParams
from tokenwire.server.text.tokenizer import Tokenizer

TOKENIZER = Tokenizer(build_byte_level_tokenizer(300))
EOS = TOKENIZER.token_to_id("<|endoftext|>")
assert EOS is not None
TOKEN = TOKENIZER.encode("a", add_special_tokens=False)[0]
YES = ResponseFormat(FormatKind.CHOICE, choices=("yes",))


class GatedCompiler(FormatCompiler):
    """The real compiler, held before each compilation until `release()`."""

    def __init__(self) -> None:
        super().__init__(TOKENIZER.to_json(), vocab_size=TOKENIZER.vocab_size, eos_token_ids={EOS})
        self.gate = threading.Event()
        self.entered = threading.Event()

    def compile(self, response_format: ResponseFormat) -> CompiledFormat:
        self.entered.set()
        self.gate.wait()
        return super().compile(response_format)


def compiler() -> FormatCompiler:
    return FormatCompiler(TOKENIZER.to_json(), vocab_size=TOKENIZER.vocab_size, eos_token_ids={EOS})


def settled(future: Future[CompiledFormat]) -> CompiledFormat | BaseException:
    try:
        return future.result(timeout=60)
    except GenerationError as error:
        return error


def test_identical_formats_share_one_compilation_and_stay_cached() -> None:
    cache = FormatCache(compiler())
    first = settled(cache.prepare(YES))
    again = settled(cache.prepare(ResponseFormat(FormatKind.CHOICE, choices=("yes",))))
    other = settled(cache.prepare(ResponseFormat(FormatKind.REGEX, "[0-9]+")))
    assert isinstance(first, CompiledFormat) and isinstance(other, CompiledFormat)
    assert again is first
    assert cache.compilations == 2
    cache.close()


def test_an_invalid_format_fails_with_the_library_reason_and_the_failure_is_cached() -> None:
    cache = FormatCache(compiler())
    bad = ResponseFormat(FormatKind.JSON_SCHEMA, '{"type": "nonsense"}')
    for _ in range(2):
        error = settled(cache.prepare(bad))
        assert isinstance(error, GenerationError) and error.kind is ErrorKind.INVALID_ARGUMENT
        assert [v.field for v in error.violations] == ["response_format.json_schema"]
        assert "nonsense" in error.violations[0].description
    assert cache.compilations == 1
    cache.close()


def test_a_format_that_compiles_past_the_time_bound_is_refused_and_later_served_from_cache() -> None:
    gated = GatedCompiler()
    cache = FormatCache(gated, FormatLimits(timeout=0.05))
    error = settled(cache.prepare(YES))
    assert isinstance(error, GenerationError) and error.kind is ErrorKind.INVALID_ARGUMENT
    assert [v.field for v in error.violations] == ["response_format.choice"]
    assert "took longer than 0.05s" in error.violations[0].description
    gated.gate.set()  # the compilation finishes in the background; its result serves the next request
    assert isinstance(settled(cache.prepare(YES)), CompiledFormat)
    assert cache.compilations == 1
    cache.close()


def test_too_many_formats_waiting_to_compile_is_resource_exhausted_with_a_retry_hint() -> None:
    gated = GatedCompiler()
    cache = FormatCache(gated, FormatLimits(max_pending=1, timeout=30))
    cache.prepare(YES)
    with pytest.raises(GenerationError) as refused:
        cache.prepare(ResponseFormat(FormatKind.REGEX, "x"))
    assert refused.value.kind is ErrorKind.RESOURCE_EXHAUSTED and refused.value.retry_after == 30
    gated.gate.set()
    cache.close()


class Recorder:
    def __init__(self) -> None:
        self.events: dict[str, list[EngineEvent]] = {}

    def sink(self, request_id: str) -> EventSink:
        return lambda event: self.events.setdefault(request_id, []).append(event)

    def final(self, request_id: str) -> EngineEvent | None:
        return next((e for e in self.events.get(request_id, []) if isinstance(e, Completed | Failed)), None)


def request(request_id: str, response_format: ResponseFormat | None, clock: ManualClock) -> GenerationRequest:
    return GenerationRequest(
        request_id=request_id,
        model="fake",
        prompt_ids=(TOKEN,) * 3,
        sampling=SamplingParams(),
        stopping=StopConditions(max_new_tokens=8),
        received_at=clock(),
        response_format=response_format,
    )


def engine_with(cache: FormatCache) -> tuple[Engine, FixedLogitsRunner, ManualClock]:
    clock = ManualClock()
    runner = FixedLogitsRunner(
        vocab_size=TOKENIZER.vocab_size, token=TOKEN, slots=2, clock=clock, eos_token_ids=frozenset({EOS})
    )
    engine = Engine(runner, TOKENIZER, EngineConfig(max_batch_size=2), clock=clock, formats=cache)
    return engine, runner, clock


def rounds_until(engine: Engine, condition: Callable[[], bool], timeout: float = 30.0) -> None:
    """Run rounds until `condition` holds, waiting between them for the compile worker (its own
    thread) to finish; fail if it does not within `timeout` seconds."""
    pause = threading.Event()
    for _ in range(int(timeout / 0.002)):
        engine.run_round()
        if condition():
            return
        pause.wait(0.002)
    raise AssertionError(f"condition not reached within {timeout}s")


def test_a_request_whose_format_is_compiling_lets_the_requests_behind_it_run() -> None:
    gated = GatedCompiler()
    engine, _, clock = engine_with(FormatCache(gated, FormatLimits(timeout=60)))
    seen = Recorder()
    engine.submit(request("shaped", YES, clock), seen.sink("shaped"))
    engine.submit(request("plain", None, clock), seen.sink("plain"))
    gated.entered.wait(timeout=60)
    for _ in range(10):
        engine.run_round()
    plain = seen.final("plain")
    assert isinstance(plain, Completed) and plain.result.finish_reason is FinishReason.LENGTH
    assert "shaped" not in seen.events  # still queued, not started
    assert engine.queue_depth == 1

    gated.gate.set()
    rounds_until(engine, lambda: seen.final("shaped") is not None)
    shaped = seen.final("shaped")
    # The fake runner always prefers "a"; the mask makes it say "yes" and then end.
    assert isinstance(shaped, Completed), shaped
    assert shaped.result.text == "yes" and shaped.result.finish_reason is FinishReason.EOS
    assert isinstance(seen.events["shaped"][0], Started)


def test_an_invalid_format_fails_the_request_before_it_takes_a_slot() -> None:
    engine, runner, clock = engine_with(FormatCache(compiler()))
    seen = Recorder()
    engine.submit(request("bad", ResponseFormat(FormatKind.REGEX, "a("), clock), seen.sink("bad"))
    rounds_until(engine, lambda: seen.final("bad") is not None)
    failed = seen.final("bad")
    assert isinstance(failed, Failed) and failed.error.kind is ErrorKind.INVALID_ARGUMENT
    assert [v.field for v in failed.error.violations] == ["response_format.regex"]
    assert runner.prefills == []


def test_a_format_request_on_an_engine_without_formats_is_refused_at_submit() -> None:
    clock = ManualClock()
    runner = FixedLogitsRunner(vocab_size=TOKENIZER.vocab_size, token=TOKEN)
    engine = Engine(runner, TOKENIZER, EngineConfig(), clock=clock)
    with pytest.raises(GenerationError) as refused:
        engine.submit(request("shaped", YES, clock), Recorder().sink("shaped"))
    assert [v.field for v in refused.value.violations] == ["response_format.choice"]

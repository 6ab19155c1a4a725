"""How long and how much the generation registry keeps: a manual clock and hand-fed engine events.

No server here: what is checked is the registry's bookkeeping (expiry by time, eviction by
memory, what is never kept), which the real-server tests in test_request_ids.py cannot reach
without waiting minutes or filling megabytes.
"""

from __future__ import annotations

import asyncio
import tracemalloc

import pytest

from tests.support.fake_runner import ManualClock
from tokenwire.server.api.request_ids import GenerationRegistry, result_bytes
from tokenwire.server.engine.errors import ErrorKind, GenerationError
from tokenwire.server.engine.types import (
    Completed,
    EngineEvent,
    Failed,
    FinishReason,
    GenerationResult,
    Started,
    TimingReport,
    TokenLogprobs,
    TokensGenerated,
)

TIMING = TimingReport(queued=0.01, total=0.5)


def run(
    registry: GenerationRegistry,
    key: str,
    finish: FinishReason,
    tokens: int = 3,
    *,
    caller: str = "caller",
    logprobs: tuple[TokenLogprobs, ...] = (),
) -> list[EngineEvent]:
    heard: list[EngineEvent] = []
    generation, _ = registry.begin(caller, key, b"body", heard.append)
    deliver = registry.deliver_to(generation)
    deliver(Started(0.01, 4))
    deliver(TokensGenerated(tuple(range(tokens)), "x" * tokens))
    result = GenerationResult(
        f"req-{key}", "m", "x" * tokens, tuple(range(tokens)), finish, 4, TIMING, logprobs
    )
    deliver(Completed(result))
    return heard


def test_a_result_is_kept_for_the_retention_and_then_forgotten() -> None:
    clock = ManualClock()
    registry = GenerationRegistry(retention=60.0, max_bytes=1 << 20, clock=clock)
    heard = run(registry, "a", FinishReason.EOS)
    assert [type(e).__name__ for e in heard] == ["Started", "TokensGenerated", "Completed"]
    clock.advance(59.0)
    assert registry.find("caller", "a", b"body") is not None
    assert registry.find("someone-else", "a", b"body") is None
    clock.advance(2.0)
    assert registry.find("caller", "a", b"body") is None
    assert registry.kept_count == 0


def test_the_oldest_results_go_first_when_memory_runs_out() -> None:
    clock = ManualClock()
    size = result_bytes(
        GenerationResult("req-a", "m", "x" * 20, tuple(range(20)), FinishReason.LENGTH, 4, TIMING)
    )
    registry = GenerationRegistry(retention=600.0, max_bytes=3 * size + size // 2, clock=clock)
    for name in ("a", "b", "c", "d"):
        run(registry, name, FinishReason.LENGTH, tokens=20)  # three fit
        clock.advance(1.0)
    assert registry.find("caller", "a", b"body") is None
    assert all(registry.find("caller", name, b"body") is not None for name in ("b", "c", "d"))


@pytest.mark.parametrize("ending", ["cancelled", "failed"])
def test_a_cancelled_or_failed_generation_is_not_kept(ending: str) -> None:
    registry = GenerationRegistry(retention=600.0, max_bytes=1 << 20, clock=ManualClock())
    if ending == "cancelled":
        run(registry, "a", FinishReason.CANCELLED)
    else:
        generation, _ = registry.begin("caller", "a", b"body", lambda event: None)
        registry.deliver_to(generation)(
            Failed(GenerationError(ErrorKind.INTERNAL, "model failure"), TIMING, prompt_tokens=4)
        )
    assert registry.find("caller", "a", b"body") is None
    assert registry.live_count == 0 and registry.kept_count == 0


def test_a_different_body_under_a_kept_key_is_already_exists() -> None:
    registry = GenerationRegistry(retention=600.0, max_bytes=1 << 20, clock=ManualClock())
    run(registry, "a", FinishReason.STOP)
    with pytest.raises(GenerationError) as refused:
        registry.find("caller", "a", b"another body")
    assert refused.value.kind is ErrorKind.ALREADY_EXISTS
    assert [v.field for v in refused.value.violations] == ["idempotency_key"]


@pytest.mark.parametrize("ending", ["cancelled", "failed"])
async def test_a_retry_that_joins_just_before_an_unkept_ending_still_hears_the_ending(ending: str) -> None:
    # The join's catch-up runs on the next turn of the event loop; a generation that ends before
    # then, in a way that is not kept, must still end the joiner's call instead of leaving it
    # waiting for events that will never come.
    registry = GenerationRegistry(retention=60.0, max_bytes=1 << 20, clock=ManualClock())
    generation, _ = registry.begin("caller", "k", b"body", lambda event: None)
    deliver = registry.deliver_to(generation)
    deliver(Started(0.01, 4))
    deliver(TokensGenerated((1, 2), "ab"))
    joiner: list[EngineEvent] = []
    registry.attach(generation, joiner.append)
    if ending == "cancelled":
        final: EngineEvent = Completed(
            GenerationResult("req-k", "m", "ab", (1, 2), FinishReason.CANCELLED, 4, TIMING)
        )
    else:
        final = Failed(GenerationError(ErrorKind.INTERNAL, "model failure"), TIMING)
    deliver(final)
    await asyncio.sleep(0)  # the join's turn
    assert [type(e).__name__ for e in joiner] == ["Started", "TokensGenerated", type(final).__name__]
    assert joiner[-1] is final
    assert registry.find("caller", "k", b"body") is None  # nothing of it is kept


def logprobs_of(positions: int, alternatives: int) -> tuple[TokenLogprobs, ...]:
    """Log-probabilities as a request with top_logprobs keeps them, tokens in several scripts."""
    words = ("the", " Straße", " 東京", " 🙂", "ing")
    return tuple(
        TokenLogprobs(
            1000 + i,
            words[i % len(words)] + str(i),
            -0.5 - i / 1000,
            tuple((2000 + j, words[j % len(words)] + str(j), -1.0 - j / 10) for j in range(alternatives)),
        )
        for i in range(positions)
    )


@pytest.mark.parametrize(("positions", "alternatives"), [(0, 0), (64, 0), (64, 5), (256, 20)])
def test_a_kept_result_is_counted_at_what_it_holds_in_memory(positions: int, alternatives: int) -> None:
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        logprobs = logprobs_of(positions, alternatives)
        ids = tuple(range(1000, 1000 + positions))
        result = GenerationResult(
            "req-x", "model", "y" * positions, ids, FinishReason.LENGTH, 4, TIMING, logprobs
        )
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    counted = result_bytes(result)
    assert held - before <= counted <= 2 * (held - before) + 4096


def test_a_caller_keeping_many_results_evicts_only_its_own() -> None:
    clock = ManualClock()
    logprobs = logprobs_of(32, 5)
    registry = GenerationRegistry(retention=600.0, max_bytes=200_000, clock=clock)
    run(registry, "mine", FinishReason.EOS, caller="quiet", logprobs=logprobs)
    for index in range(50):
        clock.advance(1.0)
        run(registry, f"flood-{index}", FinishReason.EOS, caller="busy", logprobs=logprobs)
    assert registry.kept_bytes <= 200_000
    assert registry.find("quiet", "mine", b"body") is not None
    assert registry.find("busy", "flood-0", b"body") is None
    assert registry.find("busy", "flood-49", b"body") is not None

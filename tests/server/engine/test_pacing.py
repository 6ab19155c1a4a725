"""The pacer's arithmetic: round budgets from measured costs, and how prompts are cut into chunks."""

from __future__ import annotations

import pytest

from tokenwire.server.engine.pacing import AUTO_STEP_FACTOR, MIN_PACED_CHUNK, PrefillPacer, chunk_length


def test_nothing_decoding_means_no_bound() -> None:
    pacer = PrefillPacer()
    pacer.observe_decode(0.030)
    pacer.observe_prefill(100, 0.2)
    assert pacer.budget(decoding=False).tokens is None


def test_the_automatic_target_leaves_room_for_the_decode_step() -> None:
    pacer = PrefillPacer()
    pacer.observe_decode(0.020)
    pacer.observe_prefill(100, 0.100)  # 1 ms per token
    budget = pacer.budget(decoding=True)
    assert budget.target_seconds == pytest.approx(AUTO_STEP_FACTOR * 0.020)
    # The round's prompt work plus its decode step fits the target.
    assert budget.tokens == int((AUTO_STEP_FACTOR - 1) * 20)


def test_a_fixed_target_is_used_as_given() -> None:
    pacer = PrefillPacer(max_step_seconds=0.1)
    pacer.observe_decode(0.020)
    pacer.observe_prefill(50, 0.100)  # 2 ms per token
    budget = pacer.budget(decoding=True)
    assert budget.target_seconds == 0.1
    assert budget.tokens == 40


def test_before_any_measurement_a_round_runs_the_smallest_chunk() -> None:
    assert PrefillPacer().budget(decoding=True).tokens == MIN_PACED_CHUNK
    fixed = PrefillPacer(max_step_seconds=0.05)
    fixed.observe_decode(0.01)
    assert fixed.budget(decoding=True).tokens == MIN_PACED_CHUNK


def test_a_prompt_always_progresses_even_when_the_step_alone_exceeds_the_target() -> None:
    pacer = PrefillPacer(max_step_seconds=0.01)
    pacer.observe_decode(0.050)
    pacer.observe_prefill(10, 0.010)
    assert pacer.budget(decoding=True).tokens == MIN_PACED_CHUNK


def test_costs_follow_recent_calls() -> None:
    pacer = PrefillPacer()
    pacer.observe_prefill(100, 0.1)
    for _ in range(30):
        pacer.observe_prefill(100, 0.3)
    assert pacer.token_seconds == pytest.approx(0.003, rel=1e-3)


def test_a_fixed_target_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        PrefillPacer(max_step_seconds=0)


@pytest.mark.parametrize(
    ("remaining", "wanted", "expected"),
    [
        (100, 30, 30),
        (31, 30, 31),  # a one-token tail joins the chunk
        (30, 30, 30),
        (100, 1, 2),  # no one-token chunk of a longer prompt
        (3, 1, 3),  # ...nor a one-token tail after a two-token chunk
        (1, 16, 1),  # a one-token prompt is what it is
        (2, 16, 2),
    ],
)
def test_chunks_never_hold_one_token_of_a_longer_prompt(remaining: int, wanted: int, expected: int) -> None:
    assert chunk_length(remaining, wanted) == expected


def test_every_split_covers_the_prompt_without_single_token_chunks() -> None:
    for length in range(1, 80):
        for wanted in range(1, 20):
            chunks: list[int] = []
            remaining = length
            while remaining:
                chunks.append(chunk_length(remaining, wanted))
                remaining -= chunks[-1]
            assert sum(chunks) == length
            assert length == 1 or min(chunks) >= 2

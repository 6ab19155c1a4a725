"""The acceptance rule of speculative decoding: greedy keeps exactly the drafts one-token decoding
would have produced; sampled keeps the target distribution (measured over many seeded draws)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import pytest

from tokenwire.server.sampling.speculative import Verdict, verify_greedy, verify_sampled

# The 0.999 quantile of the chi-square distribution with 5 degrees of freedom (six tokens): a
# correct rule exceeds it in one run of a thousand; the seeds below are fixed, so the test is
# deterministic, and a broken rule lands far above it (see the last test).
CHI_SQUARE_5_DOF_999 = 20.515
DRAWS = 20_000

P0 = np.array([0.30, 0.25, 0.20, 0.15, 0.07, 0.03])
P1 = np.array([0.05, 0.10, 0.40, 0.05, 0.30, 0.10])


def table(*rows: np.ndarray) -> Callable[[int], np.ndarray]:
    return lambda j: rows[j]


def counting(rows: Sequence[np.ndarray], asked: list[int]) -> Callable[[int], np.ndarray]:
    def row(j: int) -> np.ndarray:
        asked.append(j)
        return rows[j]

    return row


def chi_square(tokens: list[int], probs: np.ndarray) -> float:
    observed = np.bincount(np.asarray(tokens), minlength=probs.shape[0])
    expected = probs * len(tokens)
    return float(((observed - expected) ** 2 / expected).sum())


# -- greedy ---------------------------------------------------------------------------------------


def one_hot(token: int, vocab: int = 6) -> np.ndarray:
    row = np.zeros(vocab, dtype=np.float32)
    row[token] = 5.0
    return row


def test_greedy_keeps_drafts_while_they_are_the_argmax_and_replaces_the_first_that_is_not() -> None:
    asked: list[int] = []
    rows = [one_hot(2), one_hot(4), one_hot(1), one_hot(0)]
    verdict = verify_greedy(counting(rows, asked), [2, 4, 3])
    assert verdict == Verdict(accepted=2, next_token=1)
    assert verdict.tokens([2, 4, 3]) == [2, 4, 1]
    assert asked == [0, 1, 2]  # the row after the rejected draft is never scored


def test_greedy_gives_a_bonus_token_from_the_last_row_when_every_draft_is_kept() -> None:
    rows = [one_hot(2), one_hot(4), one_hot(5)]
    assert verify_greedy(table(*rows), [2, 4]) == Verdict(accepted=2, next_token=5)


def test_greedy_without_drafts_is_one_token_decoding() -> None:
    assert verify_greedy(table(one_hot(3)), []) == Verdict(accepted=0, next_token=3)


def test_greedy_ties_go_to_the_lowest_token_as_in_one_token_decoding() -> None:
    tie = np.array([0.0, 1.0, 1.0, 0.0], dtype=np.float32)
    assert verify_greedy(table(tie, tie), [2]) == Verdict(accepted=0, next_token=1)
    assert verify_greedy(table(tie, tie), [1]) == Verdict(accepted=1, next_token=1)


# -- sampled --------------------------------------------------------------------------------------


def test_a_certain_draft_is_always_kept_and_an_impossible_one_never() -> None:
    rng = np.random.default_rng(1)
    certain = np.array([0.0, 1.0, 0.0])
    impossible = np.array([0.5, 0.0, 0.5])
    for _ in range(200):
        assert verify_sampled(table(certain, certain), [1], rng).accepted == 1
        verdict = verify_sampled(table(impossible, impossible), [1], rng)
        assert verdict.accepted == 0 and verdict.next_token != 1


def test_a_rejected_draft_is_never_the_replacement() -> None:
    rng = np.random.default_rng(2)
    for _ in range(2000):
        verdict = verify_sampled(table(P0, P1), [0], rng)
        assert verdict.accepted == 1 or verdict.next_token != 0


def test_the_same_seed_gives_the_same_verdicts() -> None:
    def run(seed: int) -> list[Verdict]:
        rng = np.random.default_rng(seed)
        return [verify_sampled(table(P0, P1, P0), [0, 2], rng) for _ in range(100)]

    assert run(7) == run(7)
    assert run(7) != run(8)


@pytest.mark.parametrize("draft", [0, 3, 5])
def test_the_first_token_is_distributed_as_the_target_whatever_the_draft(draft: int) -> None:
    rng = np.random.default_rng(100 + draft)
    first = [verify_sampled(table(P0, P1), [draft], rng).tokens([draft])[0] for _ in range(DRAWS)]
    assert chi_square(first, P0) < CHI_SQUARE_5_DOF_999


def test_after_a_kept_draft_the_next_token_is_distributed_as_its_own_row() -> None:
    rng = np.random.default_rng(11)
    second: list[int] = []
    while len(second) < DRAWS:
        tokens = verify_sampled(table(P0, P1, P0), [0, 4], rng).tokens([0, 4])
        if len(tokens) >= 2:  # the first draft was kept
            second.append(tokens[1])
    assert chi_square(second, P1) < CHI_SQUARE_5_DOF_999


def test_the_bonus_token_is_distributed_as_the_last_row() -> None:
    rng = np.random.default_rng(12)
    certain = np.array([0.0, 0.0, 1.0, 0.0, 0.0, 0.0])
    bonus = [verify_sampled(table(certain, P1), [2], rng).next_token for _ in range(DRAWS)]
    assert chi_square(bonus, P1) < CHI_SQUARE_5_DOF_999


def test_the_test_rejects_a_rule_that_resamples_from_the_whole_distribution() -> None:
    """A plausible mistake: on rejection, draw from p itself (the draft not removed). Its first
    token over-weights the draft, and the same test fails it by far."""
    rng = np.random.default_rng(13)
    draft = 3
    first: list[int] = []
    for _ in range(DRAWS):
        if rng.random() < P0[draft]:
            first.append(draft)
        else:
            first.append(int(rng.choice(P0.shape[0], p=P0)))
    assert chi_square(first, P0) > 5 * CHI_SQUARE_5_DOF_999

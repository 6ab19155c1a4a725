"""Prompt-lookup drafting: the longest trailing n-gram, its most recent earlier occurrence, and
the tokens that followed it."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokenwire.server.engine.drafting import LookupSettings, propose_drafts


def naive(tokens: list[int], settings: LookupSettings) -> list[int]:
    """The rule as written, one comparison at a time."""
    for n in range(min(settings.max_ngram, len(tokens) - 1), settings.min_ngram - 1, -1):
        suffix = tokens[len(tokens) - n :]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + settings.max_tokens]
    return []


def test_the_tokens_after_the_earlier_occurrence_are_proposed() -> None:
    prompt = [1, 2, 3, 4, 5, 6, 7]
    assert propose_drafts(prompt, [9, 3, 4], LookupSettings(max_tokens=3)) == [5, 6, 7]


def test_the_most_recent_occurrence_wins() -> None:
    tokens = [3, 4, 10, 11, 3, 4, 20, 21, 3, 4]
    assert propose_drafts(tokens, [], LookupSettings(max_tokens=2, max_ngram=2)) == [20, 21]


def test_a_longer_match_wins_over_a_more_recent_shorter_one() -> None:
    # "2 3 4" once, early; "3 4" more recently.
    tokens = [2, 3, 4, 50, 51, 9, 3, 4, 60, 61, 2, 3, 4]
    assert propose_drafts(tokens, [], LookupSettings(max_tokens=2, max_ngram=3)) == [50, 51]
    assert propose_drafts(tokens, [], LookupSettings(max_tokens=2, max_ngram=2)) == [60, 61]


def test_matches_shorter_than_the_minimum_propose_nothing() -> None:
    tokens = [7, 8, 1, 2, 9, 2]
    assert propose_drafts(tokens, [], LookupSettings(min_ngram=1)) == [9, 2]
    assert propose_drafts(tokens, [], LookupSettings(min_ngram=2)) == []


def test_no_occurrence_or_too_few_tokens_propose_nothing() -> None:
    assert propose_drafts([1, 2, 3], [4], LookupSettings()) == []
    assert propose_drafts([], [], LookupSettings()) == []
    assert propose_drafts([5], [], LookupSettings()) == []


def test_the_draft_stops_at_the_limit_and_at_the_end_of_the_tokens() -> None:
    assert propose_drafts([1, 2, 3, 4, 5, 1], [], LookupSettings(max_tokens=2)) == [2, 3]
    # The match's continuation may run into the suffix itself: a repeated token drafts itself.
    assert propose_drafts([5, 5, 5], [], LookupSettings(max_tokens=4)) == [5]


def test_prompt_and_output_are_one_text() -> None:
    assert propose_drafts([1, 2], [3, 1, 2], LookupSettings(max_tokens=2, max_ngram=2)) == [3, 1]


@pytest.mark.parametrize(
    "bad",
    [
        {"max_tokens": 0},
        {"max_tokens": 17},
        {"min_ngram": 0},
        {"min_ngram": 3, "max_ngram": 2},
        {"max_ngram": 9},
    ],
)
def test_settings_out_of_bounds_are_refused(bad: dict[str, int]) -> None:
    with pytest.raises(ValueError, match=r"max_tokens|min_ngram"):
        LookupSettings(**bad)


@given(
    tokens=st.lists(st.integers(0, 4), max_size=60),
    max_tokens=st.integers(1, 6),
    ngrams=st.tuples(st.integers(1, 5), st.integers(1, 5)).map(sorted),
    split=st.integers(0, 60),
)
def test_proposals_follow_the_rule_as_written(
    tokens: list[int], max_tokens: int, ngrams: list[int], split: int
) -> None:
    settings = LookupSettings(max_tokens=max_tokens, min_ngram=ngrams[0], max_ngram=ngrams[1])
    assert propose_drafts(tokens[:split], tokens[split:], settings) == naive(tokens, settings)

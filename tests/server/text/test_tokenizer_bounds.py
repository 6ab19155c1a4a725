"""Tokenizing stops as soon as a text cannot fit, and a text that fits gets exactly encode's tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenwire.server.text.tokenizer import PIECE_CHARACTERS, Tokenizer, TooManyTokensError

PROSE = "The quick brown fox jumps over the lazy dog.  Servers queue requests;\n\ttabs and   spaces. 東京 😀 "


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(tiny_model_dir / "tokenizer.json")


@pytest.mark.parametrize("repeats", [1, 200, 2000])
def test_a_text_that_fits_gets_exactly_the_tokens_of_encode(tokenizer: Tokenizer, repeats: int) -> None:
    text = PROSE * repeats
    expected = tokenizer.encode(text)
    assert tokenizer.encode_within(text, len(expected)) == expected
    assert tokenizer.encode_within(text, len(expected), as_text=True) == tokenizer.encode_as_text(text)


def test_one_token_too_many_is_refused_with_the_count(tokenizer: Tokenizer) -> None:
    text = PROSE * 300
    tokens = len(tokenizer.encode(text))
    with pytest.raises(TooManyTokensError) as refused:
        tokenizer.encode_within(text, tokens - 1)
    assert refused.value.at_least >= tokens - 1


def test_counting_a_huge_text_stops_soon_after_the_bound(tokenizer: Tokenizer) -> None:
    huge = PROSE * 20_000  # about 2 million characters
    with pytest.raises(TooManyTokensError) as refused:
        tokenizer.encode_within(huge, 1000)
    # Stopped within a piece or two of the bound, not after counting all of it.
    assert 1000 < refused.value.at_least < 1000 + 2 * PIECE_CHARACTERS


def test_a_text_without_whitespace_is_still_cut_and_counted(tokenizer: Tokenizer) -> None:
    blob = "x" * (10 * PIECE_CHARACTERS)
    with pytest.raises(TooManyTokensError):
        tokenizer.encode_within(blob, 100)
    assert tokenizer.encode_within(blob, 10**6) == tokenizer.encode(blob)

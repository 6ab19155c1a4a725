"""Incremental detokenization never splits a character and loses no text."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenwire.server.text.detokenizer import IncrementalDetokenizer
from tokenwire.server.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(tiny_model_dir / "tokenizer.json")


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world!",
        "😀 emoji and 東京 and café",
        " leading and  double  spaces\n\tand tabs",
        "naïve déjà vu",
    ],
)
def test_deltas_join_to_the_decoded_text(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids=[])
    deltas = [detokenizer.push(token) for token in ids]
    deltas.append(detokenizer.flush())
    assert "".join(deltas) == text
    assert all("\ufffd" not in delta for delta in deltas)


def test_a_character_split_over_byte_tokens_comes_out_whole(tokenizer: Tokenizer) -> None:
    emoji_ids = tokenizer.encode("😀")
    assert len(emoji_ids) > 1, "the test needs a character spread over several tokens"
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids=tokenizer.encode("Hi "))
    deltas = [detokenizer.push(token) for token in emoji_ids]
    assert deltas[:-1] == [""] * (len(emoji_ids) - 1)
    assert deltas[-1] == "😀"


def test_leading_space_of_a_continuation_is_kept(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode("The capital")
    continuation = tokenizer.encode(" of France is")
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids=prompt)
    text = "".join(detokenizer.push(t) for t in continuation) + detokenizer.flush()
    assert text == " of France is"


def test_flush_releases_an_incomplete_character_at_the_end(tokenizer: Tokenizer) -> None:
    first_byte = tokenizer.encode("😀")[0]
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids=[])
    assert detokenizer.push(first_byte) == ""
    assert detokenizer.flush() == "\ufffd"

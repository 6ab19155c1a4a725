"""The tokenizer a model was trained with, wrapped in the few operations the server needs."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

from tokenizers import Tokenizer as HfTokenizer

PIECE_CHARACTERS = 4096
"""Characters tokenized per call while counting a long text: the tokenizer holds the GIL for a
whole call, so a call this size keeps the event loop's wait to a few milliseconds."""
_CUT_SLACK_TOKENS = 4
"""Tokens a cut between pieces may add to the count (merges cannot cross it)."""
_WHITESPACE_START = re.compile(r"(?<=\S)\s")


class TooManyTokensError(ValueError):
    """The text holds more tokens than allowed; counting stopped at `at_least`."""

    def __init__(self, at_least: int) -> None:
        super().__init__(f"at least {at_least} tokens")
        self.at_least = at_least


class Tokenizer:
    """A Hugging Face `tokenizers` tokenizer loaded from a model directory's tokenizer.json."""

    def __init__(self, backend: HfTokenizer) -> None:
        self._backend = backend
        self._vocab_size = backend.get_vocab_size(with_added_tokens=True)
        # A twin that reads special-token markup as the characters it is made of; the setting
        # is per tokenizer, and flipping it on the shared one would race with other threads.
        self._as_text = HfTokenizer.from_str(backend.to_str())
        self._as_text.encode_special_tokens = True
        self.special_tokens: tuple[str, ...] = tuple(
            sorted(
                (added.content for added in backend.get_added_tokens_decoder().values() if added.special),
                key=len,
                reverse=True,
            )
        )
        """The text of every special (control) token, longest first."""
        self._added_ids = frozenset(backend.get_added_tokens_decoder())
        self._byte_level = '"ByteLevel"' in json.dumps(json.loads(backend.to_str()).get("decoder"))

    @classmethod
    def from_file(cls, path: Path) -> Tokenizer:
        return cls(HfTokenizer.from_file(str(path)))

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def to_json(self) -> str:
        """The tokenizer.json text, for libraries that build their own view of the vocabulary."""
        return str(self._backend.to_str())

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        # Special-token markup inside the text (e.g. "<|im_start|>") is recognised, as in the
        # Hugging Face tokenizers, so rendered chat templates tokenize to the real control tokens.
        return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_as_text(self, text: str) -> list[int]:
        """Tokens of `text` read as plain text: "<|im_end|>" in it is characters, not a control token."""
        return list(self._as_text.encode(text, add_special_tokens=False).ids)

    def encode_within(
        self, text: str, max_tokens: int, *, add_special_tokens: bool = True, as_text: bool = False
    ) -> list[int]:
        """Tokens of `text` (as encode, or encode_as_text), or TooManyTokensError as soon as it
        is clear there are more than `max_tokens`.

        A long text is first counted piece by piece, cut where whitespace begins (where the
        pre-tokenizers cut anyway), so no call holds the GIL for long and counting stops at the
        first piece that takes the count past the bound. Only a text that fits is tokenized whole,
        so the tokens are exactly those of encode.
        """
        counter = self._as_text if as_text else self._backend
        if len(text) > PIECE_CHARACTERS:
            counted = 0
            for cuts, piece in enumerate(_pieces(text)):
                counted += len(counter.encode(piece, add_special_tokens=False).ids)
                if counted > max_tokens + cuts * _CUT_SLACK_TOKENS:
                    raise TooManyTokensError(counted - cuts * _CUT_SLACK_TOKENS)
        ids = (
            self.encode_as_text(text) if as_text else self.encode(text, add_special_tokens=add_special_tokens)
        )
        if len(ids) > max_tokens:
            raise TooManyTokensError(len(ids))
        return ids

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return str(self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for on its own: for a byte-level or byte-fallback token
        that holds part of a character, that part (where decoding it alone gives U+FFFD)."""
        piece = self._backend.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self._added_ids:
            return str(piece).encode()
        if self._byte_level:
            try:
                return bytes(_BYTE_OF_CHARACTER[char] for char in piece)
            except KeyError:
                return str(piece).encode()
        fallback = _BYTE_PIECE.fullmatch(piece)
        if fallback is not None:
            return bytes([int(fallback.group(1), 16)])
        return str(piece).replace("\u2581", " ").encode()

    def token_to_id(self, token: str) -> int | None:
        found = self._backend.token_to_id(token)
        return None if found is None else int(found)


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's alphabet: each byte as a printable character (printable Latin-1 bytes
    as themselves, the others shifted past 255 in order), mapped back to its byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    alphabet = {chr(byte): byte for byte in printable}
    shifted = 0
    for byte in range(256):
        if byte not in printable:
            alphabet[chr(256 + shifted)] = byte
            shifted += 1
    return alphabet


_BYTE_OF_CHARACTER = _byte_level_alphabet()
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _pieces(text: str) -> Iterator[str]:
    """`text` in pieces of about PIECE_CHARACTERS, each cut where a run of whitespace begins (or
    mid-run of non-whitespace when a window holds no whitespace at all)."""
    start = 0
    while len(text) - start > PIECE_CHARACTERS:
        found = _WHITESPACE_START.search(text, start + PIECE_CHARACTERS, start + 2 * PIECE_CHARACTERS)
        cut = found.start() if found is not None else start + PIECE_CHARACTERS
        yield text[start:cut]
        start = cut
    yield text[start:]

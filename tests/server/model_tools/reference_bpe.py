"""An independent byte-level BPE encoder, written from the GPT-2 algorithm, to check tokenizer.json.

Pre-tokenization follows GPT-2's split pattern
    's|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+
implemented as a hand-written scanner over Unicode categories (the standard library's `re` has
no \\p{...} classes), optionally after splitting every digit on its own (StarCoder/SmolLM).
Each piece's UTF-8 bytes are mapped to GPT-2's printable byte alphabet, then merged pair by
pair in merge-rank order. Special tokens are cut out of the text first.
"""

from __future__ import annotations

import itertools
import re
import unicodedata
from collections.abc import Iterator

_CONTRACTIONS = ("'s", "'t", "'re", "'ve", "'m", "'ll", "'d")


def _is_letter(ch: str) -> bool:
    return unicodedata.category(ch).startswith("L")


def _is_number(ch: str) -> bool:
    return unicodedata.category(ch).startswith("N")


def _is_space(ch: str) -> bool:
    return ch.isspace()


def _is_other(ch: str) -> bool:
    return not (_is_space(ch) or _is_letter(ch) or _is_number(ch))


def gpt2_split(text: str) -> Iterator[str]:
    i, n = 0, len(text)
    while i < n:
        contraction = next((c for c in _CONTRACTIONS if text.startswith(c, i)), None)
        if contraction is not None:
            yield contraction
            i += len(contraction)
            continue
        matched = False
        for klass in (_is_letter, _is_number, _is_other):
            if klass(text[i]):
                start = i
            elif text[i] == " " and i + 1 < n and klass(text[i + 1]):
                start = i + 1  # the optional leading space of " ?X+"
            else:
                continue
            end = start
            while end < n and klass(text[end]):
                end += 1
            yield text[i:end]
            i = end
            matched = True
            break
        if matched:
            continue
        # A whitespace run: all of it at the end of the text, otherwise all but its last
        # character (which then prefixes the next word), or a single character.
        end = i
        while end < n and _is_space(text[end]):
            end += 1
        if end == n or end - i == 1:
            yield text[i:end]
            i = end
        else:
            yield text[i : end - 1]
            i = end - 1


def digits_then_gpt2_split(text: str) -> Iterator[str]:
    piece = ""
    for ch in text:
        if _is_number(ch):
            if piece:
                yield from gpt2_split(piece)
                piece = ""
            yield ch
        else:
            piece += ch
    if piece:
        yield from gpt2_split(piece)


def byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


class ReferenceBpe:
    def __init__(
        self, tokens: list[str], merges: list[str], special: list[str], *, split_digits: bool
    ) -> None:
        self.ids = {token: i for i, token in enumerate(tokens)}
        self.ranks = {tuple(m.split(" ", 1)): rank for rank, m in enumerate(merges)}
        self.alphabet = byte_alphabet()
        self.split = digits_then_gpt2_split if split_digits else gpt2_split
        ordered = sorted(special, key=len, reverse=True)
        self.special = re.compile("(" + "|".join(re.escape(s) for s in ordered) + ")") if ordered else None

    def _bpe(self, word: str) -> list[str]:
        symbols = list(word)
        while len(symbols) > 1:
            pairs = [(self.ranks.get((a, b)), i) for i, (a, b) in enumerate(itertools.pairwise(symbols))]
            ranked = [(rank, i) for rank, i in pairs if rank is not None]
            if not ranked:
                break
            best = min(ranked)[0]
            merged: list[str] = []
            i = 0
            while i < len(symbols):
                if i + 1 < len(symbols) and self.ranks.get((symbols[i], symbols[i + 1])) == best:
                    merged.append(symbols[i] + symbols[i + 1])
                    i += 2
                else:
                    merged.append(symbols[i])
                    i += 1
            symbols = merged
        return symbols

    def encode(self, text: str) -> list[int]:
        parts = self.special.split(text) if self.special else [text]
        ids: list[int] = []
        for index, part in enumerate(parts):
            if index % 2 == 1:  # a special token captured by the split
                ids.append(self.ids[part])
                continue
            for piece in self.split(part):
                mapped = "".join(self.alphabet[b] for b in piece.encode("utf-8"))
                ids.extend(self.ids[symbol] for symbol in self._bpe(mapped))
        return ids

"""An independent SentencePiece-style encoder, written from llama.cpp's llm_tokenizer_spm.

Special tokens are split out of the text first (those marked to strip what follows them drop
the whitespace after them); each other fragment gets a leading space when it
follows a special token or starts the text (if the vocabulary asks for one), spaces become "▁",
then adjacent pieces are joined, highest-scoring join first (leftmost on ties), while the join is
a token; pieces no token covers are spelled as their UTF-8 bytes' <0xXX> tokens.
"""

from __future__ import annotations

import heapq


class ReferenceSpm:
    def __init__(
        self,
        tokens: list[str],
        scores: list[float],
        specials: list[str],
        *,
        add_space_prefix: bool,
        strip_after: frozenset[str] = frozenset(),
    ) -> None:
        self.ids = {t: i for i, t in enumerate(tokens)}
        self.scores = scores
        self.specials = sorted(specials, key=len, reverse=True)
        self.add_space_prefix = add_space_prefix
        self.strip_after = strip_after

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        previous_special = True
        for fragment, special in self._split(text):
            if special:
                out.append(self.ids[fragment])
                previous_special = True
                continue
            if self.add_space_prefix and previous_special:
                fragment = " " + fragment
            previous_special = False
            out += self._encode_fragment(fragment.replace(" ", "\u2581"))
        return out

    def _split(self, text: str) -> list[tuple[str, bool]]:
        parts: list[tuple[str, bool]] = []
        start = i = 0
        while i < len(text):
            match = next((s for s in self.specials if text.startswith(s, i)), None)
            if match is None:
                i += 1
                continue
            if start < i:
                parts.append((text[start:i], False))
            parts.append((match, True))
            i += len(match)
            if match in self.strip_after:
                # llama.cpp's RSTRIP: C isspace() characters after the token are dropped.
                while i < len(text) and text[i] in " \t\n\v\f\r":
                    i += 1
            start = i
        if start < len(text):
            parts.append((text[start:], False))
        return parts

    def _encode_fragment(self, text: str) -> list[int]:
        pieces: list[str | None] = list(text)
        nexts = [*list(range(1, len(pieces))), -1]
        prevs = [-1, *range(len(pieces) - 1)]
        queue: list[tuple[float, int, str, str]] = []

        def push(left: int) -> None:
            right = nexts[left]
            if left < 0 or right < 0:
                return
            a, b = pieces[left], pieces[right]
            assert a is not None and b is not None
            joined = self.ids.get(a + b)
            if joined is not None:
                heapq.heappush(queue, (-self.scores[joined], left, a, b))

        for i in range(len(pieces) - 1):
            push(i)
        while queue:
            _, left, a, b = heapq.heappop(queue)
            right = nexts[left]
            if pieces[left] != a or right < 0 or pieces[right] != b:
                continue  # stale: one side was joined since
            pieces[left] = a + b
            pieces[right] = None
            nexts[left] = nexts[right]
            if nexts[right] >= 0:
                prevs[nexts[right]] = left
            push(prevs[left])
            push(left)
        out: list[int] = []
        for piece in pieces:
            if piece is None:
                continue
            if piece in self.ids:
                out.append(self.ids[piece])
            else:
                out += [self.ids[f"<0x{byte:02X}>"] for byte in piece.encode("utf-8")]
        return out

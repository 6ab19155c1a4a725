"""Prompt-lookup drafting: guess a sequence's next tokens from its own prompt and output.

No second model: the last n tokens (n from `max_ngram` down to `min_ngram`) are looked up
earlier in prompt + output, and the tokens that followed the most recent earlier occurrence are
the draft. Work that copies or rewrites an input (an edit, an extraction, a summary quoting its
source) repeats long runs of its prompt, which is where the drafts are accepted. A longer match
wins over a more recent shorter one: it is the stronger evidence of what comes next.

One call costs O(length x max_ngram), in vectorized passes over the tokens. Pure; the engine
calls it from its own thread between steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

MAX_DRAFT_TOKENS = 16
MAX_NGRAM = 8


@dataclass(frozen=True)
class LookupSettings:
    """How to draft: at most `max_tokens` tokens, from a match of `max_ngram` down to
    `min_ngram` trailing tokens."""

    max_tokens: int = 4
    max_ngram: int = 3
    min_ngram: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.max_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"max_tokens must be in [1, {MAX_DRAFT_TOKENS}], not {self.max_tokens}")
        if not 1 <= self.min_ngram <= self.max_ngram <= MAX_NGRAM:
            raise ValueError(
                f"need 1 <= min_ngram <= max_ngram <= {MAX_NGRAM}, not {self.min_ngram} and {self.max_ngram}"
            )


def propose_drafts(prompt: Sequence[int], output: Sequence[int], settings: LookupSettings) -> list[int]:
    """Up to `settings.max_tokens` tokens that may follow prompt + output; [] without a match."""
    tokens = np.concatenate(
        [np.asarray(prompt, dtype=np.int64).reshape(-1), np.asarray(output, dtype=np.int64).reshape(-1)]
    )
    length = int(tokens.shape[0])
    # matches[j]: the tokens ending at position j equal the last n tokens, for the n reached so
    # far. Ends stop before the last position: an occurrence needs a token after it, and the
    # suffix must not match itself.
    ends = length - 1
    if ends <= 0:
        return []
    matches = tokens[:ends] == tokens[-1]
    best = -1
    for n in range(1, min(settings.max_ngram, ends) + 1):
        if n > 1:
            # Extend every surviving match one token to the left; ends before n - 1 cannot hold n.
            matches[: n - 1] = False
            matches[n - 1 :] &= tokens[: ends - n + 1] == tokens[length - n]
        found = np.flatnonzero(matches)
        if found.size == 0:
            break
        if n >= settings.min_ngram:
            best = int(found[-1])
    if best < 0:
        return []
    return [int(t) for t in tokens[best + 1 : best + 1 + settings.max_tokens]]

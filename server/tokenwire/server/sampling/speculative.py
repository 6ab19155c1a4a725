"""Which drafted tokens a verification step keeps, by a rule that leaves the output's
distribution what decoding one token at a time gives.

A verification step scores the K drafts of a sequence in one model call: row j of its logits
predicts the token after draft j - 1 (row 0 the token after the last accepted one), so there are
K + 1 rows. The rows are asked for in order and only as far as needed (`rows(j)`), so the caller
can record each accepted draft (penalties, a response format) before the next row is scored.

- Greedy: a draft is kept while it equals the row's most likely token; the first row where it
  does not gives the next token, and when every draft is kept the last row gives a bonus token.
- Sampled, with a deterministic draft (prompt lookup proposes one token, with certainty): draft
  d is kept with probability p(d); otherwise the next token is drawn from p with d removed and
  the rest renormalized. The kept-or-replaced token is then distributed exactly as p, which is
  the standard speculative-sampling rule with a draft distribution that is one point.

Every draw comes from the generator passed in, the sequence's own seeded one, so a seeded
request is reproducible and its tokens never depend on its batch. Pure; engine thread.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Verdict:
    """The outcome of verifying one sequence's drafts."""

    accepted: int
    """How many drafts are kept, from the first."""
    next_token: int
    """The token after them: the replacement of the first rejected draft, or the bonus token."""

    def tokens(self, drafts: Sequence[int]) -> list[int]:
        """The tokens the sequence gains: the kept drafts, then the next token."""
        return [*drafts[: self.accepted], self.next_token]


def verify_greedy(rows: Callable[[int], np.ndarray], drafts: Sequence[int]) -> Verdict:
    """`rows(j)` is the scores ([vocab]) after draft j - 1; ties go to the lowest token id, as
    argmax breaks them in one-token decoding."""
    for position, draft in enumerate(drafts):
        best = int(np.argmax(rows(position)))
        if best != draft:
            return Verdict(position, best)
    return Verdict(len(drafts), int(np.argmax(rows(len(drafts)))))


def verify_sampled(
    rows: Callable[[int], np.ndarray], drafts: Sequence[int], rng: np.random.Generator
) -> Verdict:
    """`rows(j)` is the distribution ([vocab] probabilities summing to 1) the sequence samples
    from after draft j - 1, with its temperature, truncation and masks already applied."""
    for position, draft in enumerate(drafts):
        probs = np.asarray(rows(position), dtype=np.float64)
        if rng.random() < probs[draft]:
            continue
        # Rejected: whatever mass the draft had is taken out. (A draft with probability 1 is
        # never rejected, so some mass is left.)
        residual = probs.copy()
        residual[draft] = 0.0
        return Verdict(position, _draw(residual, rng))
    return Verdict(len(drafts), _draw(np.asarray(rows(len(drafts)), dtype=np.float64), rng))


def _draw(weights: np.ndarray, rng: np.random.Generator) -> int:
    """A token drawn in proportion to `weights` (which need not sum to 1)."""
    cumulative = np.cumsum(weights)
    draw = rng.random() * cumulative[-1]
    # side="right" never picks a token of zero weight: its cumulative sum equals its left
    # neighbour's, and a draw equal to that sum lands after it.
    index = int(np.searchsorted(cumulative, draw, side="right"))
    return min(index, int(np.flatnonzero(weights)[-1]))

"""Prompt-lookup speculative decoding: the rule that says which rows draft, and how many tokens.

The scheduler asks this module, for each row of a round's decode step, how many draft tokens the
row may verify (0: it decodes one token as usual); the plan carries those counts. The engine
core then proposes that many drafts from the row's own prompt and output (drafting.py), appends
`[last token, *drafts]` to the row in one model call and verifies them with the row's own
sampler (verification.py), and reports how many it drafted and how many were kept, which come
back here as the row's history.

When a row does not draft:
- it has a response format (the constraint is not checked against drafts);
- the decode step has more than `max_batch` rows: there a step is compute-bound on a CPU and a
  verification costs more than it can gain (BENCHMARKS.md, section 12);
- its drafts keep failing: once its last `ADAPTIVE_WINDOW` verifications accepted less than
  `MIN_ACCEPTANCE` of what they drafted, it stops drafting for its next `PAUSE_STEPS` decode
  steps that could speculate; its first verification after that is judged alone, and if it
  fails too the pause doubles (up to `MAX_PAUSE_STEPS`), while one that passes ends the streak.
  At batch 1 a K = 4 verification costs about 2 decode steps on this CPU, so a step must keep
  one draft in four just to break even; the bar is half, so a request keeps drafting only while
  it wins by a margin, and free chat, whose drafts match a token now and then, costs a
  verification every few hundred steps instead of every few;
- no room is left: a step gains at most drafts + 1 tokens, which must not pass max_new_tokens
  or the context (the KV cache holds the context, so this also keeps the run inside the row's
  KV room);
- other streams share the step and the verification would cost them more than their share
  (`NeighbourBudget`): a verification is a model call of its own on top of the step, so a
  request whose drafts keep matching (a self-repeating prompt) would otherwise make every stream
  it shares steps with pay for its speed. Verified positions are charged as work: what
  verifications add to steps shared with streams that do not verify is held to
  `NEIGHBOUR_SHARE` of a plain step on average, and the drafts a request rejects count against
  its caller's fair share like any other work.

Plain data and arithmetic: the scheduler calls it, so it imports no array library or runner.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenwire.server.engine.request import Request

ADAPTIVE_WINDOW = 4
"""Verification steps of a request that the adaptive rule looks back over."""
MIN_ACCEPTANCE = 0.5
"""Below this share of drafted tokens accepted over the window, a request pauses drafting (a
quarter is where a verification only breaks even here)."""
PAUSE_STEPS = 16
"""Decode steps a request goes without drafting after its drafts kept failing."""
MAX_PAUSE_STEPS = 512
"""The longest pause, after failing again and again."""
NEIGHBOUR_SHARE = 0.15
"""What verifying drafts may add, on average, to the decode steps that streams which do not
verify share with them, as a part of a plain step's time. Below the 1.25x a neighbour's token
gap is held to, because a verification is not all a faster stream costs the streams beside it:
its extra tokens are sampled, detokenized and sent on the same cores (BENCHMARKS.md, section
17)."""
MIN_NGRAM = 2
"""The fewest trailing tokens a draft's match must cover: a single repeated token is weak
evidence of what follows (a common word, a bracket), and such drafts are mostly rejected."""


@dataclass(frozen=True)
class SpeculationSettings:
    tokens: int
    """K: the most draft tokens a row verifies in one step; 0 is off."""
    max_batch: int
    """The most rows a decode step may have for it to speculate."""

    @property
    def enabled(self) -> bool:
        return self.tokens > 0


OFF = SpeculationSettings(0, 1)


@dataclass
class DraftHistory:
    """One request's recent verifications, for the adaptive rule."""

    recent: deque[tuple[int, int]] = field(default_factory=lambda: deque(maxlen=ADAPTIVE_WINDOW))
    """(drafted, accepted) of its latest verification steps."""
    paused_for: int = 0
    """Decode steps left before it drafts again."""
    failures: int = 0
    """Pauses in a row: each one after the first doubles."""
    verifying: bool = False
    """Its latest step that let it draft found drafts to verify: it is likely to again."""


def draft_limits(
    settings: SpeculationSettings,
    rows: Sequence[Request],
    first_tokens: Sequence[bool],
    *,
    context_length: int,
) -> tuple[int, ...]:
    """How many drafts each row of a decode step may verify (0: none). `first_tokens[i]` says row
    i gets its first token this round, before the step (its prompt ends in the round, or it
    copies its group's prompt), so it will have produced one token more than it has now."""
    if not settings.enabled or len(rows) > settings.max_batch:
        return (0,) * len(rows)
    return tuple(
        _limit(settings, request, produced=request.generated_tokens + first, context_length=context_length)
        for request, first in zip(rows, first_tokens, strict=True)
    )


def _limit(settings: SpeculationSettings, request: Request, *, produced: int, context_length: int) -> int:
    if request.response_format is not None:
        return 0
    history = request.drafting
    if history.paused_for > 0:
        history.paused_for -= 1
        return 0
    left = min(
        request.submitted.stopping.max_new_tokens - produced,
        context_length - request.prompt_length - produced,
    )
    return max(0, min(settings.tokens, left - 1))


def record_verification(history: DraftHistory, *, drafted: int, accepted: int) -> None:
    """Take a row's verification into its history; pause its drafting if they keep failing."""
    failing = accepted < MIN_ACCEPTANCE * drafted
    if history.failures:
        # The first verification after a pause: it alone decides.
        if failing:
            history.failures += 1
            history.paused_for = min(PAUSE_STEPS * 2 ** (history.failures - 1), MAX_PAUSE_STEPS)
            return
        history.failures = 0
    history.recent.append((drafted, accepted))
    if len(history.recent) < ADAPTIVE_WINDOW:
        return
    total_drafted = sum(d for d, _ in history.recent)
    total_accepted = sum(a for _, a in history.recent)
    if total_accepted < MIN_ACCEPTANCE * total_drafted:
        history.recent.clear()
        history.failures = 1
        history.paused_for = PAUSE_STEPS


class NeighbourBudget:
    """Keeps what verifying drafts adds to the steps of streams that do not verify within
    `NEIGHBOUR_SHARE` of a plain step, on average.

    Every step with such a neighbour earns `NEIGHBOUR_SHARE` of a plain step's time in credit,
    up to one verification's cost (so a quiet spell buys no burst); a verification in such a
    step runs when the credit covers its estimated cost, and what the step then took beyond a
    plain step is spent.
    The cost of a verified position (its share of the verification's own model call) is learned
    from the steps that verified. A step whose every row may verify has no neighbour to spare.
    """

    def __init__(self, settings: SpeculationSettings) -> None:
        self._settings = settings
        self._credit = 0.0
        self._plain_step: float | None = None
        """Seconds of a whole decode step that verified nothing (its call and its sampling)."""
        self._position_seconds: float | None = None
        """Seconds a verified position adds to a step, its call's overhead shared out."""

    @property
    def position_seconds(self) -> float | None:
        return self._position_seconds

    def limit(self, rows: Sequence[Request], limits: Sequence[int]) -> tuple[int, ...]:
        """`limits` (the draft counts of a step's rows) with the verifications the credit cannot
        pay for taken out (0). A row that is not verifying (it may not draft, or found nothing to
        draft when it last could) is a neighbour; with one in the step beside another row, every
        verification is paid for from the credit (a neighbour's own too); with none, or a row
        alone, every row keeps its count."""
        verifying = [
            bool(limit) and request.drafting.verifying for request, limit in zip(rows, limits, strict=True)
        ]
        if len(rows) < 2 or all(verifying) or not any(limits):
            return tuple(limits)
        plain_step, per_position = self._plain_step, self._position_seconds
        if plain_step is None:
            return (0,) * len(limits)  # a plain step first: what a verification adds is told from it
        if per_position is None:
            return tuple(limits)  # then one verification, whose cost teaches the rest
        earned = NEIGHBOUR_SHARE * plain_step
        most = max(per_position * (self._settings.tokens + 1), earned)  # one verification's worth
        self._credit = min(self._credit + earned, most)
        allowed = []
        reserved = 0.0
        for limit in limits:
            cost = per_position * (limit + 1)
            if limit and reserved + cost <= self._credit:
                reserved += cost
                allowed.append(limit)
            else:
                allowed.append(0)
        return tuple(allowed)

    def observe(self, *, step_seconds: float, positions: int, shared: bool) -> None:
        """A whole decode step took `step_seconds` and verified `positions` positions (drafts + 1
        per verifying row; 0 for a plain step); `shared`: rows that did not verify were in it,
        so what it took beyond a plain step is spent from the credit."""
        if positions <= 0:
            self._plain_step = _smooth(self._plain_step, step_seconds)
            return
        if self._plain_step is None:
            return
        extra = max(0.0, step_seconds - self._plain_step)
        self._position_seconds = _smooth(self._position_seconds, extra / positions)
        if shared:
            self._credit = max(0.0, self._credit - extra)


def _smooth(previous: float | None, value: float) -> float:
    return value if previous is None else 0.7 * previous + 0.3 * value

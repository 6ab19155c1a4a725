"""Prompt-lookup speculative decoding inside the decode step: which rows draft, and what a row's
verified run of tokens gives it.

Before a decode step, each eligible row proposes up to K draft tokens from its own prompt and
output (drafting.py). The core then appends `[last token, *drafts]` to those rows in one model
call (`MultiTokenDecode.decode_runs`) and hands each row's logits here. Verification walks the
positions in order with the row's own sampler, exactly as one-token decoding would: the token
picked at position j is what plain decoding would have picked after the tokens kept before it
(each kept token is recorded first, so penalties and logit_bias see it), and the draft at j is
kept when it equals that pick. The first mismatch ends the run with the picked token, so a step
gains the kept drafts plus one token of the model's own.

For a sampled row that is the standard rejection rule for a deterministic draft, realised with
one coupled draw: the token is drawn from the sampler's distribution p with the sampler's
own draw, and the draft is kept when the draw lands on it (probability p(draft)); otherwise the
token drawn is distributed as p with the draft removed and renormalized. So the output keeps
p's distribution, and since each position takes exactly the one random draw plain decoding
takes, a seeded request gives the same tokens with speculation on or off (to the extent the
verified logits equal one-token decode's), whatever its batch: a request's tokens do not
depend on whether the size of its batch let it speculate.

Every gained token goes through `RequestOutput.add_token`, so EOS, stop strings,
max_new_tokens, the context length and log-probabilities (from the raw logits of the verified
position) keep their meaning; the run stops at the first token that ends the request, and the
positions appended past the tokens kept are rolled back.

When not to draft:
- a request with a response format (the constraint is not checked against drafts);
- a decode step with more than `max_batch` rows: there a step is compute-bound on a CPU and a
  verification costs more than it can gain (BENCHMARKS.md, section 12);
- a request whose drafts keep failing: once its last `ADAPTIVE_WINDOW` verifications accepted
  less than `MIN_ACCEPTANCE` of what they drafted, it stops drafting for its next `PAUSE_STEPS`
  decode steps that could speculate; its first verification after that is judged alone, and if
  it fails too the pause doubles (up to `MAX_PAUSE_STEPS`), while one that passes ends the streak.
  At batch 1 a K = 4 verification costs about 2 decode steps on this CPU, so a step must keep
  one draft in four just to break even; the bar is half, so a request keeps drafting only while
  it wins by a margin, and free chat, whose drafts match a token now and then, costs a
  verification every few hundred steps instead of every few.

Drafts come from a match of at least 2 trailing tokens (`MIN_NGRAM`): a single repeated token is
weak evidence of what follows (a common word, a bracket), and such drafts are mostly rejected.

Used from the engine thread only; the per-request drafting history lives here, keyed by the
request's engine key, and is dropped when the request ends.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from tokenwire.server.engine.drafting import LookupSettings, propose_drafts
from tokenwire.server.engine.output import RequestOutput
from tokenwire.server.engine.types import FinishReason, TokenLogprobs, TokensGenerated
from tokenwire.server.models.runner import KvRowAccess, ModelRunner, MultiTokenDecode

ADAPTIVE_WINDOW = 4
"""Verification steps of a request that the adaptive rule looks back over."""
MIN_ACCEPTANCE = 0.5
"""Below this share of drafted tokens accepted over the window, a request pauses drafting (a
quarter is where a verification only breaks even here)."""
PAUSE_STEPS = 16
"""Decode steps a request goes without drafting after its drafts kept failing."""
MAX_PAUSE_STEPS = 512
"""The longest pause, after failing again and again."""
MIN_NGRAM = 2
"""The fewest trailing tokens a draft's match must cover."""

Describe = Callable[[np.ndarray, int], TokenLogprobs]
"""The log-probabilities of a token, from the raw logits of the position that chose it."""


@dataclass(frozen=True)
class SpeculationSettings:
    tokens: int
    """K: the most draft tokens a row verifies in one step; 0 is off."""
    max_batch: int
    """The most rows a decode step may have for it to speculate."""


@dataclass
class _DraftHistory:
    """One request's recent verifications, for the adaptive rule."""

    recent: deque[tuple[int, int]] = field(default_factory=lambda: deque(maxlen=ADAPTIVE_WINDOW))
    """(drafted, accepted) of its latest verification steps."""
    paused_for: int = 0
    """Decode steps left before it drafts again."""
    failures: int = 0
    """Pauses in a row: each one after the first doubles."""


@dataclass(frozen=True)
class VerifiedRun:
    """What one row's verification gave it."""

    event: TokensGenerated
    """The tokens gained, in order, with their text and log-probabilities: one stream event."""
    finish: FinishReason | None
    """Set when a gained token ended the request (it is the last one gained)."""
    accepted: int
    """Drafts kept."""
    rollback: int
    """Positions appended by the run past those the kept tokens account for."""

    @property
    def gained(self) -> int:
        return len(self.event.token_ids)


class Speculator:
    """Chooses each decode step's drafts and keeps the adaptive rule's history."""

    def __init__(self, settings: SpeculationSettings) -> None:
        self._settings = settings
        self._lookup = LookupSettings(max_tokens=max(1, settings.tokens), min_ngram=MIN_NGRAM)
        self._history: dict[int, _DraftHistory] = {}

    @property
    def enabled(self) -> bool:
        return self._settings.tokens > 0

    def drafts(self, keys: Sequence[int], outputs: Sequence[RequestOutput]) -> list[list[int]] | None:
        """Each row's drafts ([] for a row that does not speculate); None when no row drafts."""
        if not self.enabled or len(keys) > self._settings.max_batch:
            return None
        drafts = [self._draft(key, output) for key, output in zip(keys, outputs, strict=True)]
        return drafts if any(drafts) else None

    def _draft(self, key: int, output: RequestOutput) -> list[int]:
        if output.constraint is not None:
            return []
        history = self._history.setdefault(key, _DraftHistory())
        if history.paused_for > 0:
            history.paused_for -= 1
            return []
        room = self._room(output)
        if room <= 0:
            return []
        return propose_drafts(output.request.prompt_ids, output.output_ids, self._lookup)[:room]

    def _room(self, output: RequestOutput) -> int:
        """Drafts the row may verify: a step gains at most drafts + 1 tokens, which must not pass
        max_new_tokens or the context (the KV cache holds the context, so this also keeps the
        run inside the row's KV room)."""
        produced = len(output.output_ids)
        left = min(
            output.request.stopping.max_new_tokens - produced,
            output.context_length - len(output.request.prompt_ids) - produced,
        )
        return min(self._settings.tokens, left - 1)

    def record(self, key: int, *, drafted: int, accepted: int) -> None:
        """Take a row's verification into its history; pause its drafting if they keep failing."""
        history = self._history.setdefault(key, _DraftHistory())
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

    def forget(self, key: int) -> None:
        self._history.pop(key, None)


def startup_note(runner: ModelRunner, settings: SpeculationSettings, slots: int) -> str:
    """The start-up log line: whether speculation runs and what its KV room costs."""
    if settings.tokens == 0:
        return "speculative decoding: off (--speculative-tokens 0)"
    if not isinstance(runner, MultiTokenDecode) or not runner.can_decode_runs:
        return (
            f"speculative decoding: off for {runner.info.name}: its graph cannot append several "
            "tokens to a decoding sequence"
        )
    per_token = runner.kv_bytes_per_token() if isinstance(runner, KvRowAccess) else 0
    room = settings.tokens * per_token
    cost = f"{room / 2**10:.1f} KiB a sequence, {room * slots / 2**20:.2f} MiB for {slots} slots"
    # Drafts never run past the context length, so a preallocated cache (sized for the context)
    # already holds the K positions past a row's length; a cache that grows per step holds them
    # only while the verification call runs.
    where = (
        "inside the cache preallocated for the context length: nothing extra is allocated"
        if runner.info.kv_cache_bytes
        else "held only during a verification call, the cache growing per step"
    )
    return (
        f"speculative decoding: up to {settings.tokens} draft tokens a sequence, in decode steps of at "
        f"most {settings.max_batch} sequences; KV room for the drafts: {settings.tokens} positions "
        f"past each sequence's length ({cost}), {where}"
    )


def verify_run(
    output: RequestOutput,
    logits: np.ndarray,
    drafts: Sequence[int],
    now: float,
    describe: Describe | None,
) -> VerifiedRun:
    """Walk a row's verified positions (`logits`: [len(drafts) + 1, vocab], the caller's to
    modify) with its sampler, recording each gained token in `output`; stop at the first
    mismatch or at the token that ends the request."""
    sampler = output.sampler
    tokens: list[int] = []
    text: list[str] = []
    items: list[TokenLogprobs] = []
    finish: FinishReason | None = None
    accepted = 0
    for position in range(len(drafts) + 1):
        row = logits[position]
        raw = row.copy() if describe is not None else None
        token = sampler.pick(row)  # adjusts the row in place; `raw` keeps the model's own
        step = output.add_token(token, now, describe(raw, token) if raw is not None and describe else None)
        tokens.append(token)
        text.append(step.event.text)
        items.extend(step.event.logprobs)
        kept = position < len(drafts) and token == drafts[position]
        accepted += kept
        if step.finish is not None:
            finish = step.finish
            break
        if not kept:
            break
    return VerifiedRun(
        event=TokensGenerated(tuple(tokens), "".join(text), tuple(items)),
        finish=finish,
        accepted=accepted,
        rollback=len(drafts) + 1 - len(tokens),
    )

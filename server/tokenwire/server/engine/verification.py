"""Speculative drafts in the decode step: proposing them, and what a row's verified run gives it.

The plan says how many drafts each row may verify (speculation.py, the scheduler's rule). For
such a row the engine core proposes up to that many from the row's own prompt and output
(drafting.py), appends `[last token, *drafts]` to it in one model call
(`MultiTokenDecode.decode_runs`) and hands the row's logits to `verify_run`. Verification walks
the positions in order with the row's own sampler, exactly as one-token decoding would: the
token picked at position j is what plain decoding would have picked after the tokens kept
before it (each kept token is recorded first, so penalties and logit_bias see it), and the draft
at j is kept when it equals that pick. The first mismatch ends the run with the picked token, so
a step gains the kept drafts plus one token of the model's own.

For a sampled row that is the standard rejection rule for a deterministic draft, realised with
one coupled draw: the token is drawn from the sampler's distribution p with the sampler's own
draw, and the draft is kept when the draw lands on it (probability p(draft)); otherwise the
token drawn is distributed as p with the draft removed and renormalized. So the output keeps
p's distribution, and since each position takes exactly the one random draw plain decoding
takes, a seeded request gives the same tokens with speculation on or off (to the extent the
verified logits equal one-token decode's), whatever its batch.

Every gained token goes through `RequestOutput.add_token`, so EOS, stop strings,
max_new_tokens, the context length and log-probabilities (from the raw logits of the verified
position) keep their meaning; the run stops at the first token that ends the request, and the
positions appended past the tokens kept are rolled back.

Used from the engine thread only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from tokenwire.server.engine.drafting import LookupSettings, propose_drafts
from tokenwire.server.engine.output import RequestOutput
from tokenwire.server.engine.speculation import MIN_NGRAM, SpeculationSettings
from tokenwire.server.engine.types import FinishReason, TokenLogprobs, TokensGenerated
from tokenwire.server.models.runner import KvRowAccess, ModelRunner, MultiTokenDecode

Describe = Callable[[np.ndarray, int], TokenLogprobs]
"""The log-probabilities of a token, from the raw logits of the position that chose it."""


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


class DraftProposer:
    """Drafts for a row from its own prompt and output, at most the plan's count."""

    def __init__(self, settings: SpeculationSettings) -> None:
        self._lookup = LookupSettings(max_tokens=max(1, settings.tokens), min_ngram=MIN_NGRAM)

    def propose(self, output: RequestOutput, limit: int) -> list[int]:
        if limit <= 0:
            return []
        return propose_drafts(output.request.prompt_ids, output.output_ids, self._lookup)[:limit]


def runs_speculation(runner: ModelRunner, settings: SpeculationSettings) -> bool:
    """Whether `settings` can take effect on `runner`: its graph appends runs of tokens."""
    return settings.enabled and isinstance(runner, MultiTokenDecode) and runner.can_decode_runs


def startup_note(runner: ModelRunner, settings: SpeculationSettings, slots: int) -> str:
    """The start-up log line: whether speculation runs and what its KV room costs."""
    if settings.tokens == 0:
        return "speculative decoding: off (--speculative-tokens 0)"
    if not runs_speculation(runner, settings):
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

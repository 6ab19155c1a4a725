"""Pick each sequence's next token from a batch of logits.

Rows with a response format are masked first, all together, so only tokens that keep their
output inside the format can be chosen; a batch without one pays nothing for it. Greedy rows are
resolved together with one argmax over the batch. Sampled rows are handled
one by one, each with its own random generator seeded from its request, so a sequence's tokens
never depend on which other sequences share its batch. Top-k and top-p work on a partial sort
(argpartition) of the few most likely candidates instead of sorting the whole vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from tokenwire.server.sampling.constraint import MaskWorkspace, TokenConstraint
from tokenwire.server.sampling.params import SamplingParams

# Top-p without top-k first tries the most likely candidates only; the full vocabulary is
# sorted only when they do not reach the requested probability mass.
_TOP_P_CANDIDATES = 256


@dataclass
class SequenceSampler:
    """Per-sequence sampling state: parameters, random generator and token history."""

    params: SamplingParams
    history: list[int] = field(default_factory=list)
    """Prompt and generated tokens, for the repetition penalty."""
    constraint: TokenConstraint | None = None
    """The response format's matcher, when the request has one."""
    _rng: np.random.Generator = field(init=False)
    _seen: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self._rng = np.random.Generator(np.random.PCG64(self.params.seed))
        self._seen = np.unique(np.asarray(self.history, dtype=np.int64))

    def observe(self, token_id: int) -> None:
        """Record a generated token: for the repetition penalty and the response format."""
        if self.constraint is not None:
            self.constraint.advance(token_id)
        if self.params.needs_history and not np.isin(token_id, self._seen):
            self._seen = np.union1d(self._seen, [token_id])

    def pick(self, logits: np.ndarray) -> int:
        """Choose a token from one row of logits ([vocab]); the row may be modified."""
        params = self.params
        if params.needs_history and self._seen.size:
            _apply_repetition_penalty(logits, self._seen, params.repetition_penalty)
        if params.is_greedy:
            return int(np.argmax(logits))
        return _sample(logits, params, self._rng)


def pick_tokens(
    logits: np.ndarray, samplers: Sequence[SequenceSampler], masks: MaskWorkspace | None = None
) -> list[int]:
    """Choose one token per row of `logits` ([n, vocab]) with each row's own sampler.

    `masks` is needed when any sampler has a constraint."""
    constrained = [i for i, s in enumerate(samplers) if s.constraint is not None]
    if constrained:
        if masks is None:
            raise ValueError("a constrained row needs a MaskWorkspace")
        masks.apply(logits, constrained, [c for s in samplers if (c := s.constraint) is not None])
    plain_greedy = [i for i, s in enumerate(samplers) if s.params.is_greedy and not s.params.needs_history]
    tokens = [0] * len(samplers)
    if plain_greedy:
        # Indexing with a list copies the rows; when every row is plain greedy there is no need.
        chosen = logits if len(plain_greedy) == len(samplers) else logits[plain_greedy]
        best = np.argmax(chosen, axis=-1)
        for row, token in zip(plain_greedy, best.tolist(), strict=True):
            tokens[row] = int(token)
    if len(plain_greedy) < len(samplers):
        done = set(plain_greedy)
        for row, sampler in enumerate(samplers):
            if row not in done:
                tokens[row] = sampler.pick(logits[row])
    return tokens


def _apply_repetition_penalty(logits: np.ndarray, seen: np.ndarray, penalty: float) -> None:
    values = logits[seen]
    # A token masked out by a response format sits at the lowest float; multiplying it may round
    # to -inf, which is what it means anyway.
    with np.errstate(over="ignore"):
        logits[seen] = np.where(values > 0, values / penalty, values * penalty)


def _sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    scaled = logits.astype(np.float64) / params.temperature
    vocab = scaled.shape[0]
    if 0 < params.top_k < vocab:
        candidates = np.argpartition(scaled, vocab - params.top_k)[vocab - params.top_k :]
    elif params.top_p < 1.0 and vocab > _TOP_P_CANDIDATES:
        candidates = np.argpartition(scaled, vocab - _TOP_P_CANDIDATES)[vocab - _TOP_P_CANDIDATES :]
        # Do the candidates carry enough mass? Compare against the whole vocabulary's normaliser.
        peak = scaled.max()
        total = np.exp(scaled - peak).sum()
        mass = np.exp(scaled[candidates] - peak).sum() / total
        if mass < params.top_p:
            candidates = np.arange(vocab)
    else:
        candidates = np.arange(vocab)
    # Most likely first; ties broken by token id so the order is reproducible.
    order = np.lexsort((candidates, -scaled[candidates]))
    candidates = candidates[order]
    chosen_logits = scaled[candidates]
    probs = np.exp(chosen_logits - chosen_logits[0])
    probs /= probs.sum()
    keep = len(candidates)
    if params.top_p < 1.0:
        cumulative = np.cumsum(probs)
        # The smallest prefix whose mass reaches top_p (always at least one token).
        keep = min(keep, int(np.searchsorted(cumulative, params.top_p, side="left")) + 1)
    if params.min_p > 0.0:
        keep = min(keep, max(1, int(np.count_nonzero(probs >= params.min_p * probs[0]))))
    probs = probs[:keep]
    cumulative = np.cumsum(probs)
    draw = rng.random() * cumulative[-1]
    index = min(int(np.searchsorted(cumulative, draw, side="right")), keep - 1)
    return int(candidates[index])

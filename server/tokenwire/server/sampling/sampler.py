"""Pick each sequence's next token from a batch of logits. Used by the engine thread only.

Each row goes through these steps, in this order:

1. the response format's mask (rows with a format, all together): a disallowed token's logit
   drops to the lowest float, so nothing after this step can bring it back;
2. logit_bias, added to the model's logits;
3. presence and frequency penalties, subtracted from the logits of the tokens this sequence has
   generated (never its prompt): presence once per token, frequency once per time it came out.
   Steps 2 and 3 are OpenAI's: additive changes to the model's logits before anything else;
4. repetition penalty (prompt and output tokens), on the logits steps 2 and 3 left;
5. greedy argmax, or temperature, then top-k, top-p and min-p, then a seeded draw.

Log-probabilities are not computed here: the engine keeps a copy of the model's own logits for
rows that report them, so they describe the model's distribution, not these transforms.

Greedy rows without any of steps 2-4 are resolved together with one argmax over the batch.
The other rows are handled one by one, each with its own random generator seeded from its
request, so a sequence's tokens never depend on which other sequences share its batch. Top-k and
top-p work on a partial sort (argpartition) of the few most likely candidates instead of sorting
the whole vocabulary.
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


class OutputCounts:
    """How many times each token has been generated, kept as arrays the penalties index with."""

    def __init__(self) -> None:
        self._slots: dict[int, int] = {}
        self._ids = np.empty(16, dtype=np.int64)
        self._counts = np.empty(16, dtype=np.float32)

    def add(self, token_id: int) -> None:
        slot = self._slots.get(token_id)
        if slot is not None:
            self._counts[slot] += 1
            return
        slot = len(self._slots)
        if slot == self._ids.shape[0]:
            self._ids = np.concatenate([self._ids, np.empty_like(self._ids)])
            self._counts = np.concatenate([self._counts, np.empty_like(self._counts)])
        self._slots[token_id] = slot
        self._ids[slot] = token_id
        self._counts[slot] = 1

    @property
    def ids(self) -> np.ndarray:
        """The distinct tokens generated so far, in order of first appearance."""
        return self._ids[: len(self._slots)]

    @property
    def counts(self) -> np.ndarray:
        """How often each of `ids` was generated (float32, ready for the logits' arithmetic)."""
        return self._counts[: len(self._slots)]


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
    _generated: OutputCounts = field(init=False)
    _bias_ids: np.ndarray = field(init=False)
    _bias_values: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self._rng = np.random.Generator(np.random.PCG64(self.params.seed))
        self._seen = np.unique(np.asarray(self.history, dtype=np.int64))
        self._generated = OutputCounts()
        self._bias_ids = np.asarray([t for t, _ in self.params.logit_bias], dtype=np.int64)
        self._bias_values = np.asarray([b for _, b in self.params.logit_bias], dtype=np.float32)

    @property
    def is_plain_greedy(self) -> bool:
        """Greedy with nothing to change the logits first: its token is the row's argmax."""
        return self.params.is_greedy and not self.params.changes_logits

    def observe(self, token_id: int) -> None:
        """Record a generated token: for the penalties and the response format."""
        if self.constraint is not None:
            self.constraint.advance(token_id)
        if self.params.counts_output:
            self._generated.add(token_id)
        if self.params.needs_history and not np.isin(token_id, self._seen):
            self._seen = np.union1d(self._seen, [token_id])

    def pick(self, logits: np.ndarray) -> int:
        """Choose a token from one row of logits ([vocab]); the row may be modified."""
        self.adjust(logits)
        if self.params.is_greedy:
            return int(np.argmax(logits))
        return _sample(logits, self.params, self._rng)

    def adjust(self, logits: np.ndarray) -> None:
        """Apply logit_bias, the presence and frequency penalties and the repetition penalty to one
        row of logits ([vocab]), in place and in that order."""
        params = self.params
        if self._bias_ids.size:
            logits[self._bias_ids] += self._bias_values
        if params.counts_output and self._generated.ids.size:
            penalty = self._generated.counts * np.float32(params.frequency_penalty) + np.float32(
                params.presence_penalty
            )
            logits[self._generated.ids] -= penalty
        if params.needs_history and self._seen.size:
            _apply_repetition_penalty(logits, self._seen, params.repetition_penalty)


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
    plain_greedy = [i for i, s in enumerate(samplers) if s.is_plain_greedy]
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


def sampling_distribution(logits: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """The tokens a sampled row can draw and their weights, after temperature, top-k, top-p and
    min-p: (token ids most likely first, weights not yet normalized). One code path for drawing
    a token and for checking what a speculative verification draws from."""
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
    return candidates[:keep], probs[:keep]


def _sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    candidates, probs = sampling_distribution(logits, params)
    cumulative = np.cumsum(probs)
    draw = rng.random() * cumulative[-1]
    index = min(int(np.searchsorted(cumulative, draw, side="right")), len(candidates) - 1)
    return int(candidates[index])

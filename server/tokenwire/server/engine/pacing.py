"""How much prompt work a scheduling round may do while streams are decoding (stall-free batching).

A prompt cannot share a model call with decode rows here, so every prompt chunk run between two
decode steps adds its whole time to the gap between those streams' tokens. Following
Sarathi-Serve (Agrawal et al., OSDI 2024), the prompt work of a round is bounded by a budget:
the round (its prompt chunks plus one decode step) should take no longer than a step-time
target, so a long prompt is processed over several rounds while running streams keep getting a
token every round. The same holds a request waiting for a slot to one target's time before the
next round, where it may get one (preemption takes one back for it). With nothing decoding and
nothing waiting there is nobody to stall and prompts run at full speed.

The budget is in tokens, from costs measured as the server runs: the time per prompt token and
the time of one decode step, each a moving average of recent model calls. The target is either
fixed (`max_step_seconds`) or, by default, a multiple of the measured decode step, which holds
the gap a prompt can cause to that multiple of a plain step whatever the model and machine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

AUTO_STEP_FACTOR = 2.0
"""With no fixed target, a round may take this many decode steps' time (prompt work included)."""
MIN_PACED_CHUNK = 16
"""Prompt tokens a round processes at least, so a prompt always progresses, however slow the step."""
_SMOOTHING = 0.3
MIN_CHUNK = 2
"""Fewest tokens of a prompt one model call runs (all of a shorter prompt): a single token takes
another kernel path in ONNX Runtime's matrix products, and its KV rows differ in the last bits
from the same token in a longer chunk. Chunks of two or more keep a prompt's cache identical
however it was split, and so a prefix cache's copies exact."""


@dataclass(frozen=True)
class RoundBudget:
    """What a round may spend on prompts: tokens (None: no bound) against a step-time target."""

    tokens: int | None
    target_seconds: float | None


class PrefillPacer:
    """Learns prompt and decode costs from the model calls the engine runs; sizes each round's prompt work."""

    def __init__(self, *, max_step_seconds: float | None = None, min_chunk: int = MIN_PACED_CHUNK) -> None:
        if max_step_seconds is not None and max_step_seconds <= 0:
            raise ValueError("max_step_seconds must be positive (or None for the automatic target)")
        self._max_step = max_step_seconds
        self._min_chunk = min_chunk
        self._token_seconds: float | None = None
        self._decode_seconds: float | None = None

    @property
    def token_seconds(self) -> float | None:
        """Measured time per prompt token (None until a chunk has run)."""
        return self._token_seconds

    @property
    def decode_seconds(self) -> float | None:
        """Measured time of one decode step (None until a step has run)."""
        return self._decode_seconds

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens > 0:
            self._token_seconds = _smooth(self._token_seconds, seconds / tokens)

    def observe_decode(self, seconds: float) -> None:
        self._decode_seconds = _smooth(self._decode_seconds, seconds)

    def budget(self, *, decoding: bool) -> RoundBudget:
        """The prompt tokens this round may process before its decode step."""
        if not decoding:
            return RoundBudget(tokens=None, target_seconds=None)
        decode = self._decode_seconds
        target = self._max_step
        if target is None:
            if decode is None:
                return RoundBudget(tokens=self._min_chunk, target_seconds=None)
            target = AUTO_STEP_FACTOR * decode
        per_token = self._token_seconds
        if per_token is None:
            # Nothing measured yet: the smallest chunk, whose time teaches the cost.
            return RoundBudget(tokens=self._min_chunk, target_seconds=target)
        if per_token <= 0:
            return RoundBudget(tokens=None, target_seconds=target)  # prompts cost nothing measurable
        spare = target - (decode or 0.0)
        tokens = math.floor(spare / per_token + 1e-9) if spare > 0 else 0  # 0.03 / 0.001 is 29.99...
        return RoundBudget(tokens=max(self._min_chunk, tokens), target_seconds=target)


def chunk_length(remaining: int, wanted: int) -> int:
    """How many of a prompt's `remaining` tokens to run in one call, given `wanted`.

    Never runs a chunk shorter than MIN_CHUNK of a longer prompt, and never leaves a tail shorter
    than it.
    """
    if remaining <= MIN_CHUNK:
        return remaining
    length = min(remaining, max(MIN_CHUNK, wanted))
    if 0 < remaining - length < MIN_CHUNK:
        length = remaining  # the short tail goes along
    return length


def _smooth(previous: float | None, value: float) -> float:
    return value if previous is None else (1 - _SMOOTHING) * previous + _SMOOTHING * value

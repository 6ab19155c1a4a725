"""Sampling parameters and response formats as the engine sees them (validated, defaults applied)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    """0 means greedy: always the most likely token."""
    top_k: int = 0
    """0 disables top-k."""
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs, ids ascending and unique: each bias is added to its token's logit."""
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token the sequence has generated."""
    frequency_penalty: float = 0.0
    """Subtracted from a generated token's logit once per time it was generated."""

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_history(self) -> bool:
        """Whether the sampler needs the prompt's tokens (the repetition penalty counts them)."""
        return self.repetition_penalty != 1.0

    @property
    def counts_output(self) -> bool:
        """Whether the sampler counts generated tokens (presence and frequency penalties)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def changes_logits(self) -> bool:
        """Whether any transform runs before the choice; without one, greedy is a plain argmax."""
        return self.needs_history or self.counts_output or bool(self.logit_bias)


class FormatKind(Enum):
    JSON_SCHEMA = "json_schema"
    REGEX = "regex"
    CHOICE = "choice"
    GRAMMAR = "grammar"


@dataclass(frozen=True)
class ResponseFormat:
    """What the output must match. `source` is the schema, regex or grammar text; a CHOICE keeps
    its strings in `choices`."""

    kind: FormatKind
    source: str = ""
    choices: tuple[str, ...] = ()
    field: str = ""
    """The request field the format came from, which its errors name; empty: response_format."""

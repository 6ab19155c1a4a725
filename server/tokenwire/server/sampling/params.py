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

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_history(self) -> bool:
        return self.repetition_penalty != 1.0


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

"""Embedding work as the engine sees it: plain requests of token ids, their jobs and results.

An embedding is prefill-only work with no sequence behind it: the scheduler plans whole jobs
into a round (plan.RoundPlan.embeddings) within the round's prompt budget, and the core runs them
(embedding_pass.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenwire.server.engine.errors import GenerationError

if TYPE_CHECKING:  # the scheduler plans these and never touches an array
    import numpy as np


@dataclass(frozen=True)
class EmbeddingRequest:
    """A validated embedding request: every input tokenized, none empty, each within the context."""

    request_id: str
    inputs: tuple[tuple[int, ...], ...]

    @property
    def tokens(self) -> int:
        return sum(len(tokens) for tokens in self.inputs)


@dataclass(frozen=True)
class EmbeddingResult:
    vectors: np.ndarray
    """[inputs, embedding size] float32, each row of unit length, in the order of the inputs."""
    prompt_tokens: int


EmbeddingDelivery = Callable[[EmbeddingResult | GenerationError], None]
"""Hands a job its result; called on the engine thread (it must only schedule the hand-over)."""


@dataclass(frozen=True)
class EmbeddingJob:
    key: int
    request: EmbeddingRequest
    deliver: EmbeddingDelivery

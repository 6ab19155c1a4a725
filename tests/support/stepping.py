"""A gate around a real model runner, so tests decide exactly when decode steps run.

The wrapped runner is the real ONNX Runtime runner; the gate only holds each decode call until
the test allows it. That turns "cancel arrives while the sequence is decoding" or "the deadline
passes while the request waits in the queue" into deterministic sequences of events instead of
races against the clock.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from tokenwire.server.models.loader import LoadedModel
from tokenwire.server.models.runner import ModelInfo, ModelRunner


class StepGate:
    """Holds decode steps until the test allows them; open() lets everything through."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._permits = 0
        self._open = False

    def allow(self, steps: int = 1) -> None:
        with self._condition:
            self._permits += steps
            self._condition.notify_all()

    def open(self) -> None:
        with self._condition:
            self._open = True
            self._condition.notify_all()

    def close(self) -> None:
        """Hold every step from now on until allowed."""
        with self._condition:
            self._open = False
            self._permits = 0

    def pass_through(self) -> None:
        with self._condition:
            self._condition.wait_for(lambda: self._open or self._permits > 0)
            if not self._open:
                self._permits -= 1


class GatedRunner:
    """Delegates to a real runner; each decode step first passes the gate."""

    def __init__(self, inner: ModelRunner, gate: StepGate) -> None:
        self._inner = inner
        self._gate = gate

    @property
    def info(self) -> ModelInfo:
        return self._inner.info

    def capacity(self) -> int:
        return self._inner.capacity()

    def prefill(self, seq_id: int, token_ids: Sequence[int], *, start: int) -> np.ndarray:
        return self._inner.prefill(seq_id, token_ids, start=start)

    def decode(self, seq_ids: Sequence[int], token_ids: Sequence[int]) -> np.ndarray:
        self._gate.pass_through()
        return self._inner.decode(seq_ids, token_ids)

    def release(self, seq_id: int) -> None:
        self._inner.release(seq_id)


def gated(gate: StepGate):  # type: ignore[no-untyped-def]
    """A `wrap_model` hook for TokenwireServer that puts `gate` in front of every decode step."""

    def wrap(model: LoadedModel) -> LoadedModel:
        return replace(model, runner=GatedRunner(model.runner, gate))

    return wrap

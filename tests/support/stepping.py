"""A gate around a real model runner, so tests decide exactly when decode steps run.

The wrapped runner is the real ONNX Runtime runner; the gate only holds each decode call until
the test allows it. That turns "cancel arrives while the sequence is decoding" or "the deadline
passes while the request waits in the queue" into deterministic sequences of events instead of
races against the clock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from tests.support.runners import DelegatingRunner
from tokenwire.server.models.loader import LoadedModel
from tokenwire.server.models.runner import ModelRunner


class StepGate:
    """Holds decode steps until the test allows them; open() lets everything through."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._permits = 0
        self._open = False
        self._waiting = 0

    @property
    def waiting(self) -> int:
        """Decode steps held at the gate now: a step held means its round's earlier events are out."""
        with self._condition:
            return self._waiting

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
            self._waiting += 1
            self._condition.wait_for(lambda: self._open or self._permits > 0)
            self._waiting -= 1
            if not self._open:
                self._permits -= 1


class GatedRunner(DelegatingRunner):
    """Delegates to a real runner; each decode step first passes the gate."""

    def __init__(self, inner: ModelRunner, gate: StepGate) -> None:
        super().__init__(inner)
        self._gate = gate

    def decode(
        self, seq_ids: Sequence[int], token_ids: Sequence[int], *, adapters: Sequence[int] | None = None
    ) -> np.ndarray:
        self._gate.pass_through()
        return super().decode(seq_ids, token_ids, adapters=adapters)


def gated(gate: StepGate):  # type: ignore[no-untyped-def]
    """A `wrap_model` hook for TokenwireServer that puts `gate` in front of every decode step."""

    def wrap(model: LoadedModel) -> LoadedModel:
        return replace(model, runner=GatedRunner(model.runner, gate))

    return wrap


class SteadyRunner(DelegatingRunner):
    """Delegates to a real runner; each decode step takes at least `step_seconds`, as a larger
    model's would.

    For tests that measure what happens between a stream's tokens: the tiny model's step takes a
    fraction of a millisecond, faster than the server's event loop writes a chunk, so a stream's
    tokens can pile up and go out coalesced into one chunk (by design: a reader that falls behind
    gets fewer, larger chunks), leaving no gap between chunks to measure.
    """

    def __init__(self, inner: ModelRunner, step_seconds: float) -> None:
        super().__init__(inner)
        self._step_seconds = step_seconds

    def decode(
        self, seq_ids: Sequence[int], token_ids: Sequence[int], *, adapters: Sequence[int] | None = None
    ) -> np.ndarray:
        began = time.monotonic()
        logits = super().decode(seq_ids, token_ids, adapters=adapters)
        left = self._step_seconds - (time.monotonic() - began)
        if left > 0:
            time.sleep(left)
        return logits


def steady(step_seconds: float):  # type: ignore[no-untyped-def]
    """A `wrap_model` hook for TokenwireServer whose decode steps take at least `step_seconds`."""

    def wrap(model: LoadedModel) -> LoadedModel:
        return replace(model, runner=SteadyRunner(model.runner, step_seconds))

    return wrap

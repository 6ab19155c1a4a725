"""Whether the server takes work: loading, serving or draining, mirrored into gRPC health."""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum

from tokenwire.server.engine.errors import ErrorKind, GenerationError


class ServingPhase(Enum):
    LOADING = "loading"
    SERVING = "serving"
    DRAINING = "draining"
    STOPPED = "stopped"


class Lifecycle:
    """The server's phase; listeners (the health service) hear every change."""

    def __init__(self) -> None:
        self._phase = ServingPhase.LOADING
        self._listeners: list[Callable[[ServingPhase], None]] = []

    @property
    def phase(self) -> ServingPhase:
        return self._phase

    def subscribe(self, listener: Callable[[ServingPhase], None]) -> None:
        self._listeners.append(listener)
        listener(self._phase)

    def enter(self, phase: ServingPhase) -> None:
        self._phase = phase
        for listener in self._listeners:
            listener(phase)

    def check_accepting(self) -> None:
        """Raise UNAVAILABLE unless new work is accepted now."""
        if self._phase is ServingPhase.SERVING:
            return
        if self._phase is ServingPhase.LOADING:
            raise GenerationError(
                ErrorKind.UNAVAILABLE, "model is still loading; retry shortly", reason="LOADING"
            )
        raise GenerationError(
            ErrorKind.UNAVAILABLE, "server is shutting down; retry on another instance", reason="DRAINING"
        )

"""Several engine observers behind the engine's one hook: metrics, health watermarks, tests."""

from __future__ import annotations

from collections.abc import Iterable

from tokenwire.server.engine.observer import EngineObserver
from tokenwire.server.engine.types import FinishReason, Outcome, TimingReport


class ObserverFanOut:
    """Calls each observer in turn (on the engine thread; each must be quick and never raise)."""

    def __init__(self, observers: Iterable[EngineObserver]) -> None:
        self._observers = tuple(observers)

    def request_finished(
        self,
        *,
        model: str,
        outcome: Outcome,
        finish_reason: FinishReason | None,
        prompt_tokens: int,
        completion_tokens: int,
        timing: TimingReport,
        caller: str = "anonymous",
        adapter: str = "",
    ) -> None:
        for observer in self._observers:
            observer.request_finished(
                model=model,
                outcome=outcome,
                finish_reason=finish_reason,
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
                timing=timing,
                caller=caller,
                adapter=adapter,
            )

    def decode_step(self, *, model: str, batch_size: int, seconds: float) -> None:
        for observer in self._observers:
            observer.decode_step(model=model, batch_size=batch_size, seconds=seconds)

    def prefill_chunk(self, *, model: str, tokens: int, seconds: float) -> None:
        for observer in self._observers:
            observer.prefill_chunk(model=model, tokens=tokens, seconds=seconds)

    def drafts_verified(self, *, model: str, drafted: int, accepted: int) -> None:
        for observer in self._observers:
            observer.drafts_verified(model=model, drafted=drafted, accepted=accepted)

    def preempted(self, *, model: str, caller: str) -> None:
        for observer in self._observers:
            observer.preempted(model=model, caller=caller)

    def occupancy(
        self, *, model: str, queued: int, running: int, slots: int, kv_positions_used: int, kv_positions: int
    ) -> None:
        for observer in self._observers:
            observer.occupancy(
                model=model,
                queued=queued,
                running=running,
                slots=slots,
                kv_positions_used=kv_positions_used,
                kv_positions=kv_positions,
            )

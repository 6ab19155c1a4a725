"""Hooks through which telemetry watches the engine without the engine knowing about it."""

from __future__ import annotations

from typing import Protocol

from tokenwire.server.engine.types import FinishReason, Outcome, TimingReport


class EngineObserver(Protocol):
    """Called from the engine thread; implementations must be quick and never raise. Each hook
    does nothing unless an implementation overrides it."""

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
        """A request left the engine: ok, cancelled, deadline, stopped, unavailable or error.
        adapter: the LoRA adapter it ran with (empty: the base model)."""
        return None

    def decode_step(self, *, model: str, batch_size: int, seconds: float) -> None:
        """One batched decode step ran."""
        return None

    def prefill_chunk(self, *, model: str, tokens: int, seconds: float) -> None:
        """One prompt chunk was processed."""
        return None

    def drafts_verified(self, *, model: str, drafted: int, accepted: int) -> None:
        """One row of a decode step verified `drafted` speculative draft tokens and kept `accepted`."""
        return None

    def preempted(self, *, model: str, caller: str) -> None:
        """A running generation of `caller` was swapped out of its slot for a request owed it."""
        return None

    def occupancy(
        self, *, model: str, queued: int, running: int, slots: int, kv_positions_used: int, kv_positions: int
    ) -> None:
        """The queue, the batch and the KV cache after a scheduling round.

        `running` of `slots` sequences hold `kv_positions_used` of the `kv_positions` token
        positions the KV cache has room for.
        """
        return None


class NullObserver(EngineObserver):
    """Observes nothing (the protocol's own hooks do nothing); observers that watch only some
    events override just those."""

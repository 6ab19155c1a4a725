"""How loaded this replica is, for load balancers that weigh replicas by load (ORCA reports).

Plain numbers, fed by the engine observer on the engine threads and read on the event loop by
the ORCA edge (api/orca.py), which turns them into load reports:

- utilization: (running + queued) / slots over every model. It passes 1.0 once requests queue,
  so a replica with a backlog weighs less than one that is merely full.
- queued, running and KV-cache use (token positions) as they stood after the last scheduling round.
- qps: requests that left the engines per second, over a sliding window.

A weighted round robin client gives each replica a weight of qps / utilization, so a slow replica
(few completions, long queue) gets fewer new calls than a fast one.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from tokenwire.server.engine.observer import NullObserver
from tokenwire.server.engine.types import FinishReason, Outcome, TimingReport

QPS_WINDOW_SECONDS = 10.0
"""Long enough to smooth out bursts, short enough that a weight follows a change within seconds."""


@dataclass(frozen=True)
class Occupancy:
    queued: int
    running: int
    slots: int
    kv_positions_used: int
    kv_positions: int


@dataclass(frozen=True)
class LoadSnapshot:
    """The replica's load at one moment, summed over its models."""

    utilization: float
    """(running + queued) / slots; above 1.0 when requests wait for a slot."""
    queued: int
    running: int
    kv_cache_utilization: float
    """KV-cache token positions in use / positions the cache has room for, 0.0 to 1.0."""
    qps: float
    """Requests finished per second over the last QPS_WINDOW_SECONDS (or since start, if less)."""


class LoadTracker(NullObserver):
    """Implements EngineObserver's occupancy and request_finished hooks; snapshot() reads them."""

    def __init__(
        self, *, window: float = QPS_WINDOW_SECONDS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._window = window
        self._clock = clock
        self._started = clock()
        self._occupancy: dict[str, Occupancy] = {}
        self._finished: deque[float] = deque()
        self._lock = threading.Lock()
        """Guards _finished: engine threads append, the event loop prunes and counts."""

    def snapshot(self) -> LoadSnapshot:
        occupancies = list(self._occupancy.values())
        slots = sum(o.slots for o in occupancies)
        queued = sum(o.queued for o in occupancies)
        running = sum(o.running for o in occupancies)
        kv_used = sum(o.kv_positions_used for o in occupancies)
        kv_positions = sum(o.kv_positions for o in occupancies)
        now = self._clock()
        with self._lock:
            self._prune(now)
            finished = len(self._finished)
        span = min(self._window, now - self._started)
        return LoadSnapshot(
            utilization=(running + queued) / slots if slots else 0.0,
            queued=queued,
            running=running,
            kv_cache_utilization=kv_used / kv_positions if kv_positions else 0.0,
            qps=finished / span if span > 0 else 0.0,
        )

    # -- EngineObserver (engine threads) ---------------------------------------------------------

    def occupancy(
        self, *, model: str, queued: int, running: int, slots: int, kv_positions_used: int, kv_positions: int
    ) -> None:
        # One assignment per call: the event loop reads whole snapshots, never a half-written one.
        self._occupancy[model] = Occupancy(queued, running, slots, kv_positions_used, kv_positions)

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
        now = self._clock()
        with self._lock:
            self._finished.append(now)
            self._prune(now)

    def _prune(self, now: float) -> None:
        cutoff = now - self._window
        while self._finished and self._finished[0] <= cutoff:
            self._finished.popleft()

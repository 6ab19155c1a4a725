"""LoadTracker: occupancy and completions turned into the numbers load reports carry (manual clock)."""

from __future__ import annotations

import pytest

from tokenwire.server.engine.types import Outcome, TimingReport
from tokenwire.server.load import LoadTracker


class ManualClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def finish(tracker: LoadTracker) -> None:
    tracker.request_finished(
        model="m",
        outcome=Outcome.OK,
        finish_reason=None,
        prompt_tokens=1,
        completion_tokens=1,
        timing=TimingReport(queued=0.0, total=0.1),
    )


def test_an_idle_tracker_reports_no_load() -> None:
    snapshot = LoadTracker(clock=ManualClock()).snapshot()
    assert (snapshot.utilization, snapshot.queued, snapshot.running, snapshot.qps) == (0.0, 0, 0, 0.0)
    assert snapshot.kv_cache_utilization == 0.0


def test_utilization_counts_queued_requests_over_the_slots_of_every_model() -> None:
    tracker = LoadTracker(clock=ManualClock())
    tracker.occupancy(model="a", queued=3, running=4, slots=4, kv_positions_used=300, kv_positions=400)
    tracker.occupancy(model="b", queued=0, running=1, slots=4, kv_positions_used=20, kv_positions=400)
    snapshot = tracker.snapshot()
    assert snapshot.utilization == pytest.approx(8 / 8)
    assert (snapshot.queued, snapshot.running) == (3, 5)
    assert snapshot.kv_cache_utilization == pytest.approx(320 / 800)
    # A later round replaces a model's figures; it does not add to them.
    tracker.occupancy(model="a", queued=8, running=4, slots=4, kv_positions_used=300, kv_positions=400)
    assert tracker.snapshot().utilization == pytest.approx(13 / 8)


def test_qps_counts_completions_over_the_window_only() -> None:
    clock = ManualClock()
    tracker = LoadTracker(window=10.0, clock=clock)
    clock.now += 2.0
    for _ in range(4):
        finish(tracker)
    # Less than a window since start: the rate is over the time that passed.
    assert tracker.snapshot().qps == pytest.approx(4 / 2.0)
    clock.now += 8.0
    finish(tracker)
    assert tracker.snapshot().qps == pytest.approx(5 / 10.0)
    clock.now += 5.0  # the first four are now older than the window
    assert tracker.snapshot().qps == pytest.approx(1 / 10.0)
    clock.now += 10.0
    assert tracker.snapshot().qps == 0.0

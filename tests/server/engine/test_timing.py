"""Timing fields, computed from stage timestamps on one clock."""

from __future__ import annotations

import pytest

from tokenwire.server.engine.output import timing_report


def test_every_duration_is_measured_from_receipt() -> None:
    report = timing_report(
        received=100.0, started=100.5, first_token=100.7, last_token=101.7, finished=101.8, tokens=11
    )
    assert report.queued == pytest.approx(0.5)
    assert report.prefill == pytest.approx(0.2)
    assert report.time_to_first_token == pytest.approx(0.7)
    assert report.total == pytest.approx(1.8)
    # 10 tokens after the first, over the 1.0 s between first and last token.
    assert report.decode_tokens_per_second == pytest.approx(10.0)
    assert report.time_per_output_token == pytest.approx(0.1)


def test_request_that_never_started_has_no_first_token() -> None:
    report = timing_report(
        received=5.0, started=None, first_token=None, last_token=None, finished=7.5, tokens=0
    )
    assert report.queued == pytest.approx(2.5) and report.total == pytest.approx(2.5)
    assert report.time_to_first_token is None and report.prefill is None
    assert report.decode_tokens_per_second == 0.0 and report.time_per_output_token is None


def test_single_token_has_no_decode_rate() -> None:
    report = timing_report(received=0.0, started=0.0, first_token=0.3, last_token=0.3, finished=0.3, tokens=1)
    assert report.decode_tokens_per_second == 0.0
    assert report.time_per_output_token is None

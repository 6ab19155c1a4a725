"""Percentiles and per-level summaries of a benchmark's request records. Pure functions, no I/O."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

Outcome = Literal["ok", "rejected", "failed"]


@dataclass(frozen=True)
class RequestRecord:
    """What one benchmark request did. Client times are seconds from the moment it was sent."""

    index: int
    sent_at: float
    """Seconds from the start of the level to the moment the request was sent."""
    prompt_tokens: int
    """Prompt length the request was built with."""
    max_new_tokens: int
    outcome: Outcome
    error: str | None = None
    latency: float | None = None
    """End to end: send to the last event, as the client saw it."""
    first_token: float | None = None
    """Send to the first chunk that carried a token (streaming only)."""
    token_gaps: tuple[float, ...] = ()
    """Seconds between consecutive token-bearing chunks (streaming only)."""
    output_tokens: int = 0
    server_prompt_tokens: int = 0
    server_queued: float | None = None
    server_first_token: float | None = None
    server_prefill: float | None = None
    server_time_per_output_token: float | None = None
    turn: int = 0
    """The request's turn in its conversation (0 when the workload is not a chat)."""
    cached_prompt_tokens: int = 0
    """Prompt tokens the server took from its prefix cache."""
    server_paced: float | None = None
    """Server time between the start of work and the first token spent waiting on other requests."""


@dataclass(frozen=True)
class Summary:
    """Distribution of one figure over a level's requests (seconds, or whatever the input was)."""

    count: int
    mean: float
    minimum: float
    p50: float
    p90: float
    p99: float
    maximum: float


@dataclass(frozen=True)
class LoadLevel:
    """One point of a sweep: a closed loop of `value` clients, or Poisson arrivals at `value`/s."""

    kind: Literal["concurrency", "rate"]
    value: float

    @property
    def label(self) -> str:
        if self.kind == "concurrency":
            return f"c={self.value:g}"
        return f"{self.value:g} req/s"


@dataclass(frozen=True)
class LevelSummary:
    level: LoadLevel
    wall_seconds: float
    """From the first send to the last response of the level."""
    sent: int
    completed: int
    rejected: int
    """Refused at admission with RESOURCE_EXHAUSTED (queue full)."""
    failed: int
    output_tokens: int
    output_tokens_per_second: float
    requests_per_second: float
    time_to_first_token: Summary | None
    """Client-side, streaming only."""
    server_queued: Summary | None
    server_time_to_first_token: Summary | None
    server_prefill: Summary | None
    inter_token_latency: Summary | None
    """Client-side gaps between token-bearing chunks, pooled over the level's requests."""
    time_per_output_token: Summary | None
    """Per request: (latency - first token) / (tokens - 1), client-side, streaming only."""
    latency: Summary | None
    server_paced: Summary | None = None
    prompt_tokens: int = 0
    """Prompt tokens of the completed requests."""
    cached_prompt_tokens: int = 0
    """Of those, tokens the server took from its prefix cache."""
    server_prefill_seconds: float = 0.0
    """Server prefill time summed over the completed requests."""


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile {q} is outside [0, 100]")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    below = math.floor(position)
    above = min(below + 1, len(ordered) - 1)
    fraction = position - below
    return ordered[below] + (ordered[above] - ordered[below]) * fraction


def summarize(values: Iterable[float | None]) -> Summary | None:
    """Summary of the values that are present; None when there are none."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    return Summary(
        count=len(present),
        mean=sum(present) / len(present),
        minimum=min(present),
        p50=percentile(present, 50),
        p90=percentile(present, 90),
        p99=percentile(present, 99),
        maximum=max(present),
    )


def time_per_output_token(record: RequestRecord) -> float | None:
    if record.latency is None or record.first_token is None or record.output_tokens < 2:
        return None
    return (record.latency - record.first_token) / (record.output_tokens - 1)


def summarize_level(level: LoadLevel, records: Sequence[RequestRecord], wall_seconds: float) -> LevelSummary:
    ok = [r for r in records if r.outcome == "ok"]
    output_tokens = sum(r.output_tokens for r in ok)
    wall = max(wall_seconds, 1e-9)
    return LevelSummary(
        level=level,
        wall_seconds=wall_seconds,
        sent=len(records),
        completed=len(ok),
        rejected=sum(1 for r in records if r.outcome == "rejected"),
        failed=sum(1 for r in records if r.outcome == "failed"),
        output_tokens=output_tokens,
        output_tokens_per_second=output_tokens / wall,
        requests_per_second=len(ok) / wall,
        time_to_first_token=summarize(r.first_token for r in ok),
        server_queued=summarize(r.server_queued for r in ok),
        server_time_to_first_token=summarize(r.server_first_token for r in ok),
        server_prefill=summarize(r.server_prefill for r in ok),
        inter_token_latency=summarize(gap for r in ok for gap in r.token_gaps),
        time_per_output_token=summarize(time_per_output_token(r) for r in ok),
        latency=summarize(r.latency for r in ok),
        server_paced=summarize(r.server_paced for r in ok),
        prompt_tokens=sum(r.prompt_tokens for r in ok),
        cached_prompt_tokens=sum(r.cached_prompt_tokens for r in ok),
        server_prefill_seconds=sum(r.server_prefill or 0.0 for r in ok),
    )

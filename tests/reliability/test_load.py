"""Overload: nothing is lost, nothing hangs, and the server gives its memory back.

A real server process (so its RSS is its own) gets several hundred requests (unary calls,
single-generation streams and multiplexed streams, some with deadlines) from far more callers than
it has slots and queue places. Every generation must end in exactly one of completed,
RESOURCE_EXHAUSTED with a RetryInfo delay, or DEADLINE_EXCEEDED (for requests that set one).
Each completed generation is then asked again alone through the other method (stream for unary,
unary for stream): the same seed gives the same tokens whatever else was running.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.reliability.server_process import ServerProcess, ServerStats, procfs_available
from tests.reliability.workload import (
    LoadRun,
    Outcome,
    bounded_gather,
    build_mix,
    rerun_through_the_other_api,
    run_load,
)
from tokenwire.client import AsyncClient

pytestmark = pytest.mark.skipif(not procfs_available(), reason="reads RSS and descriptors from /proc (Linux)")

MAX_BATCH_SIZE = 4
MAX_QUEUE_SIZE = 8
MIB = 1024 * 1024


@dataclass(frozen=True)
class Scale:
    requests: int
    concurrency: int
    rss_drift_limit: int


CI_SCALE = Scale(requests=500, concurrency=40, rss_drift_limit=24 * MIB)
HEAVY_SCALE = Scale(requests=6000, concurrency=64, rss_drift_limit=24 * MIB)


@pytest.fixture
async def server_process(default_model_dir: Path, tmp_path: Path) -> AsyncIterator[ServerProcess]:
    process = await asyncio.to_thread(
        ServerProcess.start,
        default_model_dir,
        tmp_path / "server.log",
        max_batch_size=MAX_BATCH_SIZE,
        max_queue_size=MAX_QUEUE_SIZE,
    )
    try:
        yield process
    finally:
        await asyncio.to_thread(process.close)


async def settled(process: ServerProcess, timeout: float = 30.0) -> ServerStats:
    """The server's counters once nothing is live or queued (fails after `timeout` seconds)."""
    stats = await process.settled_stats(timeout)
    assert stats.live == 0 and stats.queued == 0, f"server still busy {timeout}s after the load: {stats}"
    return stats


def describe(run: LoadRun) -> str:
    return f"{run.requests} requests, generations by outcome {run.by_outcome()}"


async def overload(process: ServerProcess, scale: Scale) -> None:
    assert scale.concurrency > 3 * (MAX_BATCH_SIZE + MAX_QUEUE_SIZE)
    # Warm up first: the first requests grow buffers and caches that then stay for good.
    await run_load(process.target, build_mix(80, seed=1), concurrency=scale.concurrency)
    await settled(process)
    rss_before, fds_before = process.rss_bytes(), process.open_fds()

    run = await run_load(process.target, build_mix(scale.requests, seed=2), concurrency=scale.concurrency)

    stats = await settled(process)
    rss_after, fds_after = process.rss_bytes(), process.open_fds()
    assert run.requests == scale.requests
    assert len(run.outcomes) == sum(len(o.generations) for o in build_mix(scale.requests, seed=2))
    assert not run.problems(), "\n".join(run.problems()[:20])
    assert {o.outcome for o in run.outcomes} <= {Outcome.COMPLETED, Outcome.REJECTED, Outcome.DEADLINE}
    # The mix really overloaded the server and really completed work.
    assert run.count(Outcome.REJECTED) > 0, describe(run)
    assert run.count(Outcome.COMPLETED) > 0, describe(run)
    assert all(
        o.retry_after is not None and o.retry_after > 0 for o in run.outcomes if o.outcome is Outcome.REJECTED
    )
    assert all(o.request.has_deadline for o in run.outcomes if o.outcome is Outcome.DEADLINE)

    completed = [o for o in run.outcomes if o.outcome is Outcome.COMPLETED]
    async with AsyncClient(process.target, retries=False) as client:
        alone = await bounded_gather(
            MAX_BATCH_SIZE, [functools.partial(rerun_through_the_other_api, client, o) for o in completed]
        )
    mismatched = [
        o.spec.request_id for o, tokens in zip(completed, alone, strict=True) if tokens != o.token_ids
    ]
    assert not mismatched, f"tokens differ between stream and unary for {mismatched[:10]}"

    assert stats.phase == "serving"
    assert stats.orphaned_steps == 0
    assert stats.max_abort_latency_steps <= 1
    assert stats.rejected >= run.count(Outcome.REJECTED)
    assert fds_after <= fds_before + 2, f"open descriptors {fds_before} -> {fds_after}"
    drift = rss_after - rss_before
    assert drift < scale.rss_drift_limit, f"RSS grew by {drift / MIB:.1f} MiB ({describe(run)})"
    assert process.alive()


async def test_overload_ends_every_generation_in_one_documented_outcome(
    server_process: ServerProcess,
) -> None:
    await overload(server_process, CI_SCALE)


@pytest.mark.heavy
@pytest.mark.timeout(1200)
async def test_heavy_overload_ends_every_generation_in_one_documented_outcome(
    server_process: ServerProcess,
) -> None:
    await overload(server_process, HEAVY_SCALE)

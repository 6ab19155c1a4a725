"""The soak's CI variant: the load mix (with cancellations) for a short while per model layout.

The full soak is `python -m tests.reliability.soak` (10 minutes by default); see
docs/reliability.md for its last figures.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.reliability.server_process import procfs_available
from tests.reliability.soak import run_soak
from tests.reliability.workload import Outcome

pytestmark = pytest.mark.skipif(not procfs_available(), reason="reads RSS and descriptors from /proc (Linux)")

CI_SECONDS = 20.0
HEAVY_SECONDS = 300.0


async def soak(model_dir: Path, tmp_path: Path, layout: str, seconds: float) -> None:
    report = await run_soak(model_dir, tmp_path, layout=layout, duration=seconds, sample_every=seconds / 4)
    print(report.render())
    assert not report.failures(), report.render()
    assert report.hung == 0
    assert report.engine["orphaned_steps"] == 0
    # The prefix cache filled and evicted under the load, so the drift above was measured past it.
    assert int(report.engine["prefix_cache_evicted_blocks"]) > 0, report.render()
    assert report.generations_by_outcome[Outcome.CANCELLED.value] > 0, report.render()
    assert report.generations_by_outcome[Outcome.REJECTED.value] > 0, report.render()
    assert len(report.samples) >= 3


async def test_short_soak_keeps_every_guarantee(
    default_model_dir: Path, model_layout: str, tmp_path: Path
) -> None:
    await soak(default_model_dir, tmp_path, model_layout, CI_SECONDS)


@pytest.mark.heavy
@pytest.mark.timeout(1200)
async def test_heavy_soak_keeps_every_guarantee(
    default_model_dir: Path, model_layout: str, tmp_path: Path
) -> None:
    await soak(default_model_dir, tmp_path, model_layout, HEAVY_SECONDS)

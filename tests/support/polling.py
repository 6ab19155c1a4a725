"""Waiting for state the server exposes only by inspection (engine counters)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def wait_until(
    condition: Callable[[], bool], *, timeout: float = 10.0, what: str = "condition"
) -> None:
    """Return as soon as `condition()` holds; fail the test if it does not within `timeout` seconds.

    Used only where the state cannot be awaited directly, e.g. "the engine has received the
    abort", which happens inside the server when gRPC tells it the call was cancelled.
    """
    interval = 0.002
    for _ in range(int(timeout / interval)):
        if condition():
            return
        await asyncio.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")

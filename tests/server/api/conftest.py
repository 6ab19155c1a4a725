"""Fixtures of the API tests that hold the engine at its decode steps."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.conftest import ServerFactory
from tests.support.stepping import StepGate, gated
from tokenwire.server.app import TokenwireServer


@pytest.fixture
def gate() -> StepGate:
    """Holds the engine thread at each decode step until the test lets steps through."""
    return StepGate()


@pytest.fixture
async def gated_server(start_server: ServerFactory, gate: StepGate) -> AsyncIterator[TokenwireServer]:
    """A server whose decode steps wait on `gate` (opened at the end, so nothing stays held)."""
    server = await start_server(wrap_model=gated(gate))
    yield server
    gate.open()

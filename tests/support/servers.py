"""A real server on a free port for one test, with the tiny model in one layout.

The `start_server` fixture runs a test once per model layout; operational behaviour (metrics,
auth, TLS, health) does not depend on the layout, so these tests start one server directly.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from tests.support.stepping import StepGate, gated
from tokenwire.server.app import TokenwireServer
from tokenwire.server.config import ServerSettings


@asynccontextmanager
async def serving(
    settings: ServerSettings, *, gate: StepGate | None = None, **options: object
) -> AsyncIterator[TokenwireServer]:
    """Start, load and (on exit) stop a server; `options` go to TokenwireServer.

    With a `gate`, every decode step waits for it; the gate is opened before the server stops,
    so a test that fails with steps held still shuts its server down.
    """
    if gate is not None:
        options["wrap_model"] = gated(gate)
    server = TokenwireServer(settings, **options)  # type: ignore[arg-type]
    try:
        await server.start()
        await server.load()
        yield server
    finally:
        if gate is not None:
            gate.open()
        await server.stop(grace=0)

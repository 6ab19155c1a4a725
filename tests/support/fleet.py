"""Several real servers on different loopback addresses, one model name each, as one fleet.

Each replica serves the same tiny model under its own name (`r1`, `r2`, ...), so a client that
asks for the default model learns from every response which replica served it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path

from tests.conftest import tiny_settings
from tests.support.stepping import StepGate, gated
from tokenwire.server.app import TokenwireServer
from tokenwire.server.config import ModelSource


def replica_name(index: int) -> str:
    return f"r{index + 1}"


def replica_host(index: int) -> str:
    return f"127.0.0.{index + 1}"


def fleet_target(servers: Sequence[TokenwireServer]) -> str:
    """One gRPC target naming every replica's address (gRPC's ipv4: scheme, comma-separated)."""
    return "ipv4:" + ",".join(f"{replica_host(i)}:{s.port}" for i, s in enumerate(servers))


@asynccontextmanager
async def fleet(
    model_dir: Path,
    count: int = 3,
    *,
    prepare: Callable[[int, TokenwireServer], None] | None = None,
    gate: StepGate | None = None,
    **overrides: object,
) -> AsyncIterator[list[TokenwireServer]]:
    """Start and load `count` replicas (stopped on exit); `prepare(index, server)` runs on each
    before it starts. With a `gate`, every replica's decode steps wait for it (opened on exit)."""
    servers: list[TokenwireServer] = []
    try:
        for index in range(count):
            settings = tiny_settings(model_dir, host=replica_host(index), **overrides)
            settings = replace(settings, models=(ModelSource(model_dir, replica_name(index)),))
            server = TokenwireServer(settings, wrap_model=gated(gate) if gate is not None else None)
            servers.append(server)
            if prepare is not None:
                prepare(index, server)
            await server.start()
            await server.load()
        yield servers
    finally:
        if gate is not None:
            gate.open()
        for server in servers:
            await server.stop(grace=0)

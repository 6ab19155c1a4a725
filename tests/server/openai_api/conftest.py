"""A real server with the HTTP API on a free port, and OpenAI's official SDK pointed at it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.conftest import tiny_settings
from tests.support.servers import serving
from tokenwire.server.app import TokenwireServer
from tokenwire.server.config import ServerSettings
from tokenwire.server.openai_api.settings import HttpSettings


def http_settings(model_dir: Path, **overrides: object) -> ServerSettings:
    """The tests' tiny-model server, with the HTTP API on a port of its own choosing."""
    overrides.setdefault("http", HttpSettings(port=0))
    return tiny_settings(model_dir, **overrides)


def base_url(server: TokenwireServer, scheme: str = "http") -> str:
    assert server.http_port is not None
    return f"{scheme}://127.0.0.1:{server.http_port}/v1"


@pytest.fixture
async def http_server(tiny_model_dir: Path) -> AsyncIterator[TokenwireServer]:
    async with serving(http_settings(tiny_model_dir)) as server:
        yield server

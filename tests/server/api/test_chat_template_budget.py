"""A chat template's attacks fail the request that springs them, within the rendering's budget,
on a real server: INVALID_ARGUMENT naming `messages`, no more than a few MiB allocated while the
server answers it (tracemalloc, the server being in this process), and the next conversation is
served as before. A template over budget on an ordinary conversation is refused when its model
loads, naming the file (tests/server/models/test_template_refused_at_load.py)."""

from __future__ import annotations

import tracemalloc
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.conftest import tiny_settings
from tests.support.servers import serving
from tests.support.templates import ATTACKS, TRAPDOOR, with_template
from tokenwire.client import AsyncClient, ChatMessage, GenerateOptions, Stopping, TokenwireError
from tokenwire.server.app import TokenwireServer

PEAK_BYTES = 48 << 20
"""Most the server may allocate answering one attack: its rendering's budget is 4,000,000
characters (16 MiB at most), and the rest of a request's work is small."""


@pytest.fixture(scope="module")
def trapdoor_model(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return with_template(tiny_model_dir, tmp_path_factory.mktemp("templates") / "tiny", TRAPDOOR)


@pytest.fixture
async def server(trapdoor_model: Path) -> AsyncIterator[TokenwireServer]:
    async with serving(tiny_settings(trapdoor_model)) as started:
        yield started


@pytest.mark.parametrize("attack", sorted(ATTACKS))
async def test_an_attack_in_the_template_fails_its_request_within_budget(
    attack: str, server: TokenwireServer
) -> None:
    options = GenerateOptions(stopping=Stopping(max_new_tokens=2))
    async with AsyncClient(f"127.0.0.1:{server.port}", retries=False) as client:
        tracemalloc.start()
        try:
            with pytest.raises(TokenwireError) as raised:
                await client.generate([ChatMessage("user", attack)], options)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        served = await client.generate([ChatMessage("user", "hello")], options)
    error = raised.value
    assert error.code.name == "INVALID_ARGUMENT"
    assert [violation.field for violation in error.field_violations] == ["messages"]
    assert "chat template" in str(error)
    assert peak < PEAK_BYTES, f"{peak / 2**20:.0f} MiB allocated"
    assert served.completion_tokens == 2

"""The prefix cache per tenant, on a real server with a token file: callers reuse only the prompt
prefixes their own requests (or their group's) cached, so no response or counter tells one
caller what another asked."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import tiny_settings
from tests.support.options import greedy
from tests.support.prometheus import scrape
from tests.support.servers import serving
from tokenwire.client import AsyncClient, Generation
from tokenwire.server.config import AuthSettings, TelemetrySettings
from tokenwire.server.security.auth import load_token_callers

BY_MODEL = {"gen_ai_request_model": "tiny"}
CONFIDENTIAL = [(i * 37 + 11) % 400 + 40 for i in range(70)]  # four full 16-token blocks and 6 more
TOKENS = {
    "alice": "alice-Pq7w-secret",
    "bob": "bob-Lm3x-secret",
    "carol": "carol-Vt5k-secret",
    "dave": "dave-Rb9c-secret",
}


@pytest.fixture
def auth(tmp_path: Path) -> AuthSettings:
    path = tmp_path / "tokens"
    path.write_text(
        f"alice {TOKENS['alice']}\nbob {TOKENS['bob']}\n"
        f"carol {TOKENS['carol']} group=support\ndave {TOKENS['dave']} weight=2 group=support\n",
        encoding="utf-8",
    )
    pairs = load_token_callers(path, {})
    return AuthSettings(tokens=tuple(t for t, _ in pairs), callers=tuple(c for _, c in pairs))


async def generate_as(port: int, caller: str, prompt: list[int]) -> Generation:
    async with AsyncClient(f"127.0.0.1:{port}", token=TOKENS[caller], retries=False) as client:
        return await client.generate(prompt, greedy(8))


async def test_a_caller_never_reuses_the_prefix_another_caller_cached(
    tiny_llama_dir: Path, auth: AuthSettings
) -> None:
    telemetry = TelemetrySettings(metrics_port=0, metrics_cache_seconds=0)
    async with serving(tiny_settings(tiny_llama_dir, prefix_cache_mb=0)) as plain:
        uncached = await generate_as(plain.port, "alice", [*CONFIDENTIAL, 7, 8, 9])
    async with serving(tiny_settings(tiny_llama_dir, auth=auth, telemetry=telemetry)) as server:
        assert server.metrics_port
        alice = await generate_as(server.port, "alice", [*CONFIDENTIAL, 4, 5, 6])
        # Bob sends alice's exact prompt: without a cache per tenant, 64 tokens would come back cached.
        probe = await generate_as(server.port, "bob", [*CONFIDENTIAL, 4, 5, 6])
        after_probe = await scrape(server.metrics_port)
        own = await generate_as(server.port, "bob", [*CONFIDENTIAL, 7, 8, 9])
        # Each caller still reuses what it cached itself.
        alice_again = await generate_as(server.port, "alice", [*CONFIDENTIAL, 1, 2, 3])
        mine = await scrape(server.metrics_port)

    assert alice.cached_prompt_tokens == 0
    assert probe.cached_prompt_tokens == 0
    assert probe.timing.prefill is not None and probe.token_ids == alice.token_ids
    assert after_probe.value("tokenwire_engine_prefix_cache_hit_tokens_total", **BY_MODEL) == 0
    # Bob's next request finds the prefix his first one cached: for him, as if alice never asked.
    assert own.cached_prompt_tokens == 64
    assert own.token_ids == uncached.token_ids
    assert alice_again.cached_prompt_tokens == 64
    assert mine.value("tokenwire_engine_prefix_cache_hit_tokens_total", **BY_MODEL) == 64 + 64


async def test_callers_of_one_group_share_a_system_prompt_s_cached_prefix(
    tiny_llama_dir: Path, auth: AuthSettings
) -> None:
    telemetry = TelemetrySettings(metrics_port=0, metrics_cache_seconds=0)
    async with serving(tiny_settings(tiny_llama_dir, auth=auth, telemetry=telemetry)) as server:
        assert server.metrics_port
        carol = await generate_as(server.port, "carol", [*CONFIDENTIAL, 4, 5, 6])
        dave = await generate_as(server.port, "dave", [*CONFIDENTIAL, 7, 8, 9])
        outsider = await generate_as(server.port, "alice", [*CONFIDENTIAL, 7, 8, 9])
        metrics = await scrape(server.metrics_port)

    assert carol.cached_prompt_tokens == 0
    assert dave.cached_prompt_tokens == 64
    assert outsider.cached_prompt_tokens == 0
    assert metrics.value("tokenwire_engine_prefix_cache_hit_tokens_total", **BY_MODEL) == 64

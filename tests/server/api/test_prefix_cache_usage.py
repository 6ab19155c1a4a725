"""Prefix caching seen from a client: usage reports cached prompt tokens, metrics the hits and size."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.conftest import tiny_settings
from tests.support.options import greedy
from tests.support.prometheus import scrape
from tests.support.servers import serving
from tests.support.tiny_models import TinyModel
from tokenwire.client import AsyncClient, Generation
from tokenwire.server.config import TelemetrySettings

BY_MODEL = {"gen_ai_request_model": "tiny"}
SYSTEM = [(i * 37 + 11) % 400 + 40 for i in range(70)]  # four full 16-token blocks and 6 more


async def generate_once(port: int, prompt: list[int]) -> Generation:
    async with AsyncClient(f"127.0.0.1:{port}", retries=False) as client:
        return await client.generate(prompt, greedy(10))


async def test_a_repeated_prefix_is_reported_as_cached_and_changes_no_output(
    each_kv_location: TinyModel,
) -> None:
    telemetry = TelemetrySettings(metrics_port=0, metrics_cache_seconds=0)
    model, kv_cache = each_kv_location.path, each_kv_location.kv_cache
    async with serving(tiny_settings(model, prefix_cache_mb=0, kv_cache=kv_cache)) as plain:
        uncached = await generate_once(plain.port, [*SYSTEM, 7, 8, 9])
    async with serving(tiny_settings(model, telemetry=telemetry, kv_cache=kv_cache)) as server:
        assert server.metrics_port
        async with AsyncClient(f"127.0.0.1:{server.port}", retries=False) as client:
            first = await client.generate([*SYSTEM, 4, 5, 6], greedy(10))
            second = await client.generate([*SYSTEM, 7, 8, 9], greedy(10))
        metrics = await scrape(server.metrics_port)

    assert uncached.cached_prompt_tokens == first.cached_prompt_tokens == 0
    assert second.cached_prompt_tokens == 64
    assert second.prompt_tokens == len(SYSTEM) + 3
    assert second.token_ids == uncached.token_ids
    timing = second.timing
    assert timing.time_to_first_token is not None and timing.prefill is not None and timing.paced is not None
    # The three parts of the time to first token (each a whole number of nanoseconds on the wire).
    parts = timing.queued + timing.paced + timing.prefill
    assert parts == pytest.approx(timing.time_to_first_token, abs=3e-9)
    assert metrics.value("tokenwire_engine_prefix_cache_hit_tokens_total", **BY_MODEL) == 64
    assert metrics.value("tokenwire_engine_prefix_cache_hit_rate", **BY_MODEL) == 64 / (2 * len(SYSTEM) + 6)
    assert metrics.value("tokenwire_engine_prefix_cache_size_bytes", **BY_MODEL) > 0
    assert metrics.value("tokenwire_engine_prefix_cache_capacity_bytes", **BY_MODEL) == 256 * 2**20
    assert metrics.value("tokenwire_server_prefill_paced_duration_seconds_count", **BY_MODEL) == 2


async def test_streams_decoding_while_long_prompts_are_paced_all_finish_in_full(tiny_llama_dir: Path) -> None:
    settings = tiny_settings(tiny_llama_dir, stall_free=True, prefill_chunk_size=64, prefix_cache_mb=0)
    async with (
        serving(settings) as server,
        AsyncClient(f"127.0.0.1:{server.port}", retries=False) as client,
    ):
        running = asyncio.create_task(client.generate([40, 41, 42], greedy(60)))
        prompts = [[(i * 7 + k) % 400 + 40 for i in range(150)] for k in range(3)]
        paced = await asyncio.gather(*(client.generate(p, greedy(10)) for p in prompts))
        first = await running
    assert first.completion_tokens == 60
    for result in paced:
        assert result.completion_tokens == 10 and result.prompt_tokens == 150
        timing = result.timing
        assert timing.paced is not None and timing.prefill is not None
        assert timing.queued + timing.paced + timing.prefill == pytest.approx(
            timing.time_to_first_token, abs=3e-9
        )

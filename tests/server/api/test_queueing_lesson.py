"""The product's central lesson, on a real server with one decode slot.

A second request that has to wait for the first spends about the first request's whole duration
queued, so its time to first token grows by that much, while its inter-token interval (the
decode speed) stays what it was. Slow TTFT with a normal token rate means queueing.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.conftest import ServerFactory
from tokenwire.client import AsyncClient, GenerateOptions, Sampling, Stopping
from tokenwire.server.model_tools.tiny_gpt import TinyGptConfig, create_tiny_gpt


@pytest.fixture(scope="module")
def wider_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Wide enough that a decode step takes measurable time, so intervals are not timer noise.
    config = TinyGptConfig(layers=4, hidden=256, heads=8, vocab=512, context_length=512, seed=3)
    return create_tiny_gpt(tmp_path_factory.mktemp("models") / "wider", config)


async def test_waiting_request_pays_in_ttft_not_in_token_rate(
    start_server: ServerFactory, wider_model_dir: Path
) -> None:
    server = await start_server(model_dir=wider_model_dir, max_batch_size=1)
    # Long enough (about 0.2 s of decoding here) that the first request's own wait, the engine
    # thread waking for it on a busy machine, stays far below a fifth of the second's.
    options = GenerateOptions(
        sampling=Sampling(temperature=0.0), stopping=Stopping(max_new_tokens=400, ignore_eos=True)
    )
    async with AsyncClient(f"127.0.0.1:{server.port}", retries=False) as client:
        await client.generate("warm up", options)
        first, second = await asyncio.gather(
            client.generate("The first request", options), client.generate("The second request", options)
        )
    if first.timing.queued > second.timing.queued:
        first, second = second, first  # whichever reached the slot first
    assert first.timing.time_to_first_token is not None and second.timing.time_to_first_token is not None
    assert first.timing.time_per_output_token is not None and second.timing.time_per_output_token is not None

    # The second waited for (about) all of the first request.
    assert second.timing.queued >= 0.7 * first.timing.total
    assert first.timing.queued < 0.2 * second.timing.queued
    ttft_growth = second.timing.time_to_first_token - first.timing.time_to_first_token
    assert ttft_growth >= 0.7 * first.timing.total
    # ...and it is queueing, not prefill: after the queue, its time to first token is its own
    # prefill and whatever it waited on others once started (paced).
    assert second.timing.paced is not None
    assert second.timing.time_to_first_token - second.timing.queued == pytest.approx(
        second.timing.prefill + second.timing.paced, abs=1e-6
    )
    # Its decoding ran at the same pace (generous bounds: the machine is shared and noisy).
    ratio = second.timing.time_per_output_token / first.timing.time_per_output_token
    assert 1 / 3 < ratio < 3
    # Queueing dwarfs any difference in the token interval.
    assert ttft_growth > 20 * abs(second.timing.time_per_output_token - first.timing.time_per_output_token)

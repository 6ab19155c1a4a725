"""The engine on both model layouts: batch-invariant outputs, slots freed, chunked prefill."""

from __future__ import annotations

import asyncio

import pytest

from tests.support.tiny_models import TinyModel
from tokenwire.server.engine.engine import Engine, EngineConfig
from tokenwire.server.engine.types import (
    Completed,
    EngineEvent,
    GenerationRequest,
    GenerationResult,
    StopConditions,
)
from tokenwire.server.sampling.params import SamplingParams


def request(prompt: list[int], *, seed: int, temperature: float, tokens: int = 24) -> GenerationRequest:
    return GenerationRequest(
        request_id=f"r{seed}",
        model="tiny",
        prompt_ids=tuple(prompt),
        sampling=SamplingParams(temperature=temperature, top_k=40, seed=seed),
        stopping=StopConditions(max_new_tokens=tokens, ignore_eos=True),
        received_at=0.0,
    )


async def run_all(engine: Engine, requests: list[GenerationRequest]) -> list[GenerationResult]:
    loop = asyncio.get_running_loop()
    futures: list[asyncio.Future[GenerationResult]] = []
    for item in requests:
        future: asyncio.Future[GenerationResult] = loop.create_future()

        def sink(event: EngineEvent, future: asyncio.Future[GenerationResult] = future) -> None:
            if isinstance(event, Completed):
                future.set_result(event.result)

        engine.submit(item, sink)
        futures.append(future)
    return list(await asyncio.gather(*futures))


@pytest.mark.parametrize("temperature", [0.0, 0.9])
async def test_a_sequence_gets_the_same_tokens_alone_and_in_a_busy_batch(
    each_runner: TinyModel, temperature: float
) -> None:
    loaded = each_runner.load(max_batch_size=4, max_context_length=256)
    engine = Engine(
        loaded.runner,
        loaded.tokenizer,
        EngineConfig(max_batch_size=4, prefill_chunk_size=16, prefix_cache_mb=0),
    )
    engine.start()
    try:
        target = request(list(range(30, 75)), seed=1, temperature=temperature)
        [alone] = await run_all(engine, [target])
        crowd = [
            request([9, 8, 7][: 1 + i % 3] * (i + 1), seed=10 + i, temperature=0.8, tokens=5 + 7 * i)
            for i in range(6)
        ]
        results = await run_all(engine, [crowd[0], crowd[1], target, *crowd[2:]])
    finally:
        await engine.shutdown()
    in_batch = results[2]
    assert in_batch.token_ids == alone.token_ids
    assert in_batch.text == alone.text
    assert engine.stats.decode_steps > 0 and engine.stats.prefill_chunks >= 3  # 45 tokens in chunks of 16
    assert engine.live_count == 0

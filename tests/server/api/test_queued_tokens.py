"""The queued-token bound on a real server, through the Python client."""

from __future__ import annotations

import asyncio

import grpc

from tests.conftest import ServerFactory
from tests.support.options import greedy
from tests.support.polling import wait_until
from tests.support.stepping import StepGate, gated
from tokenwire.client import AsyncClient, TokenwireError


async def test_a_prompt_over_the_queued_token_bound_is_resource_exhausted_with_retry_info_naming_tokens(
    start_server: ServerFactory,
) -> None:
    gate = StepGate()
    server = await start_server(
        wrap_model=gated(gate), max_batch_size=1, max_queue_size=8, max_queued_tokens=20
    )
    engine = server.registry.default.engine
    async with AsyncClient(f"127.0.0.1:{server.port}", retries=False) as client:
        # The 5-token prompt must hold the slot and the 15-token one wait: the two calls would
        # otherwise race to the server, and 5 waiting tokens leave room for 10 more.
        running = asyncio.create_task(client.generate(list(range(100, 105)), greedy(3)))
        await wait_until(lambda: gate.waiting == 1, what="the first prompt to hold the slot")
        waiting = asyncio.create_task(client.generate(list(range(200, 215)), greedy(3)))
        await wait_until(lambda: engine.live_count == 2, what="one running, one waiting")
        refused: TokenwireError | None = None
        try:
            # 15 + 10 tokens > 20. The deadline turns a wrongly queued call (the step is held)
            # into a failure here instead of a wait for the gate that never opens.
            await client.generate(list(range(300, 310)), greedy(3), deadline=30)
        except TokenwireError as error:
            refused = error
        gate.open()
        assert (await running).completion_tokens == 3
        assert (await waiting).completion_tokens == 3
        # Once nothing waits, the same prompt is served.
        assert (await client.generate(list(range(300, 310)), greedy(3))).completion_tokens == 3
    assert refused is not None
    assert refused.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert refused.reason == "QUEUED_TOKENS_FULL"
    assert refused.retry_after is not None and 0.05 <= refused.retry_after <= 30
    assert refused.retryable


async def test_a_full_queue_refuses_a_caller_before_its_prompt_is_validated(
    start_server: ServerFactory,
) -> None:
    # The refusal a full queue gives does not depend on the prompt, so it comes before the
    # prompt's validation (the tokenizing a flood's refused requests would otherwise cost): a
    # request with a token id outside the vocabulary is refused as RESOURCE_EXHAUSTED while the
    # queue is full, and as INVALID_ARGUMENT once there is room.
    gate = StepGate()
    server = await start_server(wrap_model=gated(gate), max_batch_size=1, max_queue_size=1)
    engine = server.registry.default.engine
    out_of_vocabulary = [100, 10**8]
    async with AsyncClient(f"127.0.0.1:{server.port}", retries=False) as client:
        running = asyncio.create_task(client.generate(list(range(100, 105)), greedy(3)))
        await wait_until(lambda: gate.waiting == 1, what="the first prompt to hold the slot")
        waiting = asyncio.create_task(client.generate(list(range(200, 205)), greedy(3)))
        await wait_until(lambda: engine.live_count == 2, what="one running, one waiting")
        refused: list[TokenwireError] = []
        try:
            await client.generate(out_of_vocabulary, greedy(3), deadline=30)
        except TokenwireError as error:
            refused.append(error)
        gate.open()
        assert (await running).completion_tokens == 3
        assert (await waiting).completion_tokens == 3
        try:
            await client.generate(out_of_vocabulary, greedy(3), deadline=30)
        except TokenwireError as error:
            refused.append(error)
    assert [e.code for e in refused] == [grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT]
    assert refused[0].reason == "QUEUE_FULL"
    assert "token_ids" in str(refused[1])

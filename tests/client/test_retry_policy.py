"""The bundled retry policy makes a RESOURCE_EXHAUSTED request succeed once capacity frees up."""

from __future__ import annotations

import asyncio

from tests.conftest import ServerFactory
from tests.support.polling import wait_until
from tests.support.stepping import StepGate, gated
from tokenwire.client import AsyncClient, GenerateOptions, Sampling, Stopping

OPTIONS = GenerateOptions(
    sampling=Sampling(temperature=0.0), stopping=Stopping(max_new_tokens=4, ignore_eos=True)
)


async def test_rejected_request_is_retried_after_the_pushback_and_succeeds(
    start_server: ServerFactory,
) -> None:
    gate = StepGate()
    server = await start_server(wrap_model=gated(gate), max_batch_size=1, max_queue_size=0)
    engine = server.registry.default.engine
    async with (
        AsyncClient(f"127.0.0.1:{server.port}", retries=False) as plain,
        AsyncClient(f"127.0.0.1:{server.port}") as retrying,
    ):
        occupying = asyncio.create_task(plain.generate("occupy", OPTIONS))
        await wait_until(lambda: engine.live_count == 1, what="the slot to be taken")
        retried = asyncio.create_task(retrying.generate("retried", OPTIONS))
        await wait_until(lambda: engine.stats.finished == 0 and rejected(server) >= 1, what="a rejection")
        gate.open()
        assert (await occupying).completion_tokens == 4
        assert (await retried).completion_tokens == 4


def rejected(server: object) -> int:
    """Rejections seen so far (each one a RESOURCE_EXHAUSTED attempt by the retrying client)."""
    return server.registry.default.engine.stats.rejected  # type: ignore[attr-defined,no-any-return]

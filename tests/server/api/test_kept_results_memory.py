"""Kept idempotent results on a real server stay within --result-retention-mb as measured in
memory, log-probabilities and their alternatives included, and memory is shared per caller: one
caller's flood of results evicts its own, never another's kept within the retention window.

Memory is traced with tracemalloc in this process, which is the server's: what stays allocated
after the requests are done is what the kept results hold. Every request has the same prompt, so
the prefix cache holds one prompt throughout.
"""

from __future__ import annotations

import gc
import tracemalloc
from pathlib import Path

from tests.conftest import tiny_settings
from tests.support.servers import serving
from tokenwire.client import AsyncClient, GenerateOptions, Sampling, Stopping
from tokenwire.server.app import TokenwireServer
from tokenwire.server.config import AuthSettings

MIB = 1 << 20
WITH_ALTERNATIVES = GenerateOptions(
    sampling=Sampling(temperature=0.0),
    stopping=Stopping(48, ignore_eos=True),
    logprobs=True,
    top_logprobs=20,
)
"""About 200 KiB kept per result: 48 positions, each with 20 alternatives."""


def work(server: TokenwireServer) -> int:
    return server.registry.default.engine.stats.finished


async def test_kept_results_with_alternatives_stay_within_the_bound(tiny_model_dir: Path) -> None:
    async with serving(tiny_settings(tiny_model_dir, result_retention_mb=1)) as server:
        async with AsyncClient(f"127.0.0.1:{server.port}", retries=False) as client:
            for _ in range(3):  # warm every path a request takes, so nothing else grows below
                await client.generate("Hello there", WITH_ALTERNATIVES)
            gc.collect()
            tracemalloc.start()
            try:
                before, _ = tracemalloc.get_traced_memory()
                for index in range(40):
                    await client.generate("Hello there", WITH_ALTERNATIVES, idempotency_key=f"job-{index}")
                gc.collect()
                after, _ = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
        kept = server.generations.kept_count
        assert 1 <= kept < 40
        assert server.generations.kept_bytes <= MIB
    assert after - before < 1.5 * MIB, f"{(after - before) / MIB:.1f} MiB held by {kept} kept results"


async def test_one_callers_flood_of_results_evicts_only_its_own(tiny_model_dir: Path) -> None:
    settings = tiny_settings(
        tiny_model_dir, result_retention_mb=1, auth=AuthSettings(tokens=("token-quiet", "token-busy"))
    )
    async with serving(settings) as server:
        target = f"127.0.0.1:{server.port}"
        async with (
            AsyncClient(target, token="token-quiet", retries=False) as quiet,
            AsyncClient(target, token="token-busy", retries=False) as busy,
        ):
            first = await quiet.generate("Hello there", WITH_ALTERNATIVES, idempotency_key="mine")
            for index in range(30):
                await busy.generate("Hello there", WITH_ALTERNATIVES, idempotency_key=f"flood-{index}")
            before = work(server)
            again = await quiet.generate("Hello there", WITH_ALTERNATIVES, idempotency_key="mine")
            assert work(server) == before, "the quiet caller's result was evicted and generated again"
            assert again.timing == first.timing
            await busy.generate("Hello there", WITH_ALTERNATIVES, idempotency_key="flood-0")
            assert work(server) == before + 1, "the busy caller's oldest result should be the one evicted"

"""Fleet mode: one client over three real replicas on 127.0.0.1, 127.0.0.2 and 127.0.0.3.

Each replica serves the tiny model under its own name, so every completed generation names the
replica that served it.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import pytest

from tests.support.fleet import fleet, fleet_target
from tests.support.options import greedy
from tokenwire.client import AsyncClient, Completed, Routing, collect
from tokenwire.server.app import SERVICE_NAME, TokenwireServer
from tokenwire.server.health import NOT_SERVING, SERVING
from tokenwire.server.load import LoadSnapshot

OPTIONS = greedy(2)
ROUND_ROBIN = Routing(policy="round_robin")
MAX_CALLS = 100
WEIGHTS_BOUND = 30.0
"""Seconds of batches to wait for the weights to apply: reports arrive a second apart, so this
is a generous bound on how long a working balancer takes, not a speed being measured."""


async def served_by(client: AsyncClient, count: int) -> Counter[str]:
    """Run `count` streamed generations one after another; count them by serving replica."""
    served: Counter[str] = Counter()
    for _ in range(count):
        served[(await collect(client.stream("Hi", OPTIONS))).model] += 1
    return served


async def served_until(client: AsyncClient, replicas: set[str], *, unary: bool = False) -> Counter[str]:
    """Run generations one after another until each of `replicas` served one, or MAX_CALLS ran.

    Replicas join the rotation as their connections (and first health answers) come in, so a
    fixed handful of calls could all land before the last one is ready on a busy machine.
    """
    served: Counter[str] = Counter()
    for _ in range(MAX_CALLS):
        if unary:
            served[(await client.generate("Hi", OPTIONS)).model] += 1
        else:
            served += await served_by(client, 1)
        if replicas <= set(served):
            break
    return served


async def test_round_robin_spreads_generations_over_every_replica(tiny_model_dir: Path) -> None:
    async with (
        fleet(tiny_model_dir) as servers,
        AsyncClient(fleet_target(servers), routing=ROUND_ROBIN) as client,
    ):
        streamed = await served_until(client, {"r1", "r2", "r3"})
        unary = await served_until(client, {"r1", "r2", "r3"}, unary=True)
        # Once all are in the rotation, round robin gives each its turn.
        rotation = await served_by(client, 9)
    assert set(streamed) == {"r1", "r2", "r3"}, streamed
    assert set(unary) == {"r1", "r2", "r3"}, unary
    assert rotation == Counter({"r1": 3, "r2": 3, "r3": 3}), rotation


async def test_a_long_lived_stream_keeps_every_generation_on_one_replica(tiny_model_dir: Path) -> None:
    async with (
        fleet(tiny_model_dir) as servers,
        AsyncClient(fleet_target(servers), routing=ROUND_ROBIN) as client,
        client.open_stream() as stream,
    ):
        for index in range(6):
            await stream.submit(f"g{index}", "Hi", OPTIONS)
        await stream.close_requests()
        models = {event.generation.model async for event in stream.events() if isinstance(event, Completed)}
    assert len(models) == 1


async def test_a_replica_reporting_not_serving_gets_no_new_calls_until_it_serves_again(
    tiny_model_dir: Path,
) -> None:
    async with fleet(tiny_model_dir) as servers:
        # What a queue above the high watermark reports: NOT_SERVING, while still taking calls.
        await servers[1].health.servicer.set(SERVICE_NAME, NOT_SERVING)
        async with AsyncClient(fleet_target(servers), routing=ROUND_ROBIN) as client:
            while_out = await served_by(client, 12)
            await servers[1].health.servicer.set(SERVICE_NAME, SERVING)
            back = await served_until(client, {"r2"})  # the health watch brings it back
        async with AsyncClient(
            fleet_target(servers), routing=Routing(policy="round_robin", health_checks=False)
        ) as unchecked:
            await servers[1].health.servicer.set(SERVICE_NAME, NOT_SERVING)
            without_checks = await served_until(unchecked, {"r2"})
    assert while_out["r2"] == 0 and sum(while_out.values()) == 12, while_out
    assert back["r2"] >= 1, back
    assert without_checks["r2"] >= 1, without_checks  # the check, not chance, kept it out


def fixed_load(index: int, server: TokenwireServer) -> None:
    """Replica r3 reports 8 times the utilization and a tenth of the request rate of the others.

    The reports are fixed so the test does not depend on how fast this machine runs the model;
    benchmarks/fleet_routing.py measures the same policy against a genuinely slower replica.
    """
    busy = index == 2
    snapshot = LoadSnapshot(
        utilization=4.0 if busy else 0.5,
        queued=6 if busy else 0,
        running=1,
        kv_cache_utilization=0.1,
        qps=1.0 if busy else 10.0,
    )
    server.load_tracker.snapshot = lambda: snapshot  # type: ignore[method-assign]


@pytest.mark.parametrize("load_reports", ["out_of_band", "per_call"])
async def test_weighted_round_robin_sends_few_calls_to_a_replica_reporting_heavy_load(
    tiny_model_dir: Path, load_reports: str
) -> None:
    # Weights are qps / utilization: 20 for r1 and r2, 0.25 for r3, so r3 should get about 1 call
    # in 80 once the weights apply. Until then (connections still opening, reports still
    # arriving, the blackout period) calls go to whichever replicas are ready, round robin;
    # batches run until one shows the weights at work.
    routing = Routing(load_reports=load_reports, blackout_period=0.1, weight_update_period=0.1)  # type: ignore[arg-type]
    batches: list[Counter[str]] = []
    async with (
        fleet(tiny_model_dir, prepare=fixed_load) as servers,
        AsyncClient(fleet_target(servers), routing=routing) as client,
    ):
        give_up = asyncio.get_running_loop().time() + WEIGHTS_BOUND
        while asyncio.get_running_loop().time() < give_up:
            results = await asyncio.gather(*(client.generate("Hi", greedy(1)) for _ in range(30)))
            batches.append(Counter(result.model for result in results))
            if weighed(batches[-1]):
                break
    assert weighed(batches[-1]), batches


def weighed(batch: Counter[str]) -> bool:
    """r3 got a tenth of the batch at most (against a third round robin), the others the rest
    (so all three were connected, not just the first to be ready)."""
    return batch["r3"] <= 3 and batch["r1"] >= 10 and batch["r2"] >= 10

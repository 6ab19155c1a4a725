"""One caller flooding the server at 10x its capacity, and what that does to another caller.

Starts a server with the default model (8 slots, queue 64, 2 threads) and a token file naming two
callers of equal weight, "flood" and "quiet". First, with the server idle, "quiet" sends
requests one after another (100-token prompt, 16 new tokens, greedy) and its time to first token
is recorded. Then "flood" keeps 10x the server's capacity in flight (capacity: the 8 slots, so
80 requests, more than the slots and the queue hold, so it is refused too), sending a new
request as each one ends or is refused (after 20 ms), while "quiet" repeats its sequence. The
server measures every TTFT; the script reports the quiet caller's p50 and p99 in both phases,
the ratio of the p99s (target: at most 2), and how the flood's requests ended.

    python benchmarks/fairness.py [--repetitions 40]

(`--repetitions` is the number of quiet requests per phase.)
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
from collections import Counter
from pathlib import Path

import benchkit

from tokenwire.client import AsyncClient, GenerateOptions, Sampling, Stopping, TokenwireError

SLOTS = 8
QUEUE = 64
FLOOD_FACTOR = 10
FLOOD_TOKEN = "flood-benchmark-token"
QUIET_TOKEN = "quiet-benchmark-token"
OPTIONS = GenerateOptions(
    sampling=Sampling(temperature=0.0), stopping=Stopping(max_new_tokens=16, ignore_eos=True)
)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def quiet_phase(target: str, ids: list[int], count: int) -> list[float]:
    ttfts = []
    async with AsyncClient(target, token=QUIET_TOKEN, retries=False) as client:
        for _ in range(count):
            result = await client.generate(ids, OPTIONS, deadline=120)
            assert result.timing.time_to_first_token is not None
            ttfts.append(result.timing.time_to_first_token * 1000)
    return ttfts


async def flood(target: str, ids: list[int], stop: asyncio.Event, outcomes: Counter[str]) -> None:
    async with AsyncClient(target, token=FLOOD_TOKEN, retries=False) as client:

        async def one_lane() -> None:
            while not stop.is_set():
                try:
                    await client.generate(ids, OPTIONS, deadline=120)
                    outcomes["ok"] += 1
                except TokenwireError as error:
                    outcomes[error.reason or error.code.name] += 1
                    await asyncio.sleep(0.02)  # a refused client backs off a little, then floods on

        lanes = [asyncio.ensure_future(one_lane()) for _ in range(FLOOD_FACTOR * SLOTS)]
        await stop.wait()
        for lane in lanes:
            lane.cancel()
        await asyncio.gather(*lanes, return_exceptions=True)


async def run(target: str, ids: list[int], count: int) -> dict[str, object]:
    idle = await quiet_phase(target, ids, count)
    stop = asyncio.Event()
    outcomes: Counter[str] = Counter()
    flooding = asyncio.ensure_future(flood(target, ids, stop, outcomes))
    await asyncio.sleep(5)  # let the flood fill the slots and the queue
    loaded = await quiet_phase(target, ids, count)
    stop.set()
    await flooding
    return {"idle_ms": idle, "flooded_ms": loaded, "flood_outcomes": dict(outcomes)}


def main() -> None:
    count = benchkit.command_line(__doc__, repetitions=40).repetitions
    directory = benchkit.model_dir()
    ids = benchkit.prompt_ids(directory)
    with tempfile.TemporaryDirectory() as scratch:
        tokens = Path(scratch) / "tokens"
        tokens.write_text(f"flood {FLOOD_TOKEN}\nquiet {QUIET_TOKEN}\n")
        with benchkit.ServerProcess(
            directory, max_batch_size=SLOTS, max_queue_size=QUEUE, extra=("--auth-tokens-file", str(tokens))
        ) as server:
            found = asyncio.run(run(server.target, ids, count))
    idle, flooded = found["idle_ms"], found["flooded_ms"]
    assert isinstance(idle, list) and isinstance(flooded, list)
    rows = [
        ["idle", f"{statistics.median(idle):.1f}", f"{percentile(idle, 0.99):.1f}"],
        ["flood at 10x capacity", f"{statistics.median(flooded):.1f}", f"{percentile(flooded, 0.99):.1f}"],
    ]
    ratio = percentile(flooded, 0.99) / percentile(idle, 0.99)
    print(f"\n## The quiet caller's TTFT (server-measured, ms), {count} requests per phase\n")
    print(benchkit.markdown_table(["phase", "p50", "p99"], rows))
    print(f"\np99 flooded / p99 idle: {ratio:.2f} (target <= 2)")
    print(f"flood outcomes: {found['flood_outcomes']}")
    path = benchkit.save_results(
        "fairness", {"machine": benchkit.machine_summary(), **found, "p99_ratio": ratio}
    )
    print(f"\nresults: {path}")


if __name__ == "__main__":
    main()

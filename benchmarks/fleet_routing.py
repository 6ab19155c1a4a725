"""Load-aware routing: weighted round robin on ORCA reports against plain round robin.

Starts three `tokenwire serve` replicas on 127.0.0.1, 127.0.0.2 and 127.0.0.3 (one ONNX Runtime
thread each), the third made slow with `--max-batch-size 1`. Each replica serves the model under
its own name, so every completed generation names the replica that served it. Then, for each
concurrency level and repetition, alternating which goes first, the same closed-loop load runs
through one fleet client with each policy: `concurrency` workers streaming generations back to
back (a 100-token prompt, NEW_TOKENS new tokens, greedy), for WARMUP_SECONDS not counted (so
the weighted client has its weights), then for MEASURED_SECONDS counted (requests started by
then run to their end). It reports, per policy, how many requests each replica served, the
fleet's time to first token (client side, p50 and p99) and its completed requests per second.

    python benchmarks/fleet_routing.py [--levels 6] [--repetitions 3]

The model is the default one; $TOKENWIRE_BENCH_MODEL names another directory (results then go
to fleet_routing_<directory name>.json).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from collections import Counter
from contextlib import ExitStack
from typing import Any

import benchkit

from tokenwire.client import (
    AsyncClient,
    Chunk,
    Completed,
    Failed,
    GenerateOptions,
    Routing,
    Sampling,
    Stopping,
)
from tokenwire.client.bench import percentile

WARMUP_SECONDS = 5.0
"""Load that is not counted: the weighted client's weights need reports over its blackout period."""
MEASURED_SECONDS = 30.0
NEW_TOKENS = 16
FAST_BATCH = 8
SLOW_BATCH = 1
POLICIES = {
    "weighted_round_robin": Routing(blackout_period=1.0),
    "round_robin": Routing(policy="round_robin"),
}


async def _one(client: AsyncClient, prompt: str) -> tuple[str, float]:
    """One streamed generation: (serving replica, client-side time to first token)."""
    options = GenerateOptions(
        sampling=Sampling(temperature=0.0), stopping=Stopping(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    )
    started = time.perf_counter()
    first_token: float | None = None
    async for event in client.stream(prompt, options, deadline=600):
        if isinstance(event, Chunk) and first_token is None:
            first_token = time.perf_counter() - started
        elif isinstance(event, Completed):
            assert first_token is not None
            return event.generation.model, first_token
        elif isinstance(event, Failed):
            raise event.error
    raise RuntimeError("stream ended without completing")


async def run_policy(target: str, routing: Routing, prompt: str, concurrency: int) -> dict[str, Any]:
    results: list[tuple[str, float]] = []
    async with AsyncClient(target, routing=routing) as client:

        async def worker(until: float, counted: bool) -> None:
            while time.perf_counter() < until:
                result = await _one(client, prompt)
                if counted:
                    results.append(result)

        warm_until = time.perf_counter() + WARMUP_SECONDS
        await asyncio.gather(*(worker(warm_until, False) for _ in range(concurrency)))
        counted_start = time.perf_counter()
        counted_until = counted_start + MEASURED_SECONDS
        await asyncio.gather(*(worker(counted_until, True) for _ in range(concurrency)))
        wall = time.perf_counter() - counted_start
    served = Counter(model for model, _ in results)
    ttft = [seconds for _, seconds in results]
    return {
        "served": {name: served.get(name, 0) for name in ("r1", "r2", "r3")},
        "ttft_p50_ms": statistics.median(ttft) * 1000,
        "ttft_p99_ms": percentile(ttft, 99) * 1000,
        "requests": len(results),
        "wall_s": wall,
    }


def main() -> None:
    options = benchkit.command_line(__doc__, repetitions=3, levels="6")
    model = benchkit.model_dir()
    prompt = benchkit.prompt_text(model)
    runs: dict[int, dict[str, list[dict[str, Any]]]] = {}
    with ExitStack() as stack:
        replicas = []
        for index, batch in enumerate((FAST_BATCH, FAST_BATCH, SLOW_BATCH), start=1):
            server = benchkit.ServerProcess(
                model,
                max_batch_size=batch,
                threads=1,
                host=f"127.0.0.{index}",
                model_name=f"r{index}",
                extra=("--no-metrics", "--no-access-log"),
            )
            replicas.append(stack.enter_context(server))
        target = "ipv4:" + ",".join(server.target for server in replicas)
        for concurrency in options.levels:
            runs[concurrency] = {name: [] for name in POLICIES}
            for repetition in range(options.repetitions):
                order = list(POLICIES) if repetition % 2 == 0 else list(reversed(POLICIES))
                for name in order:
                    benchkit.wait_for_quiet()
                    result = asyncio.run(run_policy(target, POLICIES[name], prompt, concurrency))
                    runs[concurrency][name].append(result)
                    print(f"c={concurrency} repetition {repetition + 1} {name}: {result}", flush=True)

    rows = []
    for concurrency, by_policy in runs.items():
        for name, results in by_policy.items():
            served = {r: benchkit.median([run["served"][r] for run in results]) for r in ("r1", "r2", "r3")}
            rows.append(
                [
                    concurrency,
                    name,
                    f"{served['r1']:.0f} / {served['r2']:.0f} / {served['r3']:.0f}",
                    f"{benchkit.median([run['served']['r3'] / run['requests'] for run in results]):.0%}",
                    benchkit.median([run["ttft_p50_ms"] for run in results]),
                    benchkit.median([run["ttft_p99_ms"] for run in results]),
                    benchkit.median([run["requests"] / run["wall_s"] for run in results]),
                ]
            )
    table = benchkit.markdown_table(
        [
            "concurrency",
            "policy",
            "requests r1 / r2 / r3 (slow)",
            "slow replica's share",
            "TTFT p50 ms",
            "TTFT p99 ms",
            "requests/s",
        ],
        rows,
    )
    print(table)
    name = "fleet_routing" if "TOKENWIRE_BENCH_MODEL" not in os.environ else f"fleet_routing_{model.name}"
    path = benchkit.save_results(
        name,
        {
            "model": model.name,
            "warmup_seconds": WARMUP_SECONDS,
            "measured_seconds": MEASURED_SECONDS,
            "new_tokens": NEW_TOKENS,
            "batch_sizes": [FAST_BATCH, FAST_BATCH, SLOW_BATCH],
            "runs": {str(c): r for c, r in runs.items()},
            "table": table,
        },
    )
    print(f"results: {path.relative_to(benchkit.REPO)}")


if __name__ == "__main__":
    main()

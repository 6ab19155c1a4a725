"""One caller flooding the server at 10x its capacity, and what that does to another caller.

Starts a server with the default model (8 slots, queue 64, 2 threads) and a token file naming two
callers of equal weight, "flood" and "quiet". First, with the server idle, "quiet" sends
requests one after another (100-token prompt, 16 new tokens, greedy) and its time to first token
is recorded. Then "flood" keeps 10x the server's capacity in flight (capacity: the 8 slots, so
80 requests, more than the slots and the queue hold, so it is refused too), sending a new
request as each one ends or is refused (after 20 ms), while "quiet" repeats its sequence. Every
prompt opens with its own tag ("[quiet 7] ..."), so no request finds another's prompt in the
prefix cache: each TTFT includes its whole prefill.

The same runs on two servers side by side, one as shipped (preemption on: a caller under its
share of the slots takes one from a caller over its share at the next step) and one with
`--no-preemption` (the quiet caller waits for one of the flood's generations to end). The server
measures every TTFT; the script reports the quiet caller's p50 and p99 in both phases, the ratio
of the p99s (target: at most 2), and how the flood's requests ended.

    python benchmarks/fairness.py [--repetitions 40]

(`--repetitions` is the number of quiet requests per phase.)
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
import tempfile
from collections import Counter
from pathlib import Path

import benchkit

from tokenwire.client import AsyncClient, GenerateOptions, Sampling, Stopping, TokenwireError

SLOTS = 8
QUEUE = 64
FLOOD_FACTOR = 10
PROMPT_TOKENS = 100
FLOOD_TOKEN = "flood-benchmark-token"
QUIET_TOKEN = "quiet-benchmark-token"
OPTIONS = GenerateOptions(
    sampling=Sampling(temperature=0.0), stopping=Stopping(max_new_tokens=16, ignore_eos=True)
)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class Prompts:
    """100-token prompts, each opening with its own tag so no two share a cached prefix."""

    def __init__(self, directory: Path) -> None:
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        self._passage = benchkit.prompt_ids(directory, PROMPT_TOKENS)
        self._count = itertools.count()

    def next(self, caller: str) -> list[int]:
        tag = self._tokenizer.encode(f"[{caller} {next(self._count)}] ", add_special_tokens=False).ids
        return [int(t) for t in tag] + self._passage[: PROMPT_TOKENS - len(tag)]


async def quiet_phase(target: str, prompts: Prompts, count: int) -> list[float]:
    ttfts = []
    async with AsyncClient(target, token=QUIET_TOKEN, retries=False) as client:
        for _ in range(count):
            result = await client.generate(prompts.next("quiet"), OPTIONS, deadline=120)
            assert result.timing.time_to_first_token is not None
            ttfts.append(result.timing.time_to_first_token * 1000)
    return ttfts


async def flood(target: str, prompts: Prompts, stop: asyncio.Event, outcomes: Counter[str]) -> None:
    async with AsyncClient(target, token=FLOOD_TOKEN, retries=False) as client:

        async def one_lane() -> None:
            while not stop.is_set():
                try:
                    await client.generate(prompts.next("flood"), OPTIONS, deadline=120)
                    outcomes["ok"] += 1
                except TokenwireError as error:
                    outcomes[error.reason or error.code.name] += 1
                    await asyncio.sleep(0.02)  # a refused client backs off a little, then floods on

        lanes = [asyncio.ensure_future(one_lane()) for _ in range(FLOOD_FACTOR * SLOTS)]
        await stop.wait()
        for lane in lanes:
            lane.cancel()
        await asyncio.gather(*lanes, return_exceptions=True)


async def run(target: str, prompts: Prompts, count: int) -> dict[str, object]:
    idle = await quiet_phase(target, prompts, count)
    stop = asyncio.Event()
    outcomes: Counter[str] = Counter()
    flooding = asyncio.ensure_future(flood(target, prompts, stop, outcomes))
    await asyncio.sleep(5)  # let the flood fill the slots and the queue
    loaded = await quiet_phase(target, prompts, count)
    stop.set()
    await flooding
    return {"idle_ms": idle, "flooded_ms": loaded, "flood_outcomes": dict(outcomes)}


VARIANTS = {"preemption on (default)": (), "preemption off": ("--no-preemption",)}


def main() -> None:
    count = benchkit.command_line(__doc__, repetitions=40).repetitions
    directory = benchkit.model_dir()
    prompts = Prompts(directory)
    found: dict[str, dict[str, object]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        tokens = Path(scratch) / "tokens"
        tokens.write_text(f"flood {FLOOD_TOKEN}\nquiet {QUIET_TOKEN}\n")
        for name, flags in VARIANTS.items():
            benchkit.wait_for_quiet()
            extra = ("--auth-tokens-file", str(tokens), *flags)
            with benchkit.ServerProcess(
                directory, max_batch_size=SLOTS, max_queue_size=QUEUE, extra=extra
            ) as server:
                found[name] = asyncio.run(run(server.target, prompts, count))
    rows = []
    for name, runs in found.items():
        idle, flooded = runs["idle_ms"], runs["flooded_ms"]
        assert isinstance(idle, list) and isinstance(flooded, list)
        runs["p99_ratio"] = ratio = percentile(flooded, 0.99) / percentile(idle, 0.99)
        rows.append(
            [
                name,
                f"{statistics.median(idle):.1f}",
                f"{percentile(idle, 0.99):.1f}",
                f"{statistics.median(flooded):.1f}",
                f"{percentile(flooded, 0.99):.1f}",
                f"{ratio:.2f}",
                str(runs["flood_outcomes"]),
            ]
        )
    print(f"\n## The quiet caller's TTFT (server-measured, ms), {count} requests per phase\n")
    header = [
        "server",
        "idle p50",
        "idle p99",
        "flooded p50",
        "flooded p99",
        "p99 ratio (target <= 2)",
        "flood",
    ]
    print(benchkit.markdown_table(header, rows))
    path = benchkit.save_results("fairness", {"machine": benchkit.machine_summary(), **found})
    print(f"\nresults: {path}")


if __name__ == "__main__":
    main()

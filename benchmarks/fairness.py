"""One caller flooding the server at 10x its capacity, and what that does to another caller.

Starts a server with the default model (8 slots, queue 64, 2 threads) and a token file naming two
callers of equal weight, "flood" and "quiet". First, with the server idle, "quiet" sends
requests one after another (100-token prompt, 16 new tokens, greedy) and its time to first token
is recorded. Then "flood" keeps 10x the server's capacity in flight (capacity: the 8 slots, so
80 requests, more than the slots and the queue hold, so it is refused too), sending a new
request as each one ends or is refused (after 20 ms), while "quiet" repeats its sequence. Every
prompt opens with its own tag ("[quiet 7] ..."), so no request finds another's prompt in the
prefix cache: each TTFT includes its whole prefill.

The same runs on servers side by side: as shipped (preemption on: a caller under its share of
the slots takes one from a caller over its share at the next step), with `--no-preemption` (the
quiet caller waits for one of the flood's generations to end), with `--no-stall-free`, and as
shipped with the flood's client moved to a process of its own at the lowest CPU priority (on one
machine, the nearest thing to a caller elsewhere: its client's work stops competing with the
model for the cores; the server's work on the flood's requests still does). The server
measures every TTFT; the script reports the quiet caller's p50 and p99 in both phases, the ratio
of the p99s (target: at most 2), and how the flood's requests ended.

    python benchmarks/fairness.py [--repetitions 40] [--baseline ../tokenwire-before] [--only-shipped]
                                  [--flood-prompt-tokens 1000]

(`--repetitions` is the number of quiet requests per phase.)
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import multiprocessing
import os
import statistics
import tempfile
from collections import Counter
from collections.abc import Callable
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event as EventType
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
    """The quiet caller's 100-token prompts and the flood's (100 tokens, or `flood_tokens`), each
    opening with its own tag so no two share a cached prefix."""

    def __init__(self, directory: Path, flood_tokens: int = PROMPT_TOKENS) -> None:
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        self._lengths = {"quiet": PROMPT_TOKENS, "flood": flood_tokens}
        self._passage = benchkit.prompt_ids(directory, max(self._lengths.values()))
        self._count = itertools.count()

    @property
    def flood_tokens(self) -> int:
        return self._lengths["flood"]

    def next(self, caller: str) -> list[int]:
        tag = self._tokenizer.encode(f"[{caller} {next(self._count)}] ", add_special_tokens=False).ids
        return [int(t) for t in tag] + self._passage[: self._lengths[caller] - len(tag)]


async def quiet_phase(target: str, prompts: Prompts, count: int) -> dict[str, list[float]]:
    """The quiet caller's TTFTs, and their parts (queued, paced, prefill), in ms."""
    parts: dict[str, list[float]] = {"ttft": [], "queued": [], "paced": [], "prefill": []}
    async with AsyncClient(target, token=QUIET_TOKEN, retries=False) as client:
        for _ in range(count):
            timing = (await client.generate(prompts.next("quiet"), OPTIONS, deadline=120)).timing
            assert timing.time_to_first_token is not None
            parts["ttft"].append(timing.time_to_first_token * 1000)
            parts["queued"].append(timing.queued * 1000)
            parts["paced"].append((timing.paced or 0.0) * 1000)
            parts["prefill"].append((timing.prefill or 0.0) * 1000)
    return parts


async def flood(target: str, prompts: Prompts, stop: Callable[[], bool], outcomes: Counter[str]) -> None:
    async with AsyncClient(target, token=FLOOD_TOKEN, retries=False) as client:

        async def one_lane() -> None:
            while not stop():
                try:
                    await client.generate(prompts.next("flood"), OPTIONS, deadline=120)
                    outcomes["ok"] += 1
                except TokenwireError as error:
                    outcomes[error.reason or error.code.name] += 1
                    await asyncio.sleep(0.02)  # a refused client backs off a little, then floods on

        # Each lane ends after the request it has in flight when told to stop (16 tokens at most).
        await asyncio.gather(*(one_lane() for _ in range(FLOOD_FACTOR * SLOTS)))


def flood_process(
    target: str, directory: Path, flood_tokens: int, stop: EventType, results: Queue[dict[str, int]]
) -> None:
    """The flood from a process of its own at the lowest CPU priority: a caller elsewhere, as
    far as one machine allows (its client's work takes no CPU the server wants)."""
    os.nice(19)
    outcomes: Counter[str] = Counter()
    asyncio.run(flood(target, Prompts(directory, flood_tokens), stop.is_set, outcomes))
    results.put(dict(outcomes))


async def run(
    target: str, directory: Path, prompts: Prompts, count: int, *, apart: bool
) -> dict[str, object]:
    """`apart`: the flood runs in a niced process of its own, else on this event loop."""
    idle = await quiet_phase(target, prompts, count)
    outcomes: Counter[str] = Counter()
    if apart:
        context = multiprocessing.get_context("spawn")
        stop_apart, results = context.Event(), context.Queue()
        child = context.Process(
            target=flood_process, args=(target, directory, prompts.flood_tokens, stop_apart, results)
        )
        child.start()
        stop: Callable[[], bool] = stop_apart.is_set
    else:
        stopping = asyncio.Event()
        stop = stopping.is_set
        flooding = asyncio.ensure_future(flood(target, prompts, stop, outcomes))
    await asyncio.sleep(5)  # let the flood fill the slots and the queue
    loaded = await quiet_phase(target, prompts, count)
    if apart:
        stop_apart.set()
        outcomes.update(await asyncio.to_thread(results.get))
        child.join()
    else:
        stopping.set()
        await flooding
    return {"idle_ms": idle, "flooded_ms": loaded, "flood_outcomes": dict(outcomes)}


VARIANTS: dict[str, tuple[tuple[str, ...], bool]] = {
    "as shipped (preemption on)": ((), False),
    "preemption off": (("--no-preemption",), False),
    "preemption on, stall-free off": (("--no-stall-free",), False),
    "as shipped, the flood's client in a niced process": ((), True),
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repetitions", type=int, default=40)
    parser.add_argument("--baseline", type=Path, help="another checkout, run as shipped beside this one")
    parser.add_argument("--only-shipped", action="store_true", help="only the as-shipped variants")
    parser.add_argument(
        "--flood-prompt-tokens",
        type=int,
        default=PROMPT_TOKENS,
        help="the flood's prompt length (the quiet caller's stays 100): a flood of long prompts",
    )
    args = parser.parse_args()
    count = args.repetitions
    variants: dict[str, tuple[tuple[str, ...], bool, Path | None]] = {
        name: (flags, apart, None)
        for name, (flags, apart) in VARIANTS.items()
        if not args.only_shipped or name.startswith("as shipped")
    }
    if args.baseline is not None:
        variants[f"as shipped, {args.baseline.name}"] = ((), False, args.baseline.resolve())
    directory = benchkit.model_dir()
    prompts = Prompts(directory, args.flood_prompt_tokens)
    found: dict[str, dict[str, object]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        tokens = Path(scratch) / "tokens"
        tokens.write_text(f"flood {FLOOD_TOKEN}\nquiet {QUIET_TOKEN}\n")
        for name, (flags, apart, code) in variants.items():
            benchkit.wait_for_quiet()
            extra = ("--auth-tokens-file", str(tokens), *flags)
            with benchkit.ServerProcess(
                directory, max_batch_size=SLOTS, max_queue_size=QUEUE, extra=extra, code=code
            ) as server:
                found[name] = asyncio.run(run(server.target, directory, prompts, count, apart=apart))
    rows = []
    parts = []
    for name, runs in found.items():
        idle, flooded = runs["idle_ms"], runs["flooded_ms"]
        assert isinstance(idle, dict) and isinstance(flooded, dict)
        runs["p99_ratio"] = ratio = percentile(flooded["ttft"], 0.99) / percentile(idle["ttft"], 0.99)
        rows.append(
            [
                name,
                f"{statistics.median(idle['ttft']):.1f}",
                f"{percentile(idle['ttft'], 0.99):.1f}",
                f"{statistics.median(flooded['ttft']):.1f}",
                f"{percentile(flooded['ttft'], 0.99):.1f}",
                f"{ratio:.2f}",
                str(runs["flood_outcomes"]),
            ]
        )
        for phase, measured in (("idle", idle), ("flooded", flooded)):
            medians = [f"{statistics.median(measured[p]):.1f}" for p in ("queued", "paced", "prefill")]
            parts.append([name, phase, *medians])
    print(
        f"\n## The quiet caller's TTFT (server-measured, ms), {count} requests per phase, "
        f"the flood's prompts {args.flood_prompt_tokens} tokens\n"
    )
    header = ["server", "idle p50", "idle p99", "flooded p50", "flooded p99", "p99 ratio (target <= 2)"]
    print(benchkit.markdown_table([*header, "flood"], rows))
    print("\n### Where the quiet caller's TTFT went (medians, ms)\n")
    print(benchkit.markdown_table(["server", "phase", "queued", "paced", "prefill"], parts))
    name = (
        "fairness"
        if args.flood_prompt_tokens == PROMPT_TOKENS
        else f"fairness_flood{args.flood_prompt_tokens}"
    )
    path = benchkit.save_results(
        name,
        {"machine": benchkit.machine_summary(), "flood_prompt_tokens": args.flood_prompt_tokens, **found},
    )
    print(f"\nresults: {path}")


if __name__ == "__main__":
    main()

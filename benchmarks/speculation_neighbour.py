"""What one caller's speculation costs the stream beside it, side by side on the default model.

A neighbour stream (a story, greedy, whose drafts rarely match) decodes while an "attacker"
stream repeats a line over and over, so that nearly every draft from its own prompt is accepted. The
same pair runs on a server with `--speculative-tokens K` (the attacker speculates) and on one with
0 (nobody does), in turns, and the neighbour's inter-token gaps are compared: with verified
positions charged as work, the neighbour's gap beside a speculating stream stays within 1.25x of
its gap beside the same stream not speculating. `--baseline DIR` adds a third server from another
checkout with speculation on (the build before the charge, to show what it fixed).

    python benchmarks/speculation_neighbour.py [--repetitions 5] [--tokens 16] [--baseline DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import benchkit
from benchkit import median
from speculative import _chat_ids

ATTACKER = "Repeat this line again and again: " + "one two three four five six seven eight nine ten, " * 30
"""A self-repeating prompt: the model goes on repeating it, so nearly every draft is accepted."""
NEIGHBOUR = "Write a short story about a robot who learns to paint."


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument(
        "--tokens", type=int, default=16, help="--speculative-tokens of the speculating servers"
    )
    parser.add_argument("--neighbour-tokens", type=int, default=120)
    parser.add_argument("--baseline", type=Path, help="a checkout to serve with speculation on as well")
    args = parser.parse_args()

    directory = benchkit.model_dir()
    attacker, neighbour = _chat_ids(directory, ATTACKER), _chat_ids(directory, NEIGHBOUR)
    on_flags = ["--speculative-tokens", str(args.tokens), "--no-metrics"]
    servers: dict[str, dict[str, Any]] = {
        "speculating": {"extra": on_flags},
        "not speculating": {"extra": ["--speculative-tokens", "0", "--no-metrics"]},
    }
    if args.baseline is not None:
        servers[f"speculating, before ({args.baseline.name})"] = {
            "extra": on_flags,
            "code": args.baseline.resolve(),
        }
    gaps: dict[str, list[dict[str, float]]] = {name: [] for name in servers}
    processes = {
        name: benchkit.ServerProcess(directory, max_batch_size=8, **spec) for name, spec in servers.items()
    }
    for process in processes.values():
        process.__enter__()
    try:
        for process in processes.values():  # warm-up: first-call allocations
            _pair(process.target, attacker, neighbour, args.neighbour_tokens)
        names = list(processes)
        for repetition in range(args.repetitions):
            shift = repetition % len(names)
            for name in names[shift:] + names[:shift]:
                gaps[name].append(_pair(processes[name].target, attacker, neighbour, args.neighbour_tokens))
    finally:
        for process in processes.values():
            process.__exit__()

    plain = gaps["not speculating"]
    rows = []
    for name, runs in gaps.items():
        ratios = [run["p50"] / base["p50"] for run, base in zip(runs, plain, strict=True)]
        mean_ratios = [run["mean"] / base["mean"] for run, base in zip(runs, plain, strict=True)]
        rows.append(
            [
                name,
                f"{median([r['p50'] for r in runs]) * 1000:.1f}",
                f"{median([r['p99'] for r in runs]) * 1000:.1f}",
                f"{median([r['mean'] for r in runs]) * 1000:.1f}",
                f"{median(ratios):.2f}x",
                f"{median(mean_ratios):.2f}x",
                f"{median([r['attacker_rate'] for r in runs]):.1f}",
            ]
        )
    table = benchkit.markdown_table(
        [
            "attacker's server",
            "neighbour ITL p50 ms",
            "p99 ms",
            "mean ms",
            "p50 / not speculating",
            "mean / not speculating",
            "attacker tok/s",
        ],
        rows,
    )
    print(table)
    benchkit.save_results(
        "speculation_neighbour",
        {
            "args": {
                "repetitions": args.repetitions,
                "tokens": args.tokens,
                "neighbour_tokens": args.neighbour_tokens,
                "baseline": args.baseline.name if args.baseline is not None else None,
            },
            "gaps": gaps,
            "table": table,
        },
    )


def _pair(
    target: str, attacker: Sequence[int], neighbour: Sequence[int], neighbour_tokens: int
) -> dict[str, float]:
    return benchkit._run(_both(target, attacker, neighbour, neighbour_tokens))


async def _both(
    target: str, attacker: Sequence[int], neighbour: Sequence[int], neighbour_tokens: int
) -> dict[str, float]:
    from tokenwire.client import AsyncClient, Chunk, Completed, GenerateOptions, Sampling, Stopping

    client = benchkit._clients.get(target)
    if client is None:
        client = benchkit._clients[target] = AsyncClient(target, retries=False)
    started = asyncio.Event()

    async def stream(
        ids: Sequence[int], tokens: int, chunks: list[tuple[float, int]], *, endless: bool
    ) -> None:
        stopping = Stopping(max_new_tokens=tokens, ignore_eos=endless)
        options = GenerateOptions(sampling=Sampling(temperature=0.0), stopping=stopping)
        async for event in client.stream(list(ids), options, deadline=600):
            if isinstance(event, Chunk) and event.token_ids:
                chunks.append((time.perf_counter(), len(event.token_ids)))
                started.set()
            elif isinstance(event, Completed):
                return
        raise RuntimeError("stream ended without completing")

    # The attacker runs (past its end of text) until the neighbour is done, then is cancelled.
    attacked: list[tuple[float, int]] = []
    attack = asyncio.create_task(stream(attacker, 1000, attacked, endless=True))
    first_chunk = asyncio.create_task(started.wait())
    await asyncio.wait({attack, first_chunk}, return_when=asyncio.FIRST_COMPLETED)
    if attack.done():
        attack.result()  # a refusal, raised here rather than waited on forever
        raise RuntimeError("the attacker's stream ended before the neighbour's began")
    chunks: list[tuple[float, int]] = []
    await stream(neighbour, neighbour_tokens, chunks, endless=False)
    attack.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await attack
    # A chunk of k tokens after a gap g: k gaps of g / k each (the tokens waited together).
    gaps = sorted(
        (later - earlier) / count
        for (earlier, _), (later, count) in itertools.pairwise(chunks)
        for _ in range(count)
    )
    tokens = sum(count for _, count in attacked)
    return {
        "p50": gaps[len(gaps) // 2],
        "p99": gaps[min(len(gaps) - 1, int(len(gaps) * 0.99))],
        "mean": sum(gaps) / len(gaps),
        "attacker_rate": (tokens - 1) / (attacked[-1][0] - attacked[0][0]),
    }


if __name__ == "__main__":
    main()

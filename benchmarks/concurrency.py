"""tokenwire at rising concurrency against raw batched ONNX Runtime at the same batch size.

Each level is one wave: N streams (100-token prompts, 128 greedy new tokens) sent at once to a
server with 16 slots through tokenwire's asyncio client; the raw side prefills the same prompts
and decodes them as one batch in this process. tokenwire and raw take
turns (who goes first alternates) and each figure is the median over the repetitions.

Also measured per level: the server's peak RSS, and its CPU cost per streamed token beyond ONNX
Runtime: (server process CPU time - raw loop CPU time for the same work) / tokens.

    python benchmarks/concurrency.py [--levels 1,2,4,8,16] [--repetitions 3]
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import benchkit
from benchkit import NEW_TOKENS, PROMPT_TOKENS, THREADS, median
from ort_loop import RawLoop, generate

from tokenwire.client.bench import percentile


def tokenwire_wave(server: benchkit.ServerProcess, prompts: list[list[int]]) -> dict[str, Any]:
    cpu_before = benchkit.cpu_seconds(server.pid)
    client_cpu_before = time.process_time()
    began = time.perf_counter()
    with benchkit.PeakRss(server.pid) as rss:
        runs = benchkit.run_streams(server.target, prompts, NEW_TOKENS)
    wall = time.perf_counter() - began
    tokens = sum(len(r.token_times) for r in runs)
    firsts = [r.first_token for r in runs]
    queued = [r.server_queued for r in runs]
    gaps = [later - earlier for r in runs for earlier, later in itertools.pairwise(r.token_times)]
    return {
        "tokens_per_second": tokens / wall,
        "ttft_p50": percentile(firsts, 50),
        "ttft_p99": percentile(firsts, 99),
        "queued_p50": percentile(queued, 50),
        "queued_p99": percentile(queued, 99),
        "itl_p50": percentile(gaps, 50),
        "itl_p99": percentile(gaps, 99),
        "server_cpu": benchkit.cpu_seconds(server.pid) - cpu_before,
        "client_cpu": time.process_time() - client_cpu_before,
        "peak_rss": rss.peak,
        "tokens": tokens,
    }


def raw_wave(raw: RawLoop, prompts: list[list[int]]) -> dict[str, Any]:
    raw.run_seconds = 0.0
    run = generate(raw, prompts, NEW_TOKENS)
    return {
        "tokens_per_second": run["tokens"] / run["total"],
        "decode_tokens_per_second": len(prompts) * (NEW_TOKENS - 1) / run["decode"],
        "cpu": run["cpu"],
        "run_seconds": raw.run_seconds,
        "total": run["total"],
    }


def pair_ratio(tokenwire: list[dict[str, Any]], raw: list[dict[str, Any]]) -> float:
    return median(
        [t["tokens_per_second"] / r["tokens_per_second"] for t, r in zip(tokenwire, raw, strict=True)]
    )


def main() -> None:
    args = benchkit.command_line(__doc__, repetitions=3, levels="1,2,4,8,16")
    levels = args.levels

    directory = benchkit.model_dir()
    slots = max(levels)
    raw = RawLoop(directory, threads=THREADS, slots=slots, max_len=PROMPT_TOKENS + NEW_TOKENS + 1)
    prompts = [benchkit.prompt_ids(directory, offset=7 * i) for i in range(slots)]
    tokenwire: dict[int, list[dict[str, Any]]] = {n: [] for n in levels}
    raws: dict[int, list[dict[str, Any]]] = {n: [] for n in levels}
    with benchkit.ServerProcess(directory, max_batch_size=slots) as server:
        idle_rss = benchkit.rss_bytes(server.pid)
        tokenwire_wave(server, prompts[:2])  # warm-up: connects the client, first-call costs
        raw_wave(raw, prompts[:2])
        for repetition in range(args.repetitions):
            for streams in levels:
                benchkit.wait_for_quiet()
                first, second = "tokenwire", "raw"
                for side in (first, second) if repetition % 2 == 0 else (second, first):
                    if side == "tokenwire":
                        tokenwire[streams].append(tokenwire_wave(server, prompts[:streams]))
                    else:
                        raws[streams].append(raw_wave(raw, prompts[:streams]))
        kv_line = server.kv_cache_line()

    rows = []
    for n in levels:
        tw, rw = tokenwire[n], raws[n]
        tw_rate = median([r["tokens_per_second"] for r in tw])
        raw_rate = median([r["tokens_per_second"] for r in rw])
        # Each tokenwire wave ran right next to its raw wave: the median of the pairs' ratios
        # cancels most of the machine's drift between repetitions.
        ratio = pair_ratio(tw, rw)
        overhead = median([(t["server_cpu"] - r["cpu"]) / t["tokens"] for t, r in zip(tw, rw, strict=True)])
        rows.append(
            [
                n,
                tw_rate,
                raw_rate,
                f"{ratio:.2f}",
                median([r["ttft_p50"] for r in tw]) * 1000,
                median([r["ttft_p99"] for r in tw]) * 1000,
                median([r["queued_p99"] for r in tw]) * 1000,
                median([r["itl_p50"] for r in tw]) * 1000,
                median([r["itl_p99"] for r in tw]) * 1000,
                median([r["server_cpu"] / r["tokens"] for r in tw]) * 1e6,
                median([r["cpu"] / (n * NEW_TOKENS) for r in rw]) * 1e6,
                overhead * 1e6,
                median([r["client_cpu"] / r["tokens"] for r in tw]) * 1e6,
                median([r["peak_rss"] for r in tw]) / 2**20,
            ]
        )
    print(
        f"\n## Concurrency: {PROMPT_TOKENS}-token prompts, {NEW_TOKENS} new tokens each, one wave per level, "
        f"{THREADS} threads, median of {args.repetitions}\n"
    )
    columns = [
        "streams",
        "tokenwire tok/s",
        "raw ORT tok/s",
        "ratio (median of pairs)",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "queued p99 ms",
        "ITL p50 ms",
        "ITL p99 ms",
        "server CPU µs/token",
        "raw ORT CPU µs/token",
        "server overhead µs/token",
        "client CPU µs/token",
        "server peak RSS MiB",
    ]
    print(benchkit.markdown_table(columns, rows))
    print(f"\nserver RSS at idle after loading: {idle_rss / 2**20:.0f} MiB; {kv_line}")

    single = median([r["tokens_per_second"] for r in tokenwire[levels[0]]]) if levels[0] == 1 else None
    target_rows = []
    for n in (8, 16):
        if n not in tokenwire:
            continue
        tw_rate = median([r["tokens_per_second"] for r in tokenwire[n]])
        ratio = pair_ratio(tokenwire[n], raws[n])
        target_rows.append(
            [f"{n} streams >= 0.9x raw batched ORT", "met" if ratio >= 0.9 else "missed", f"{ratio:.2f}x"]
        )
        if single:
            scale = tw_rate / single
            target_rows.append(
                [f"{n} streams >= 2x one stream", "met" if scale >= 2 else "missed", f"{scale:.2f}x"]
            )
    print("\n## Targets\n")
    print(benchkit.markdown_table(["target", "result", "measured"], target_rows))
    path = benchkit.save_results(
        "concurrency",
        {
            "repetitions": args.repetitions,
            "tokenwire": {str(k): v for k, v in tokenwire.items()},
            "raw": {str(k): v for k, v in raws.items()},
            "idle_rss": idle_rss,
            "kv_cache": kv_line,
        },
    )
    print(f"\nwrote {path.relative_to(benchkit.REPO)}")


if __name__ == "__main__":
    main()

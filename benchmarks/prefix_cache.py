"""Prefix caching, with and without the cache, on one machine in one run.

Three servers of the default model (8 slots): this checkout with the prefix cache (the default,
256 MiB), the same with `--prefix-cache-mb 0`, and, with `--baseline DIR`, a checkout without
prefix caching at all (served through PYTHONPATH). Workloads, with `tokenwire bench`:

- shared system prompt: every prompt is the same 1,000 tokens followed by a 20-token question,
  16 new tokens, one client (`--shared-prefix-tokens 1000 --prompt-tokens 20`); the warm-up
  request fills the cache, so every measured request finds it warm;
- 8-turn chats: each turn resends the conversation so far and adds a 20-token question, 32 new
  tokens per answer, one client, two conversations (`--chat-turns 8`); the figure is the server's
  prefill time summed over every turn;
- no sharing: 8 streams of distinct 100-token prompts, 128 new tokens, to see what the cache
  costs when it never hits, and that the server with the cache off runs as before (a fresh seed
  per repetition, so no prompt repeats).

Each repetition runs every workload on every server, the order alternating.

    python benchmarks/prefix_cache.py --baseline ../tokenwire-before [--repetitions 3]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

import benchkit
from bench_workloads import Workload, run_once

from tokenwire.client.bench import LoadLevel, RequestRecord
from tokenwire.client.bench.stats import percentile

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"


def summarize(runs: list[tuple[list[RequestRecord], float]]) -> dict[str, float]:
    ok = [r for records, _ in runs for r in records if r.outcome == "ok"]
    ttft = [r.first_token for r in ok if r.first_token is not None]
    prefill_per_run = [
        sum(r.server_prefill or 0.0 for r in records if r.outcome == "ok") for records, _ in runs
    ]
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    return {
        "requests": len(ok),
        "failed": sum(1 for records, _ in runs for r in records) - len(ok),
        "ttft_p50": percentile(ttft, 50) if ttft else float("nan"),
        "ttft_p90": percentile(ttft, 90) if ttft else float("nan"),
        "server_prefill_p50": statistics.median([r.server_prefill or 0.0 for r in ok])
        if ok
        else float("nan"),
        "prefill_seconds_per_run": statistics.median(prefill_per_run) if prefill_per_run else float("nan"),
        "cached_share": sum(r.cached_prompt_tokens for r in ok) / prompt_tokens if prompt_tokens else 0.0,
        "tok_per_s": statistics.median([rate for _, rate in runs]) if runs else float("nan"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--baseline", type=Path, help="checkout of a tokenwire version without prefix caching"
    )
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of the no-sharing workload")
    parser.add_argument("--only", default="", help="comma-separated workload names to run (default all)")
    args = parser.parse_args()

    directory = benchkit.model_dir()
    workloads = [
        Workload("system prompt", LoadLevel("concurrency", 1), 20, 16, shared_prefix=1000, requests=6),
        Workload("8-turn chat", LoadLevel("concurrency", 1), 20, 32, chat_turns=8, requests=16),
        Workload("no sharing", LoadLevel("concurrency", 8), 100, 128, duration=args.duration),
    ]
    if args.only:
        workloads = [w for w in workloads if w.name in set(args.only.split(","))]
    sides: dict[str, dict[str, Any]] = {
        "cache on": {"code": None, "extra": ()},
        "cache off": {"code": None, "extra": ("--prefix-cache-mb", "0")},
    }
    if args.baseline is not None:
        sides["before"] = {"code": args.baseline.resolve(), "extra": ()}
    runs: dict[tuple[str, str], list[tuple[list[RequestRecord], float]]] = {
        (w.name, s): [] for w in workloads for s in sides
    }
    servers: dict[str, benchkit.ServerProcess] = {}
    cache_line = ""
    try:
        for side, spec in sides.items():
            server = benchkit.ServerProcess(
                directory, max_batch_size=8, code=spec["code"], extra=("--no-metrics", *spec["extra"])
            )
            servers[side] = server.__enter__()
        for repetition in range(args.repetitions):
            for workload in workloads:
                order = list(sides)
                if repetition % 2:
                    order.reverse()
                for side in order:
                    if workload.name != "no sharing" and side == "before":
                        continue  # the before side matters only for the cost of having the cache
                    benchkit.wait_for_quiet()
                    print(f"rep {repetition + 1}: {workload.name} on {side}", flush=True)
                    # A fresh seed per repetition draws fresh prompts, prefixes and chats: no
                    # repetition finds what an earlier one cached (within one, the warm-up
                    # request fills the cache with the shared prefix).
                    seed = 7 + 1000 * repetition
                    runs[(workload.name, side)].append(run_once(servers[side].target, workload, seed))
        cache_line = next((line for line in servers["cache on"].log if "prefix cache" in line), "")
    finally:
        for server in servers.values():
            server.__exit__()

    data: dict[str, Any] = {"cache_reported_at_start": cache_line}
    rows: list[list[object]] = []
    for workload in workloads:
        for side in sides:
            if not runs[(workload.name, side)]:
                continue
            figures = summarize(runs[(workload.name, side)])
            data.setdefault(workload.name, {})[side] = figures
            rows.append(
                [
                    workload.name,
                    side,
                    figures["requests"],
                    f"{100 * figures['cached_share']:.0f}%",
                    figures["ttft_p50"] * 1000,
                    figures["ttft_p90"] * 1000,
                    figures["server_prefill_p50"] * 1000,
                    figures["prefill_seconds_per_run"] * 1000,
                    figures["tok_per_s"],
                ]
            )
    columns = [
        "workload",
        "server",
        "requests",
        "prompt cached",
        "TTFT p50 ms",
        "TTFT p90 ms",
        "server prefill p50 ms",
        "prefill per run ms",
        "output tok/s",
    ]
    print(f"\n## Prefix caching: {args.repetitions} repetitions\n")
    print(f"start-up line: `{cache_line.strip()}`\n")
    print(benchkit.markdown_table(columns, rows))
    print("\n### Targets\n")
    system = data.get("system prompt", {})
    if "cache on" in system and "cache off" in system:
        ratio = system["cache on"]["ttft_p50"] / system["cache off"]["ttft_p50"]
        print(f"- shared 1,000-token system prompt: TTFT p50 warm {ratio:.1%} of without (target <= 15%)")
    chat = data.get("8-turn chat", {})
    if "cache on" in chat and "cache off" in chat:
        ratio = chat["cache on"]["prefill_seconds_per_run"] / chat["cache off"]["prefill_seconds_per_run"]
        print(f"- 8-turn chat: prefill time {ratio:.1%} of without (target <= 30%)")
    plain = data.get("no sharing", {})
    if "cache off" in plain and "before" in plain:
        ratio = plain["cache off"]["tok_per_s"] / plain["before"]["tok_per_s"]
        print(f"- no sharing, cache off: {ratio:.3f}x the tok/s of the server without prefix caching")
    if "cache on" in plain and "cache off" in plain:
        ratio = plain["cache on"]["tok_per_s"] / plain["cache off"]["tok_per_s"]
        print(
            f"- no sharing, cache on: {ratio:.3f}x the tok/s with the cache off (what caching misses costs)"
        )
    out = benchkit.save_results("prefix_cache", data)
    print(f"\nresults: {out.relative_to(benchkit.REPO)}")
    chart(data, RESULTS / "prefix_cache.png")


def chart(data: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        benchkit.skip("chart", "matplotlib is not installed")
        return
    panels = [
        ("system prompt", "ttft_p50", 1000, "shared 1,000-token system prompt:\nTTFT p50 (ms)"),
        ("8-turn chat", "prefill_seconds_per_run", 1000, "8-turn chat:\nprefill time per run (ms)"),
        ("no sharing", "tok_per_s", 1, "no sharing, 8 streams:\noutput tok/s"),
    ]
    panels = [p for p in panels if p[0] in data]
    figure, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.5), squeeze=False)
    colours = {"cache on": "#2b7bba", "cache off": "#b0b0b0", "before": "#707070"}
    for axis, (name, metric, scale, title) in zip(axes[0], panels, strict=True):
        sides = list(data[name])
        axis.bar(sides, [data[name][s][metric] * scale for s in sides], color=[colours[s] for s in sides])
        axis.set_title(title)
    figure.suptitle("Prefix caching (SmolLM2-135M, 2 CPU cores)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


if __name__ == "__main__":
    main()

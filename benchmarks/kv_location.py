"""The KV cache's two locations on the CPU, side by side in one run: `--kv-cache-location host`
(NumPy memory, rows moved by NumPy) against `device` (ONNX Runtime memory from the CPU provider's
allocator, rows moved by ONNX Runtime's copy graphs: the code a GPU runs).

Four servers of the default model (8 slots, 2 intra-op threads): each location with the prefix
cache (256 MiB, the default) and each with `--prefix-cache-mb 0` (the cold side of the prefix
workload). Workloads, with `tokenwire bench`:

- one stream: 100-token prompts, 128 new tokens, one client, 4 requests;
- 8 streams: 100-token prompts, 128 new tokens, 8 clients, 24 requests (three waves: slots free
  and refill, so the cache compacts and rows move slot to slot; a fixed count of requests, not a
  time window, so every repetition measures the same work);
- prefix cache: every prompt the same 1,000 tokens and a 20-token question, 16 new tokens, one
  client, 6 requests: warm on the servers with the cache (the warm-up request fills it: every
  block copied out, every measured request's prefix copied into its slot), cold without.

Each repetition runs every workload on every server it concerns, the order of the sides
alternating, after waiting for a quiet machine. The figures are medians; the ratios are device
over host, measured in the same repetitions.

    python benchmarks/kv_location.py [--repetitions 3]
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import benchkit
from bench_workloads import Workload, run_once

from tokenwire.client.bench import LoadLevel, RequestRecord
from tokenwire.client.bench.stats import percentile

LOCATIONS = ("host", "device")


def summarize(runs: list[tuple[list[RequestRecord], float]]) -> dict[str, float]:
    ok = [r for records, _ in runs for r in records if r.outcome == "ok"]
    ttft = [r.first_token for r in ok if r.first_token is not None]
    per_token = [r.server_time_per_output_token for r in ok if r.server_time_per_output_token]
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    return {
        "requests": len(ok),
        "failed": sum(1 for records, _ in runs for r in records) - len(ok),
        "tok_per_s": statistics.median([rate for _, rate in runs]) if runs else float("nan"),
        "ttft_p50": percentile(ttft, 50) if ttft else float("nan"),
        "tpot_p50": percentile(per_token, 50) if per_token else float("nan"),
        "cached_share": sum(r.cached_prompt_tokens for r in ok) / prompt_tokens if prompt_tokens else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--only", default="", help="comma-separated workload names to run (default all)")
    args = parser.parse_args()

    directory = benchkit.model_dir()
    workloads = [
        Workload("one stream", LoadLevel("concurrency", 1), 100, 128, requests=4),
        Workload("8 streams", LoadLevel("concurrency", 8), 100, 128, requests=24),
        Workload(
            "prefix cache", LoadLevel("concurrency", 1), 20, 16, shared_prefix=1000, requests=6, cold_too=True
        ),
    ]
    if args.only:
        workloads = [w for w in workloads if w.name in set(args.only.split(","))]
    sides = {
        **{where: ("--kv-cache-location", where) for where in LOCATIONS},
        **{
            f"{where}, cache off": ("--kv-cache-location", where, "--prefix-cache-mb", "0")
            for where in LOCATIONS
        },
    }
    runs: dict[tuple[str, str], list[tuple[list[RequestRecord], float]]] = {
        (w.name, s): [] for w in workloads for s in sides
    }
    servers: dict[str, benchkit.ServerProcess] = {}
    startup: dict[str, str] = {}
    resident: dict[str, float] = {}
    try:
        for side, extra in sides.items():
            if "cache off" in side and not any(w.cold_too for w in workloads):
                continue
            server = benchkit.ServerProcess(directory, max_batch_size=8, extra=("--no-metrics", *extra))
            servers[side] = server.__enter__()
        for repetition in range(args.repetitions):
            for workload in workloads:
                order = [s for s in servers if workload.cold_too or "cache off" not in s]
                if repetition % 2:
                    order.reverse()
                for side in order:
                    benchkit.wait_for_quiet()
                    print(f"rep {repetition + 1}: {workload.name} on {side}", flush=True)
                    # A fresh seed per repetition and workload: nothing finds what another cached.
                    seed = 11 + 1000 * repetition + 100 * workloads.index(workload)
                    runs[(workload.name, side)].append(run_once(servers[side].target, workload, seed))
        for side, server in servers.items():
            startup[side] = server.kv_cache_line()
            resident[side] = benchkit.rss_bytes(server.pid) / 2**20
    finally:
        for server in servers.values():
            server.__exit__()

    data: dict[str, Any] = {"kv_cache_line": startup, "resident_mib_at_end": resident}
    rows: list[list[object]] = []
    for workload in workloads:
        for side in sides:
            if not runs.get((workload.name, side)):
                continue
            figures = summarize(runs[(workload.name, side)])
            data.setdefault(workload.name, {})[side] = figures
            rows.append(
                [
                    workload.name,
                    side,
                    figures["requests"],
                    f"{100 * figures['cached_share']:.0f}%",
                    figures["tok_per_s"],
                    figures["ttft_p50"] * 1000,
                    figures["tpot_p50"] * 1000,
                ]
            )
    columns = [
        "workload",
        "KV cache",
        "requests",
        "prompt cached",
        "output tok/s",
        "TTFT p50 ms",
        "TPOT p50 ms",
    ]
    print(f"\n## KV cache location on the CPU: {args.repetitions} repetitions\n")
    for side in LOCATIONS:
        rss = resident.get(side, float("nan"))
        print(f"- {side}: `{startup.get(side, '')}`; resident at the end {rss:.0f} MiB")
    print()
    print(benchkit.markdown_table(columns, rows))
    print("\n### Device over host, median of the repetitions' pairs\n")
    ratios: dict[str, float] = {}
    for workload in workloads:
        host, device = runs.get((workload.name, "host")), runs.get((workload.name, "device"))
        if not host or not device:
            continue
        metrics = ("ttft_p50",) if workload.shared_prefix else ("tok_per_s", "tpot_p50")
        for metric in metrics:
            pairs = [
                summarize([d])[metric] / summarize([h])[metric] for h, d in zip(host, device, strict=True)
            ]
            ratios[f"{workload.name} {metric}"] = statistics.median(pairs)
            data.setdefault("pairs", {})[f"{workload.name} {metric}"] = pairs
        if workload.cold_too:
            for where in LOCATIONS:
                warm, cold = runs[(workload.name, where)], runs[(workload.name, f"{where}, cache off")]
                pairs = [
                    summarize([w])["ttft_p50"] / summarize([c])["ttft_p50"]
                    for w, c in zip(warm, cold, strict=True)
                ]
                ratios[f"{where}: warm TTFT over cold"] = statistics.median(pairs)
                data.setdefault("pairs", {})[f"{where}: warm TTFT over cold"] = pairs
    for name, ratio in ratios.items():
        print(f"- {name}: {ratio:.3f}")
    data["ratios"] = ratios
    out = benchkit.save_results("kv_location", data)
    print(f"\nresults: {out.relative_to(benchkit.REPO)}")


if __name__ == "__main__":
    main()
